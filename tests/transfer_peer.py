"""A kvduplex engine in its own process, for the two-process transfer tests.

It fills a region with a deterministic pattern, registers it with a layout, prints one JSON
line with its side-channel address, then prints every notification it receives as a JSON line
until its stdin closes. Run: python transfer_peer.py '{"engine_id": ..., ...}'
"""

import json
import select
import sys
import time

import numpy as np

from kvduplex._core import Engine


def pattern(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


def main() -> None:
    spec = json.loads(sys.argv[1])
    buf = pattern(spec["seed"], spec["num_blocks"] * spec["block_len"])
    secret = spec.get("secret")
    engine = Engine(
        spec["engine_id"],
        spec.get("fingerprint", {"model": "tiny"}),
        secret=secret.encode() if secret else None,
        heartbeat_s=spec.get("heartbeat_s", 1.0),
        peer_error_handling=spec.get("peer_error_handling", False),
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
