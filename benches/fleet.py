"""What a lookup costs as the fleet of D's grows: P hands every D it knows to each lookup
(python/kvduplex/connector/worker_lookup.py, `WorkerLookups`); its transfer core asks only the D's
whose announcements of what they hold have the prompt (and any whose announcements are not
complete yet), answers the others "no match" at once, and reports once all answered.

One process per D: a transfer-core engine holding `--turns` finished turns of `--blocks`
blocks each (conversation c is held by D c mod 16 alone, so each lookup has one hit and N-1
misses), releasing readers' claims as an engine step would. P is a transfer-core engine in
this process, connected to every D beforehand (as P's worker connects to its lookup targets
ahead of time). For each fleet size N in `--sizes`, a block of `--rounds` lookups asks the
first N D's for a conversation one of them holds, polls the answers every `--poll-us` µs (an
engine step polls once per step) until all N are in, and hands the hit's claim back. Blocks
of every size run in turn, `--cycles` times (reversed every other cycle), so load drifts
touch every size alike.

Per size: the lookup's latency p50/p90/p99 (start_lookup until the last answer), how long
start_lookup itself takes (it sends to every connected target on the caller's thread), P's CPU per
lookup (this process, all threads, CLOCK_PROCESS_CPUTIME_ID) split by thread (Python's main
thread: start_lookup, polling, the answers; the transfer core's threads by name), and the
asked D's CPU per lookup (their processes' threads, from /proc). The idle CPU of P and of the
D's (heartbeats, the D's notification polls) over `--idle-s` before the run is reported
beside it, not subtracted.

    UCX_NET_DEVICES=lo PYTHONPATH=python .venv/bin/python benches/fleet.py --json OUT

With $KVDUPLEX_SECRET set every engine authenticates its peers and tags every side-channel
frame (as between hosts, where the secret is required).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time
from collections import defaultdict

from kvduplex import protocol

FINGERPRINT = {"model": "fleet"}
HOST = "127.0.0.1"


def fingerprints(conversation: int, blocks: int) -> list[str]:
    """A conversation's block fingerprints: its first block differs from every other's."""
    return [f"{(conversation << 20) | (i + 1):016x}" for i in range(blocks)]


def secret() -> bytes | None:
    value = os.environ.get("KVDUPLEX_SECRET")
    return value.encode() if value else None


def owner(index: int, fleet: int, turns: int, blocks: int) -> None:
    import ctypes

    from kvduplex._core import Engine

    buffer = ctypes.create_string_buffer(4096 * 4)
    engine = Engine(f"fleet-d{index}", FINGERPRINT, host=HOST, secret=secret())
    engine.register_region(ctypes.addressof(buffer), len(buffer))
    engine.set_layout([ctypes.addressof(buffer)], 4096, 4096, 4)
    for t in range(turns):
        conversation = index + t * fleet
        engine.hold(f"turn-{conversation}", 4, time.time() + 3600,
                    fingerprints=fingerprints(conversation, blocks), turn=True, offer=b"{}")
    print(json.dumps({"port": engine.side_channel_port, "pid": os.getpid()}), flush=True)
    # Take the readers' releases every 10 ms (an engine step would), until stdin closes.
    while not select.select([sys.stdin], [], [], 0.01)[0] or sys.stdin.readline():
        for sender, payload in engine.take_notifications():
            release = protocol.decode_notification(payload)
            assert isinstance(release, protocol.Release)
            engine.release_hold(sender, release.owner_request_id, release.claim_id)
    engine.close()


def thread_cpu(pid: int | str = "self") -> dict[str, float]:
    """CPU seconds per thread name of a process (exact: schedstat's run time)."""
    out: dict[str, float] = defaultdict(float)
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"{base}/{tid}/schedstat") as f:
                out[name] += int(f.read().split()[0]) / 1e9
        except OSError:
            continue  # the thread ended
    return out


def process_cpu(pid: int) -> float:
    return sum(thread_cpu(pid).values())


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50_us": round(pick(0.5) * 1e6, 1), "p90_us": round(pick(0.9) * 1e6, 1),
            "p99_us": round(pick(0.99) * 1e6, 1),
            "mean_us": round(statistics.fmean(ordered) * 1e6, 1)}


def run_block(reader, targets, size: int, first_round: int, args) -> tuple[list, list, float, int]:
    """`args.rounds` lookups of the first `size` targets; (latencies, start_lookup's own
    times: sending to the targets asked on the caller's thread, P's CPU seconds, D's asked)."""
    poll_s = args.poll_us / 1e6
    latencies, sends, asked_total = [], [], 0
    cpu_before = time.process_time()
    for r in range(first_round, first_round + args.rounds):
        holder = r % size
        conversation = holder + 16 * (r // size % args.turns)
        wanted = fingerprints(conversation, args.blocks)
        started = time.perf_counter()
        # With a router's hint (`--hinted`) P asks the one D the hint names: the holder.
        asked = [targets[holder]] if args.hinted else targets[:size]
        lookup = reader.start_lookup(asked, wanted, 5.0)
        sends.append(time.perf_counter() - started)
        asked_total += lookup.asked
        answers = lookup.answers()
        while any(a is None for a in answers):
            time.sleep(poll_s)
            answers = lookup.answers()
        latencies.append(time.perf_counter() - started)
        hits = [a for a in answers if a[2] is not None]
        errors = [a[3] for a in answers if a[3] is not None]
        if errors or len(hits) != 1 or hits[0][2][1] != args.blocks:
            raise RuntimeError(f"lookup of conversation {conversation} on {size} D's: {answers}")
        _, owner_id, found, _ = hits[0]
        reader.notify(owner_id, protocol.encode_release(found[0], found[2]))
    return latencies, sends, time.process_time() - cpu_before, asked_total


def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=200, help="lookups per block")
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--turns", type=int, default=32, help="held turns per D")
    parser.add_argument("--blocks", type=int, default=256, help="blocks per turn (16 tokens each: 4k)")
    # Finer than an engine step (which polls once per step), so that the latency measured is
    # the lookup's: at 100 µs the p50 of a ~100 µs lookup jumps between one poll and two.
    parser.add_argument("--poll-us", type=float, default=20.0)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--hinted", action="store_true",
                        help="ask only the D holding the conversation, as P does with a router's "
                        "lookup hint (kvduplex_lookup_hint), among all the D's of each size")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--role", choices=["owner"], help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    fleet = max(args.sizes)
    if args.role == "owner":
        owner(args.index, 16, args.turns, args.blocks)
        return
    if fleet > 16:
        parser.error("at most 16 D's (conversations are spread over 16)")
    import ctypes

    from kvduplex._core import Engine

    started_at = time.monotonic()
    procs = [subprocess.Popen([sys.executable, __file__, "--role", "owner", "--index", str(i),
                               "--turns", str(args.turns), "--blocks", str(args.blocks)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for i in range(fleet)]
    try:
        ds = [json.loads(p.stdout.readline()) for p in procs]
        buffer = ctypes.create_string_buffer(4096 * 4)
        reader = Engine("fleet-p", FINGERPRINT, host=HOST, secret=secret())
        reader.register_region(ctypes.addressof(buffer), len(buffer))
        reader.set_layout([ctypes.addressof(buffer)], 4096, 4096, 4)
        targets = [(HOST, d["port"]) for d in ds]
        for host, port in targets:
            reader.connect(host, port, timeout_s=30)
        # Warm-up: every D answers a few lookups first.
        run_block(reader, targets, fleet, 0, argparse.Namespace(**{**vars(args), "rounds": 2 * fleet}))
        load = os.getloadavg()
        idle_p, idle_d = thread_cpu(), [process_cpu(d["pid"]) for d in ds]
        time.sleep(args.idle_s)
        idle = {"p_cpu_per_s": sum(diff(thread_cpu(), idle_p).values()) / args.idle_s,
                "d_cpu_per_s_each": statistics.fmean(
                    process_cpu(d["pid"]) - b for d, b in zip(ds, idle_d)) / args.idle_s}
        latencies: dict[int, list[float]] = defaultdict(list)
        sends: dict[int, list[float]] = defaultdict(list)
        p_cpu: dict[int, float] = defaultdict(float)
        p_threads: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        d_cpu: dict[int, float] = defaultdict(float)
        asked: dict[int, int] = defaultdict(int)
        round_no = 0
        for cycle in range(args.cycles):
            for size in (args.sizes if cycle % 2 == 0 else args.sizes[::-1]):
                d_before = [process_cpu(d["pid"]) for d in ds[:size]]
                threads_before = thread_cpu()
                got, sent, cpu, asked_here = run_block(reader, targets, size, round_no, args)
                asked[size] += asked_here
                threads_after = thread_cpu()
                d_cpu[size] += sum(process_cpu(d["pid"]) - b for d, b in zip(ds[:size], d_before))
                round_no += args.rounds
                for name, seconds in diff(threads_after, threads_before).items():
                    p_threads[size][name] += seconds
                latencies[size] += got
                sends[size] += sent
                p_cpu[size] += cpu
                print(f"cycle {cycle + 1}, {size} D's: p50 {statistics.median(got) * 1e6:.0f} us, "
                      f"P CPU {cpu / args.rounds * 1e6:.0f} us/lookup", file=sys.stderr, flush=True)
        reader.close()
    finally:
        for p in procs:
            p.stdin.close()
        for p in procs:
            p.wait(timeout=30)
    lookups = args.rounds * args.cycles
    rows = []
    for size in args.sizes:
        rows.append({
            "d_count": size, "lookups": lookups, **percentiles(latencies[size]),
            "start_lookup_p50_us": round(statistics.median(sends[size]) * 1e6, 1),
            "p_cpu_us_per_lookup": round(p_cpu[size] / lookups * 1e6, 1),
            "p_cpu_us_per_lookup_by_thread": {
                k: round(v / lookups * 1e6, 1)
                for k, v in sorted(p_threads[size].items(), key=lambda kv: -kv[1])},
            "asked_d_cpu_us_per_lookup": round(d_cpu[size] / lookups * 1e6, 1),
            "asked_per_lookup": round(asked[size] / lookups, 2),
        })
    base = rows[0]
    for row in rows:
        row["p50_vs_1"] = round(row["p50_us"] / base["p50_us"], 2)
        row["p99_vs_1"] = round(row["p99_us"] / base["p99_us"], 2)
        row["p_cpu_vs_1"] = round(row["p_cpu_us_per_lookup"] / base["p_cpu_us_per_lookup"], 2)
    report = {"authenticated": secret() is not None, "hinted": args.hinted, "blocks": args.blocks,
              "turns_per_d": args.turns, "rounds_per_block": args.rounds,
              "cycles": args.cycles, "poll_us": args.poll_us, "idle": idle,
              "load_average_at_start": load, "load_average_at_end": os.getloadavg(),
              "cpus": os.cpu_count(), "seconds": round(time.monotonic() - started_at),
              "rows": rows}
    print(f"{'Ds':>3}{'asked':>6}{'p50 us':>9}{'p99 us':>9}{'send us':>9}{'P CPU us':>10}{'Ds CPU us':>10}"
          f"{'p50 x':>7}{'p99 x':>7}{'CPU x':>7}  P threads (us/lookup)")
    for row in rows:
        top = ", ".join(f"{k} {v:.0f}" for k, v in list(row["p_cpu_us_per_lookup_by_thread"].items())[:4])
        print(f"{row['d_count']:>3}{row['asked_per_lookup']:>6}{row['p50_us']:>9.0f}{row['p99_us']:>9.0f}"
              f"{row['start_lookup_p50_us']:>9.0f}"
              f"{row['p_cpu_us_per_lookup']:>10.0f}{row['asked_d_cpu_us_per_lookup']:>10.0f}"
              f"{row['p50_vs_1']:>7}{row['p99_vs_1']:>7}{row['p_cpu_vs_1']:>7}  {top}")
    print(f"idle: P {idle['p_cpu_per_s'] * 1e3:.1f} ms CPU/s, each D "
          f"{idle['d_cpu_per_s_each'] * 1e3:.1f} ms CPU/s; load {load[0]:.1f} at start, "
          f"{os.getloadavg()[0]:.1f} at end ({os.cpu_count()} CPUs)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
