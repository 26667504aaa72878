"""Two real processes reading each other's memory over real UCX (tcp and shared memory)."""

import ctypes
import gc
import json
import mmap
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest

import kvduplex._core as core
from kvduplex._core import Engine

HERE = Path(__file__).parent
BLOCK = 16 * 1024
NUM_BLOCKS = 512
TRANSPORTS = {"tcp": "tcp,self", "shm": "sm,self"}
# How the reader reads, by fixture id: UCX over tcp; same-host reads (process_vm_readv, a
# batch per call), which UCX_TLS=sm allows; UCX's own shared memory with them turned off (and
# peer error handling too, which none of UCX's shared-memory transports offers).
READ_PATHS = {"tcp": ("tcp", True), "same-host": ("shm", True), "ucx-shm": ("shm", False)}


def pattern(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


class Owner:
    """An engine in another process that owns `NUM_BLOCKS` blocks of random bytes."""

    def __init__(self, engine_id: str, ucx_tls: str, seed: int = 7, **spec):
        env = dict(os.environ, UCX_TLS=ucx_tls, UCX_NET_DEVICES="lo")
        spec = {"engine_id": engine_id, "seed": seed, "block_len": BLOCK, "num_blocks": NUM_BLOCKS, **spec}
        self.seed = seed
        self._pattern = None
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "transfer_peer.py"), json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        )
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"owner process exited with {self.proc.wait()}")
        self.port = json.loads(line)["port"]

    def expected_block(self, block_id: int) -> np.ndarray:
        if self._pattern is None:
            self._pattern = pattern(self.seed, NUM_BLOCKS * BLOCK)
        return self._pattern[block_id * BLOCK:(block_id + 1) * BLOCK]

    def notifications(self, expected: int, timeout_s: float = 30) -> list[dict]:
        """Waits for `expected` notifications, then stops the owner and returns every
        notification it printed (so extra or duplicate ones show up too)."""
        fd = self.proc.stdout.fileno()
        received = b""
        deadline = time.monotonic() + timeout_s
        while received.count(b"\n") < expected and time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                received += chunk
        time.sleep(0.2)  # room for a duplicate to show up before the owner stops
        self.proc.stdin.close()
        while chunk := os.read(fd, 65536):
            received += chunk
        self.proc.wait(timeout=30)
        return [json.loads(line) for line in received.decode().splitlines() if line.strip()]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Reader:
    def __init__(self, engine_id: str, ucx_tls: str, *, owned: bool = False, **kwargs):
        """`owned`: the buffer is registered with itself as the memory's owner."""
        os.environ["UCX_TLS"] = ucx_tls  # read once, when the UCX context is created
        self.buf = np.zeros(NUM_BLOCKS * BLOCK, dtype=np.uint8)
        self.engine = Engine(engine_id, kwargs.pop("fingerprint", {"model": "tiny"}), **kwargs)
        base = self.buf.ctypes.data
        self.engine.register_region(base, self.buf.nbytes, owner=self.buf if owned else None)
        self.engine.set_layout([base], BLOCK, BLOCK, NUM_BLOCKS)

    def block(self, block_id: int) -> np.ndarray:
        return self.buf[block_id * BLOCK:(block_id + 1) * BLOCK]


def read_block_and_check(reader: Reader, peer: str, owner: Owner, local_id: int, remote_id: int) -> None:
    """Reads the owner's block `remote_id` into `local_id` and checks every byte arrived."""
    reader.engine.read_blocks(peer, [local_id], [remote_id]).wait(timeout_s=30)
    np.testing.assert_array_equal(reader.block(local_id), owner.expected_block(remote_id))


@pytest.fixture(params=sorted(READ_PATHS))
def read_path(request):
    return request.param


def start_pair(read_path: str, **kwargs) -> tuple[Owner, Reader]:
    transport, same_host_reads = READ_PATHS[read_path]
    if not same_host_reads:
        kwargs.setdefault("peer_error_handling", False)
    owner = Owner("owner", TRANSPORTS[transport], **kwargs)
    reader = Reader("reader", TRANSPORTS[transport], same_host_reads=same_host_reads, **kwargs)
    return owner, reader


@pytest.fixture
def owner_reader(read_path):
    owner, reader = start_pair(read_path)
    yield owner, reader
    reader.engine.close()
    if owner.proc.poll() is None:
        owner.kill()


def test_scattered_and_contiguous_reads_verify_every_byte(owner_reader, read_path):
    owner, reader = owner_reader
    peer = reader.engine.connect("127.0.0.1", owner.port)
    assert peer.startswith(f"owner@127.0.0.1:{owner.port}#"), peer
    rng = np.random.default_rng(1)
    remote = rng.choice(np.arange(1, NUM_BLOCKS), size=200, replace=False).tolist()
    local = rng.choice(np.arange(1, NUM_BLOCKS), size=200, replace=False).tolist()
    scattered = reader.engine.read_blocks(peer, local, remote, notify=b"scattered")
    # 3.2 MB: a same-host batch this large is copied by the engine's copy thread.
    assert scattered.same_host == (read_path == "same-host")
    scattered.wait(timeout_s=30)
    assert scattered.nbytes == 200 * BLOCK
    for lid, rid in zip(local, remote):
        np.testing.assert_array_equal(reader.block(lid), owner.expected_block(rid))

    run = list(range(300, 350))
    contiguous = reader.engine.read_blocks(peer, run, run, notify=b"run")
    contiguous.wait(timeout_s=30)
    assert contiguous.num_descriptors == 1
    assert contiguous.done()
    for bid in run:
        np.testing.assert_array_equal(reader.block(bid), owner.expected_block(bid))

    notes = owner.notifications(expected=2)
    assert sorted(n["payload"] for n in notes) == ["run", "scattered"]
    # The sender is the reader's engine id and its connection: the same one for both.
    assert len({n["from"] for n in notes}) == 1 and notes[0]["from"].startswith("reader#")


def test_each_notification_arrives_exactly_once_in_order(owner_reader):
    owner, reader = owner_reader
    peer = reader.engine.connect("127.0.0.1", owner.port)
    for i in range(20):
        reader.engine.read_blocks(peer, [i + 1], [i + 1], notify=f"req-{i}".encode()).wait(timeout_s=30)
    reader.engine.notify(peer, b"no-read")
    notes = owner.notifications(expected=21)
    assert [n["payload"] for n in notes] == [f"req-{i}" for i in range(20)] + ["no-read"]


@pytest.mark.parametrize(
    ("local", "remote", "message"),
    [
        ([1], [-1], "-1"),
        ([1], [NUM_BLOCKS], str(NUM_BLOCKS)),
        ([-5], [1], "-5"),
        ([1, 2], [1], "length"),
        ([1], [2**40], str(2**40)),
    ],
)
def test_bad_block_ids_are_refused_before_anything_is_read(owner_reader, local, remote, message):
    owner, reader = owner_reader
    peer = reader.engine.connect("127.0.0.1", owner.port)
    with pytest.raises(core.PlanError, match=message) as info:
        reader.engine.read_blocks(peer, local, remote)
    assert isinstance(info.value, ValueError)
    assert not reader.buf.any()


def test_registering_memory_that_is_not_mapped_is_refused():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = mmap.PAGESIZE
    rw, private_anonymous = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    addr = libc.mmap(None, 3 * page, rw, private_anonymous, -1, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value)
    reader = Reader("unmapped", TRANSPORTS["tcp"])
    try:
        assert libc.munmap(addr + page, page) == 0  # a hole in the middle
        with pytest.raises(core.UcxError, match="not mapped"):
            reader.engine.register_region(addr, 3 * page)
        with pytest.raises(core.UcxError, match="not mapped"):
            reader.engine.register_region(addr + page, 1)
        reader.engine.register_region(addr, page)  # the mapped part alone is fine
    finally:
        reader.engine.close()
        libc.munmap(addr, 3 * page)


def test_unknown_peer_and_closed_engine_errors():
    reader = Reader("lonely", TRANSPORTS["tcp"])
    with pytest.raises(core.PeerNotConnectedError, match="nobody"):
        reader.engine.read_blocks("nobody", [1], [1])
    reader.engine.close()
    with pytest.raises(core.TransferError, match="closed"):
        reader.engine.register_region(reader.buf.ctypes.data, 10)


def test_incompatible_fingerprint_names_the_field():
    owner = Owner("owner", TRANSPORTS["tcp"], fingerprint={"model": "tiny", "dtype": "float16"})
    reader = Reader("reader", TRANSPORTS["tcp"], fingerprint={"model": "tiny", "dtype": "float32"})
    try:
        with pytest.raises(core.IncompatiblePeerError, match="dtype"):
            reader.engine.connect("127.0.0.1", owner.port, timeout_s=5)
    finally:
        reader.engine.close()
        owner.kill()


@pytest.mark.parametrize(
    ("owner_secret", "reader_secret", "message"),
    [("s3cret", None, "secret"), ("s3cret", "wrong", "auth"), (None, "s3cret", "secret")],
)
def test_shared_secret_is_enforced(owner_secret, reader_secret, message):
    owner = Owner("owner", TRANSPORTS["tcp"], secret=owner_secret)
    reader = Reader("reader", TRANSPORTS["tcp"], secret=reader_secret.encode() if reader_secret else None)
    try:
        with pytest.raises(core.AuthenticationError, match=f"(?i){message}"):
            reader.engine.connect("127.0.0.1", owner.port, timeout_s=5)
    finally:
        reader.engine.close()
        owner.kill()


def test_matching_secret_connects_and_reads():
    owner = Owner("owner", TRANSPORTS["tcp"], secret="s3cret")
    reader = Reader("reader", TRANSPORTS["tcp"], secret=b"s3cret")
    try:
        peer = reader.engine.connect("127.0.0.1", owner.port, timeout_s=5)
        read_block_and_check(reader, peer, owner, 3, 4)
    finally:
        reader.engine.close()
        owner.kill()


def test_garbage_on_the_side_channel_does_not_break_the_owner():
    owner = Owner("owner", TRANSPORTS["tcp"])
    try:
        for junk in [b"", b"\x00" * 3, b"GET / HTTP/1.1\r\n\r\n", os.urandom(4096)]:
            with socket.create_connection(("127.0.0.1", owner.port), timeout=5) as s:
                s.sendall(junk)
        reader = Reader("reader", TRANSPORTS["tcp"])
        try:
            peer = reader.engine.connect("127.0.0.1", owner.port, timeout_s=5)
            read_block_and_check(reader, peer, owner, 1, 1)
        finally:
            reader.engine.close()
    finally:
        owner.kill()


def test_unreachable_peer_fails_within_the_connect_deadline():
    reader = Reader("reader", TRANSPORTS["tcp"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        with pytest.raises(core.HandshakeError):
            reader.engine.connect("127.0.0.1", port, timeout_s=0.5)
    finally:
        reader.engine.close()


def test_reader_whose_owner_is_killed_gets_a_failure_not_a_hang(read_path):
    owner, reader = start_pair(read_path, heartbeat_s=0.2)
    try:
        peer = reader.engine.connect("127.0.0.1", owner.port)
        reader.engine.read_blocks(peer, [1], [1]).wait(timeout_s=30)
        owner.kill()
        deadline = time.monotonic() + 10
        while reader.engine.peer_alive(peer) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not reader.engine.peer_alive(peer)
        with pytest.raises(core.PeerNotConnectedError):
            reader.engine.read_blocks(peer, [2], [2])
    finally:
        reader.engine.close()


def test_a_same_host_read_of_a_frozen_owner_completes_and_a_dead_one_fails_cleanly():
    # Same-host reads need nothing from the owner: a stopped one is read at once, every byte.
    owner, reader = start_pair("same-host", heartbeat_s=30.0)
    try:
        peer = reader.engine.connect("127.0.0.1", owner.port)
        owner.proc.send_signal(signal.SIGSTOP)
        small = reader.engine.read_blocks(peer, [1, 2], [3, 4], timeout_s=5)
        small.wait(timeout_s=5)
        assert small.same_host
        ids = list(range(1, 400))
        transfer = reader.engine.read_blocks(peer, ids, ids, timeout_s=5)
        transfer.wait(timeout_s=5)
        assert transfer.same_host
        for bid in ids:
            np.testing.assert_array_equal(reader.block(bid), owner.expected_block(bid))
        owner.kill()
        # Dead: refused (the side channel noticed) or failed by the read itself, never a hang
        # or another process's bytes.
        with pytest.raises((core.TransferError, core.PeerNotConnectedError)):
            reader.engine.read_blocks(peer, ids, ids, timeout_s=5).wait(timeout_s=5)
    finally:
        reader.engine.close()
        if owner.proc.poll() is None:
            owner.kill()


def test_a_same_host_batch_past_its_deadline_fails_alone_and_the_peer_stays_usable():
    owner, reader = start_pair("same-host")
    try:
        peer = reader.engine.connect("127.0.0.1", owner.port)
        # 200,000 reads of 16 KiB (3.3 GB, duplicates allowed): far longer than 50 ms to copy.
        ids = [1 + i % (NUM_BLOCKS - 1) for i in range(200_000)]
        transfer = reader.engine.read_blocks(peer, ids, ids, timeout_s=0.05)
        assert transfer.same_host
        with pytest.raises(core.TransferError, match="deadline"):
            transfer.wait(timeout_s=30)
        assert reader.engine.peer_alive(peer), "no endpoint to abort: the peer stays connected"
        reader.buf[:] = 0
        time.sleep(0.3)
        assert not reader.buf.any(), "a byte landed after the batch was reported failed"
        read_block_and_check(reader, peer, owner, 5, 6)
    finally:
        reader.engine.close()
        owner.kill()


@pytest.mark.parametrize("peer_error_handling", [True, False], ids=["default", "off"])
def test_deadline_fails_the_batch_and_no_late_byte_lands(peer_error_handling):
    owner = Owner("owner", TRANSPORTS["tcp"], peer_error_handling=peer_error_handling)
    reader = Reader("reader", TRANSPORTS["tcp"], peer_error_handling=peer_error_handling)
    try:
        peer = reader.engine.connect("127.0.0.1", owner.port)
        owner.proc.send_signal(19)  # SIGSTOP: alive but silent, so only the deadline can end it
        ids = list(range(1, NUM_BLOCKS))
        transfer = reader.engine.read_blocks(peer, ids, ids, timeout_s=0.5)
        try:
            transfer.wait(timeout_s=5)
        except TimeoutError:
            # Without peer error handling UCX may not cancel a read the stopped owner has not
            # served: the batch stays pending (never reported while a byte of it may land)
            # until the owner serves it or dies. Let it serve.
            assert peer_error_handling is False, "with peer error handling the abort cancels every read"
            owner.proc.send_signal(18)
        except core.TransferError:
            pass
        with pytest.raises(core.TransferError, match="deadline"):
            transfer.wait(timeout_s=20)
        # Reported failed: from here on nothing of it may land.
        reader.buf[:] = 0
        owner.proc.send_signal(18)  # the owner now serves whatever it had queued
        time.sleep(1.0)
        assert not reader.buf.any(), "bytes of a failed batch landed after it was reported failed"
        peer = reader.engine.connect("127.0.0.1", owner.port)
        read_block_and_check(reader, peer, owner, 5, 6)
    finally:
        owner.proc.send_signal(18)
        reader.engine.close()
        owner.kill()


def test_close_releases_everything():
    Reader("warmup", TRANSPORTS["tcp"]).engine.close()  # UCX's process-wide state starts once
    fds_before = sorted(os.listdir("/proc/self/fd"))
    threads_before = len(os.listdir("/proc/self/task"))
    for i in range(5):
        reader = Reader(f"r{i}", TRANSPORTS["tcp"])
        reader.engine.close()
        reader.engine.close()
    assert len(os.listdir("/proc/self/task")) == threads_before
    assert sorted(os.listdir("/proc/self/fd")) == fds_before


def test_reader_whose_owner_is_killed_mid_batch_fails_before_its_deadline():
    # Over tcp the owner's worker serves the reads, so a stopped owner leaves the batch in
    # flight; killing it must fail the batch long before its 60 s deadline.
    owner = Owner("owner", TRANSPORTS["tcp"], heartbeat_s=0.2)
    reader = Reader("reader", TRANSPORTS["tcp"], heartbeat_s=0.2)
    try:
        peer = reader.engine.connect("127.0.0.1", owner.port)
        owner.proc.send_signal(19)
        ids = list(range(1, NUM_BLOCKS))
        transfer = reader.engine.read_blocks(peer, ids, ids, timeout_s=60)
        assert not transfer.done()
        owner.kill()
        # Whichever notices first (UCX's connection reset or the side channel) fails it; a
        # hang would end in TimeoutError instead.
        with pytest.raises(core.TransferError, match="gone|reset|Endpoint timeout"):
            transfer.wait(timeout_s=30)
    finally:
        reader.engine.close()


def test_huge_timeouts_are_no_panic_and_an_unclosed_engine_drops_without_hanging(tmp_path):
    """Regressions: `timeout_s=1e19` overflowed `Instant + Duration` (a PanicException that
    `except Exception` misses); dropping an engine without close() at INFO logging deadlocked
    (its threads log through Python's logging while the drop held the GIL)."""
    script = tmp_path / "drop_unclosed.py"
    script.write_text(
        "import logging, numpy as np\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from kvduplex._core import Engine\n"
        "buffers = [np.zeros(4 * 4096, dtype=np.uint8) for _ in range(2)]\n"
        "engines = []\n"
        "for i, buf in enumerate(buffers):\n"
        "    e = Engine(f'e{i}', {'m': 'x'})\n"
        "    e.register_region(buf.ctypes.data, buf.nbytes)\n"
        "    e.set_layout([buf.ctypes.data], 4096, 4096, 4)\n"
        "    engines.append(e)\n"
        "owner, reader = engines\n"
        "peer = reader.connect(owner.side_channel_host, owner.side_channel_port, timeout_s=1e19)\n"
        "reader.read_blocks(peer, [1], [2], timeout_s=1e19).wait(timeout_s=1e19)\n"
        "del owner, reader, engines\n"
        "print('dropped', flush=True)\n"
    )
    env = dict(os.environ, UCX_TLS="tcp,self", UCX_NET_DEVICES="lo")
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "dropped" in done.stdout


def test_a_non_loopback_side_channel_without_a_secret_is_refused_unless_allowed():
    with pytest.raises(core.HandshakeError, match="without a shared secret"):
        Engine("open", {"m": "x"}, host="0.0.0.0")
    Engine("open", {"m": "x"}, host="0.0.0.0", allow_unauthenticated=True).close()
    Engine("closed", {"m": "x"}, host="0.0.0.0", secret=b"s").close()


def _userfaultfd_available() -> bool:
    sys.path.insert(0, str(HERE))
    from transfer_peer import userfaultfd

    fd = userfaultfd()
    if fd >= 0:
        os.close(fd)
    return fd >= 0


@pytest.mark.skipif(not _userfaultfd_available(), reason="userfaultfd needs root or vm.unprivileged_userfaultfd=1")
def test_a_same_host_read_that_never_returns_stalls_only_its_peer_and_close_gives_up_on_it():
    """An owner whose memory never arrives (userfaultfd; FUSE blocks alike) keeps a same-host
    copy waiting in the kernel for good: another owner's batches still complete meanwhile, and
    the reader's close returns (its memory registered with its owner, which the engine holds
    while the copy may still write)."""
    half = NUM_BLOCKS // 2
    stuck = Owner("stuck", TRANSPORTS["shm"], stall_from_block=half)
    healthy = Owner("healthy", TRANSPORTS["shm"], seed=9)
    reader = Reader("reader", TRANSPORTS["shm"], owned=True)
    closer = threading.Thread(target=reader.engine.close)
    try:
        stuck_peer = reader.engine.connect("127.0.0.1", stuck.port)
        healthy_peer = reader.engine.connect("127.0.0.1", healthy.port)
        # 2 MiB from the stalled half.
        hung = reader.engine.read_blocks(stuck_peer, list(range(128)), list(range(half, half + 128)), timeout_s=60)
        assert hung.same_host
        time.sleep(0.5)
        assert not hung.done()
        ids = list(range(128, 256))
        for size in (1, len(ids)):  # a small batch and a 2 MiB one
            reader.engine.read_blocks(healthy_peer, ids[:size], ids[:size], timeout_s=10).wait(timeout_s=10)
        for block_id in ids:
            np.testing.assert_array_equal(reader.block(block_id), healthy.expected_block(block_id))
        started = time.monotonic()
        closer.start()
        closer.join(timeout=30)
        assert not closer.is_alive(), "close is still waiting for the stuck copy"
        print(f"close returned after {time.monotonic() - started:.1f} s with a copy stuck")
    finally:
        stuck.kill()  # ends the stuck copy (the memory it waits for is gone)
        healthy.kill()
        if closer.ident is not None:
            closer.join()


POISON = 0xA5


@pytest.mark.skipif(not _userfaultfd_available(), reason="userfaultfd needs root or vm.unprivileged_userfaultfd=1")
def test_close_never_returns_while_a_write_can_land_in_memory_it_does_not_keep():
    """A same-host copy blocked in the kernel writes into memory registered without its owner,
    which the caller keeps only until close returns: close waits for the copy, however long,
    so that nothing lands once it returned (it gave up after 2 s, and the copy, released then,
    wrote into memory the caller had poisoned)."""
    half = NUM_BLOCKS // 2
    stuck = Owner("stuck", TRANSPORTS["shm"], stall_from_block=half)
    reader = Reader("reader", TRANSPORTS["shm"])
    closer = threading.Thread(target=reader.engine.close)
    try:
        peer = reader.engine.connect("127.0.0.1", stuck.port)
        hung = reader.engine.read_blocks(peer, list(range(128)), list(range(half, half + 128)), timeout_s=60)
        assert hung.same_host
        time.sleep(0.5)
        assert not hung.done()
        started = time.monotonic()
        closer.start()
        closer.join(timeout=5)  # past close's 2 s drain
        returned_early = not closer.is_alive()
        if returned_early:
            reader.buf[:] = POISON
        stuck.proc.send_signal(signal.SIGUSR1)  # the copy goes on, and reads zeros
        closer.join(timeout=30)
        assert not closer.is_alive(), "close still waits once the copy could end"
        print(f"close returned after {time.monotonic() - started:.1f} s, once the copy ended")
        if not returned_early:
            reader.buf[:] = POISON
        time.sleep(0.5)
        assert (reader.buf == POISON).all(), "a byte landed after close returned"
        assert not returned_early, "close returned while the copy could still write"
    finally:
        stuck.kill()
        if closer.ident is not None:
            closer.join()


def test_close_with_reads_to_a_frozen_peer_on_another_host_returns_with_none_outstanding():
    """A peer read through UCX (over tcp here, as one on another host is) gets peer error
    handling by default: close with reads outstanding to it, stopped, cancels them (a force
    close, which needs no reply from the peer) and returns with none of them still able to
    write. Without error handling (the old default) close returned with the reads out, their
    batch pending, after a 2 s flush and a 2 s drain: free to land where a transport writes
    without our progress (RDMA, GPU copies); now it would wait for them."""
    owner = Owner("owner", TRANSPORTS["tcp"])
    reader = Reader("reader", TRANSPORTS["tcp"])
    try:
        peer = reader.engine.connect("127.0.0.1", owner.port)
        owner.proc.send_signal(signal.SIGSTOP)
        ids = list(range(1, NUM_BLOCKS))
        transfer = reader.engine.read_blocks(peer, ids, ids, timeout_s=60)
        time.sleep(0.3)
        assert not transfer.done()
        started = time.monotonic()
        reader.engine.close()
        print(f"close returned after {time.monotonic() - started:.2f} s")
        reader.buf[:] = POISON
        with pytest.raises(core.TransferError):
            transfer.done()  # settled: no read of it is outstanding
        owner.proc.send_signal(signal.SIGCONT)
        time.sleep(1.0)
        assert (reader.buf == POISON).all(), "a byte landed after close returned"
    finally:
        owner.proc.send_signal(signal.SIGCONT)
        owner.kill()


@pytest.mark.skipif(not _userfaultfd_available(), reason="userfaultfd needs root or vm.unprivileged_userfaultfd=1")
def test_a_region_keeps_its_owner_alive_while_a_write_may_land():
    """Registered with its owner, memory outlives close while a copy that close could not stop
    may still write into it: the engine holds the owner until the copy ended."""
    half = NUM_BLOCKS // 2
    stuck = Owner("stuck", TRANSPORTS["shm"], stall_from_block=half)
    reader = Reader("reader", TRANSPORTS["shm"], owned=True)
    try:
        peer = reader.engine.connect("127.0.0.1", stuck.port)
        hung = reader.engine.read_blocks(peer, list(range(128)), list(range(half, half + 128)), timeout_s=60)
        time.sleep(0.5)
        assert not hung.done()
        reader.engine.close()  # gives up on the copy after its drain
        owner = weakref.ref(reader.buf)
        del reader.buf, hung
        gc.collect()
        assert owner() is not None, "the memory's owner was let go while a copy may write into it"
        stuck.proc.send_signal(signal.SIGUSR1)  # the copy ends
        deadline = time.monotonic() + 30
        while owner() is not None and time.monotonic() < deadline:
            reader.engine.close()  # a call into the core takes the references dropped meanwhile
            gc.collect()
            time.sleep(0.05)
        assert owner() is None, "the owner was never let go once the copy ended"
    finally:
        stuck.kill()


def _first_line_with(owner: Owner, needle: bytes, timeout_s: float) -> float | None:
    """When (time.monotonic) the owner printed a line containing `needle`; None if it did not
    within `timeout_s`."""
    fd = owner.proc.stdout.fileno()
    received = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.01)
        if ready:
            received += os.read(fd, 65536)
            if needle in received:
                return time.monotonic()
    return None


def test_a_stalled_owner_delays_only_its_own_notifications_and_lookups():
    """Each owner's link queues and writes its own frames: an owner that stops reading (stopped,
    its socket full) delays neither another owner's notifications nor the thread asking it for
    a lookup. Before, one notifier thread wrote to every owner in turn, each write bounded by the
    side channel's 10 s write timeout, and a lookup's write waited behind it for the link."""
    # Silent for up to 3 x 20 s before the reader calls it gone: stalled, not dead.
    stalled = Owner("stalled", TRANSPORTS["tcp"], heartbeat_s=20)
    healthy = Owner("healthy", TRANSPORTS["tcp"], seed=9)
    reader = Reader("reader", TRANSPORTS["tcp"])
    try:
        stalled_peer = reader.engine.connect("127.0.0.1", stalled.port)
        healthy_peer = reader.engine.connect("127.0.0.1", healthy.port)
        stalled.proc.send_signal(signal.SIGSTOP)
        payload = b"x" * (512 << 10)
        queued = 0
        for _ in range(80):  # 40 MiB: past the socket's buffers and the link's queue
            try:
                reader.engine.notify(stalled_peer, payload)
                queued += len(payload)
            except core.HandshakeError:
                break  # the link's queue is full
        time.sleep(0.5)  # the writer is blocked in a write to the stalled owner by now
        started = time.monotonic()
        reader.engine.notify(healthy_peer, b"not-delayed")
        arrived = _first_line_with(healthy, b"not-delayed", timeout_s=30)
        assert arrived is not None, "the healthy owner never got its notification"
        delay_s = arrived - started
        started = time.monotonic()
        lookup = reader.engine.start_lookup([("127.0.0.1", stalled.port)], ["00000000000000aa"], 1.0)
        lookup_s = time.monotonic() - started
        print(f"{queued >> 20} MiB queued for the stalled owner; the healthy owner's notification "
              f"arrived after {delay_s * 1000:.1f} ms; start_lookup of the stalled owner took "
              f"{lookup_s * 1000:.1f} ms")
        # Liveness bounds, far below the 10 s write timeout the old notifier waited out.
        assert delay_s < 5, f"the healthy owner's notification waited {delay_s:.1f} s"
        assert lookup_s < 5, f"start_lookup waited {lookup_s:.1f} s for the stalled owner"
        assert lookup.asked == 1
    finally:
        stalled.proc.send_signal(signal.SIGCONT)
        reader.engine.close()
        stalled.kill()
        healthy.kill()
