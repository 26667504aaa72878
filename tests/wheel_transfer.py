"""One two-engine transfer with nothing but an installed kvduplex wheel and the standard library
(no numpy, nothing from this repository): what a user can run right after `pip install kvduplex`.

`python wheel_transfer.py` is the reader: it starts an owner engine in a child process (this file
with `owner`), connects to it, reads some of its blocks, checks every byte, waits for the owner to
report the read-done notification, and prints one JSON line. Exit status 0 means it all worked.
"""

from __future__ import annotations

import ctypes
import json
import random
import select
import subprocess
import sys
import time

import kvduplex
from kvduplex._core import Engine

BLOCK = 4096
NUM_BLOCKS = 64
SEED = 11
FINGERPRINT = {"model": "wheel-check"}
NOTIFY = b"wheel-check-done"


def pattern() -> bytes:
    return random.Random(SEED).randbytes(BLOCK * NUM_BLOCKS)


def engine_with_blocks(engine_id: str, data: bytes | None) -> tuple[Engine, ctypes.Array]:
    """An engine whose layout is NUM_BLOCKS blocks of one registered buffer (zeros if no data)."""
    buf = ctypes.create_string_buffer(BLOCK * NUM_BLOCKS)
    if data is not None:
        ctypes.memmove(buf, data, len(data))
    engine = Engine(engine_id, FINGERPRINT)
    base = ctypes.addressof(buf)
    engine.register_region(base, len(buf))
    engine.set_layout([base], BLOCK, BLOCK, NUM_BLOCKS)
    return engine, buf


def owner() -> None:
    """Prints its side-channel port, then the first notification it receives; exits when its
    stdin closes (after the reader closed its engine, so neither logs the other's departure)."""
    engine, _buf = engine_with_blocks("owner", pattern())
    print(json.dumps({"port": engine.side_channel_port}), flush=True)
    deadline = time.monotonic() + 60
    while not (notifications := engine.take_notifications()):
        if time.monotonic() > deadline:
            sys.exit("owner: no notification within 60 s")
        time.sleep(0.005)
    for sender, payload in notifications:
        print(json.dumps({"from": sender, "payload": payload.decode()}), flush=True)
    sys.stdin.read()
    engine.close()


def read_json_line(proc: subprocess.Popen, timeout_s: float) -> dict:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else b""
    if not line:
        proc.kill()
        raise SystemExit(f"reader: owner gave no line in {timeout_s} s (exit {proc.wait()})")
    return json.loads(line)


def reader() -> None:
    proc = subprocess.Popen(
        [sys.executable, __file__, "owner"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        port = read_json_line(proc, 30)["port"]
        engine, buf = engine_with_blocks("reader", None)
        peer = engine.connect("127.0.0.1", port, timeout_s=10)
        remote = [5, 6, 7, 40, 63, 0]  # a contiguous run and scattered blocks
        local = [10, 11, 12, 1, 2, 50]
        started = time.monotonic()
        transfer = engine.read_blocks(peer, local, remote, notify=NOTIFY, timeout_s=30)
        transfer.wait(timeout_s=30)
        elapsed_s = time.monotonic() - started
        expected = pattern()
        got = buf.raw
        for lid, rid in zip(local, remote):
            if got[lid * BLOCK : (lid + 1) * BLOCK] != expected[rid * BLOCK : (rid + 1) * BLOCK]:
                raise SystemExit(f"reader: block {rid} -> {lid} differs")
        untouched = set(range(NUM_BLOCKS)) - set(local)
        if any(got[b * BLOCK : (b + 1) * BLOCK].count(0) != BLOCK for b in untouched):
            raise SystemExit("reader: a block that was not read changed")
        notification = read_json_line(proc, 30)
        engine.close()
        proc.stdin.close()
        if proc.wait(timeout=30) != 0:
            raise SystemExit(f"reader: owner exited with {proc.returncode}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(
        json.dumps(
            {
                "peer": peer,
                "nbytes": transfer.nbytes,
                "num_descriptors": transfer.num_descriptors,
                "seconds": elapsed_s,
                "notification": notification,
                "kvduplex": kvduplex.__file__,
            }
        )
    )


if __name__ == "__main__":
    owner() if sys.argv[1:] == ["owner"] else reader()
