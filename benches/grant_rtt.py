"""What a grant costs: the round trip in which a reader asks an owner for the blocks of a named
hold (against its own prompt's fingerprints) and gets the claim, then hands the claim back,
as every pull now does before its first byte is read. Two transfer-core engines in two
processes on loopback, connected once (as a reader is, after its first pull from that owner);
the timed part is `start_lookup(..., request_id=...)` until the answer is in, polled with a
100 µs sleep (an engine step polls once per step). Prints p50/p90/p99 in µs, and the same for
a content lookup (no name) of the same blocks for comparison.

    UCX_NET_DEVICES=lo python benches/grant_rtt.py [--rounds 2000] [--blocks 64]
"""

from __future__ import annotations

import argparse
import json
import select
import statistics
import subprocess
import sys
import time

from kvduplex import protocol

FINGERPRINT = {"model": "grant_rtt"}


def owner(blocks: int, rounds: int) -> None:
    import ctypes

    from kvduplex._core import Engine

    buffer = ctypes.create_string_buffer(4096 * 4)
    engine = Engine("grant-owner", FINGERPRINT, host="127.0.0.1")
    engine.register_region(ctypes.addressof(buffer), len(buffer))
    engine.set_layout([ctypes.addressof(buffer)], 4096, 4096, 4)
    fingerprints = [f"{i + 1:016x}" for i in range(blocks)]
    for i in range(rounds):
        engine.hold(f"turn-{i}", 4, time.time() + 600, fingerprints=fingerprints, turn=True, offer=b"{}")
    print(json.dumps({"port": engine.side_channel_port}), flush=True)
    # Take the readers' releases as an engine step would, until stdin closes.
    while not select.select([sys.stdin], [], [], 0.001)[0] or sys.stdin.readline():
        for sender, payload in engine.take_notifications():
            release = protocol.decode_notification(payload)
            assert isinstance(release, protocol.Release)
            engine.release_hold(sender, release.owner_request_id, release.claim_id)
    engine.close()


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50_us": pick(0.5) * 1e6, "p90_us": pick(0.9) * 1e6, "p99_us": pick(0.99) * 1e6,
            "mean_us": statistics.fmean(ordered) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--role", choices=["owner"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "owner":
        owner(args.blocks, args.rounds)
        return
    import ctypes

    from kvduplex._core import Engine

    proc = subprocess.Popen(
        [sys.executable, __file__, "--role", "owner", "--rounds", str(args.rounds),
         "--blocks", str(args.blocks)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    port = json.loads(proc.stdout.readline())["port"]
    buffer = ctypes.create_string_buffer(4096 * 4)
    reader = Engine("grant-reader", FINGERPRINT, host="127.0.0.1")
    reader.register_region(ctypes.addressof(buffer), len(buffer))
    reader.set_layout([ctypes.addressof(buffer)], 4096, 4096, 4)
    reader.connect("127.0.0.1", port, timeout_s=10)
    fingerprints = [f"{i + 1:016x}" for i in range(args.blocks)]
    results = {}
    for label, name_of in (("grant", lambda i: f"turn-{i}"), ("lookup", lambda i: None)):
        samples = []
        for i in range(args.rounds):
            started = time.perf_counter()
            lookup = reader.start_lookup(
                [("127.0.0.1", port)], fingerprints, 5.0, request_id=name_of(i)
            )
            while (answer := lookup.answers()[0]) is None:
                time.sleep(0.0001)
            samples.append(time.perf_counter() - started)
            _, owner_id, found, error = answer
            assert error is None and found is not None, answer
            owner_request_id, matched, claim_id, _, _ = found
            assert matched == args.blocks
            reader.notify(owner_id, protocol.encode_release(owner_request_id, claim_id))
        results[label] = percentiles(samples)
    reader.close()
    proc.stdin.close()
    proc.wait(timeout=30)
    print(json.dumps({"rounds": args.rounds, "blocks": args.blocks, **results}, indent=2))


if __name__ == "__main__":
    main()
