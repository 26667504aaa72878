"""A kvduplex engine in its own process, for the two-process transfer tests.

It fills a region with a deterministic pattern, registers it with a layout, prints one JSON
line with its side-channel address, then prints every notification it receives as a JSON line
until its stdin closes. Run: python transfer_peer.py '{"engine_id": ..., ...}'
"""

import ctypes
import json
import mmap
import os
import select
import signal
import sys
import time

import numpy as np

from kvduplex._core import Engine


def pattern(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


SYS_USERFAULTFD = 323  # x86_64
UFFD_API = 0xAA
UFFDIO_API = 0xC018AA3F  # _IOWR(0xAA, 0x3F, struct uffdio_api)
UFFDIO_REGISTER = 0xC020AA00  # _IOWR(0xAA, 0x00, struct uffdio_register)
UFFDIO_REGISTER_MODE_MISSING = 1
UFFDIO_UNREGISTER = 0x8010AA01  # _IOR(0xAA, 0x01, struct uffdio_range)


def userfaultfd() -> int:
    """A userfaultfd descriptor (-1 where the kernel refuses one: not root and
    vm.unprivileged_userfaultfd=0)."""
    return ctypes.CDLL(None, use_errno=True).syscall(SYS_USERFAULTFD, os.O_CLOEXEC)


def stalling_buffer(data: np.ndarray, stall_from: int) -> tuple[mmap.mmap, np.ndarray, int]:
    """`data` in fresh anonymous memory whose bytes from `stall_from` on (page-aligned) are
    never served: they are registered with a userfaultfd nobody reads, so any access to them,
    `process_vm_readv` from another process included, waits until this process exits or gets
    SIGUSR1 (which unregisters them: the waiting accesses then read zeros)."""
    libc = ctypes.CDLL(None, use_errno=True)
    m = mmap.mmap(-1, data.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = np.frombuffer(m, dtype=np.uint8)
    buf[:stall_from] = data[:stall_from]
    uffd = userfaultfd()
    api = (ctypes.c_uint64 * 3)(UFFD_API, 0, 0)
    register = (ctypes.c_uint64 * 4)(
        buf.ctypes.data + stall_from, data.nbytes - stall_from, UFFDIO_REGISTER_MODE_MISSING, 0
    )
    for request, arg in ((UFFDIO_API, api), (UFFDIO_REGISTER, register)):
        if uffd < 0 or libc.ioctl(uffd, ctypes.c_ulong(request), ctypes.byref(arg)) != 0:
            raise OSError(ctypes.get_errno(), "userfaultfd setup failed")
    def release(*_) -> None:
        """Unregisters the range: the accesses waiting on it go on, and read zeros."""
        unregister = (ctypes.c_uint64 * 2)(buf.ctypes.data + stall_from, data.nbytes - stall_from)
        libc.ioctl(uffd, ctypes.c_ulong(UFFDIO_UNREGISTER), ctypes.byref(unregister))

    signal.signal(signal.SIGUSR1, release)
    return m, buf, uffd


def main() -> None:
    spec = json.loads(sys.argv[1])
    buf = pattern(spec["seed"], spec["num_blocks"] * spec["block_len"])
    if "stall_from_block" in spec:  # kept referenced (and the descriptor open) until exit
        mapping, buf, uffd = stalling_buffer(buf, spec["stall_from_block"] * spec["block_len"])
    secret = spec.get("secret")
    engine = Engine(
        spec["engine_id"],
        spec.get("fingerprint", {"model": "tiny"}),
        secret=secret.encode() if secret else None,
        heartbeat_s=spec.get("heartbeat_s", 1.0),
        peer_error_handling=spec.get("peer_error_handling", True),
    )
    base = buf.ctypes.data
    engine.register_region(base, buf.nbytes)
    engine.set_layout([base], spec["block_len"], spec["block_len"], spec["num_blocks"])
    print(json.dumps({"port": engine.side_channel_port, "engine_id": engine.engine_id}), flush=True)
    while True:
        for sender, payload in engine.take_notifications():
            print(json.dumps({"from": sender, "payload": payload.decode()}), flush=True)
        ready, _, _ = select.select([sys.stdin], [], [], 0.01)
        if ready and not sys.stdin.readline():
            break
        time.sleep(0.001)
    engine.close()


if __name__ == "__main__":
    main()
