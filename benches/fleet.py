"""A fleet of n P's and n D's where every P is connected to every D (what discovery leads to):
what each engine pays in links, threads, fds, memory and idle CPU, what a D's announcements of
its held turns cost on the wire, how big each P's index of them grows, and what a lookup
costs; then the same at 100 × 100 on paper.

For each n in `--sizes` a fresh fleet: n D and n P transfer-core engines
(`python/kvduplex/_core`), `--engines-per-process` of one role to a process
(`benches/_fleet_engines.py`). Each D holds `--turns` finished turns of `--blocks` blocks
(conversation c is held by D c mod n alone). Every P connects to every D and waits until its
index of what they hold is synced. Then, per n:

- links: the established side-channel connections (counted with `ss`), per P and per D;
  threads, fds and resident memory per engine (each process's, less what it had before its
  engines, over its engines; alone: before connecting);
- idle: over `--idle-s`, the CPU per engine of the transfer core's threads (heartbeats; the
  process's main thread, which only polls D's notifications every 10 ms as a step would, is
  reported apart), and the heartbeat bytes per link per second each way;
- announcements: D0 holds `--announce-turns` more turns of `--blocks` blocks, one every 50 ms,
  then frees them (their leases end): the bytes on the wire out of D0 and into each P, from the
  kernel's TCP counters of those links (`ss`: bytes_sent at D's end, bytes_received at P's,
  less the links' idle heartbeat bytes over the same time), per held turn; beside it the bytes
  one `Held` frame of that many fingerprints takes by the wire format (`_fleet_wire.py`), and
  the CPU beyond idle of D0's process and of the P processes per frame (a turn to one P);
- index: up to `--grow-max-n`, every D holds `--grow-turns` more turns (`--grow-rate` a second
  over the fleet); the resident memory this adds to each P (per fingerprint its index gains)
  and to each D (per block held); then the fingerprints each P's held index has (n × (turns +
  grow turns) × blocks when all arrived);
- lookups: `--rounds` lookups by one P, each asking all n D's for a conversation one of them
  holds, polled every `--poll-us` µs until all answered; p50/p99, start_lookup's own time,
  `asked` per lookup (the D's not ruled out by their announcements), and the P process's CPU
  per lookup less its idle CPU over the same time.

Last, the paper model at `--paper-n` (100) a side (`_fleet_wire.paper`): each cost is one part
per engine and one per link (threads, fds, memory: the engine alone at the largest size, and
the slope per link over the sizes; idle CPU: a straight line through the sizes), the `Held`
bytes by the frame format, and each P's index at `--paper-held-blocks` held blocks per D
(14.4k: an 80 GB D serving an 8B model at decode_kv_hold_max_fraction 0.5) against the caps.

    UCX_NET_DEVICES=lo PYTHONPATH=python .venv/bin/python benches/fleet.py --json OUT

With $KVDUPLEX_SECRET set every engine authenticates its peers and tags every side-channel
frame (as between hosts, where the secret is required; 16 bytes a frame).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import _fleet_wire as wire

ENGINES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fleet_engines.py")


class Proc:
    """One engine process and its JSON-line conversation."""

    def __init__(self, role: str, first: int, count: int, n: int, args) -> None:
        self.role, self.count = role, count
        self.popen = subprocess.Popen(
            [sys.executable, ENGINES, role, str(first), str(count), str(n), str(args.turns),
             str(args.blocks), str(round(args.heartbeat_s * 1e3))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self.reply()
        self.pid, self.ports = self.hello["pid"], self.hello["ports"]

    def send(self, **cmd) -> None:
        self.popen.stdin.write(json.dumps(cmd) + "\n")
        self.popen.stdin.flush()

    def reply(self) -> dict:
        line = self.popen.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.role} process exited ({self.popen.wait()})")
        return json.loads(line)

    def ask(self, **cmd) -> dict:
        self.send(**cmd)
        return self.reply()

    def stop(self) -> None:
        if self.popen.stdin and not self.popen.stdin.closed:
            self.popen.stdin.close()
        try:
            self.popen.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.popen.kill()


def spawn(role: str, n: int, args) -> list[Proc]:
    per = args.engines_per_process
    return [Proc(role, first, min(per, n - first), n, args) for first in range(0, n, per)]


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50_us": round(pick(0.5) * 1e6, 1), "p99_us": round(pick(0.99) * 1e6, 1),
            "mean_us": round(statistics.fmean(ordered) * 1e6, 1)}


def per_engine(procs: list[Proc], stats: list[dict], idle: list[tuple[float, float]],
               idle_s: float, links: int) -> dict:
    """One role's costs per engine: this role's processes, less what each had before its
    engines, over all their engines."""
    engines = sum(p.count for p in procs)
    total = lambda f: sum(f(p, s) for p, s in zip(procs, stats)) / engines  # noqa: E731
    names: dict[str, float] = defaultdict(float)
    for p, s in zip(procs, stats):
        for name, count in s["thread_names"].items():
            names[name] += (count - p.hello["base"]["thread_names"].get(name, 0)) / engines
    return {
        "links": links,
        "threads": round(total(lambda p, s: s["threads"] - p.hello["base"]["threads"]), 2),
        "threads_alone": round(total(lambda p, s: p.hello["engines"]["threads"]
                                     - p.hello["base"]["threads"]), 2),
        "thread_names": {k: round(v, 2) for k, v in sorted(names.items()) if v},
        "fds": round(total(lambda p, s: s["fds"] - p.hello["base"]["fds"]), 2),
        "fds_alone": round(total(lambda p, s: p.hello["engines"]["fds"]
                                 - p.hello["base"]["fds"]), 2),
        "rss_kib": round(total(lambda p, s: s["rss"] - p.hello["base"]["rss"]) / 1024, 1),
        "rss_kib_alone": round(total(lambda p, s: p.hello["engines"]["rss"]
                                     - p.hello["base"]["rss"]) / 1024, 1),
        "idle_core_cpu_ms_per_s": round(sum(c[1] for c in idle) / engines / idle_s * 1e3, 3),
        "idle_main_thread_cpu_ms_per_s": round(sum(c[0] for c in idle) / engines / idle_s * 1e3, 3),
    }


def measure(n: int, args) -> dict:
    started = time.monotonic()

    def phase(name: str) -> None:
        print(f"n={n}: {name} at {time.monotonic() - started:.1f} s, load "
              f"{os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)

    authenticated = bool(os.environ.get("KVDUPLEX_SECRET"))
    ds = spawn("D", n, args)
    ps: list[Proc] = []
    try:
        ps = spawn("P", n, args)
        d_ports = [port for d in ds for port in d.ports]
        for p in ps:
            p.send(op="connect", ports=d_ports)
        connect_s = max(p.reply()["seconds"] for p in ps)
        phase("connected")
        time.sleep(1.0)  # the last announcements and handshakes settle
        sockets = wire.tcp_bytes()
        ends = wire.links(sockets, set(d_ports))
        d_links = [len(ends[port]) for port in d_ports]
        p_ports = {port for p in ps for port in p.ports}
        served_by_p = sum(1 for local, _ in sockets if local in p_ports)
        # Idle: every process's CPU, and every link's bytes.
        procs = ds + ps
        cpu0 = [wire.process_cpu(x.pid) for x in procs]
        t0 = time.monotonic()
        time.sleep(args.idle_s)
        cpu1 = [wire.process_cpu(x.pid) for x in procs]
        idle_s = time.monotonic() - t0
        sockets_idle = wire.tcp_bytes()
        phase("idle measured")
        idle = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(cpu0, cpu1)]
        all_ends = [e for port in d_ports for e in ends[port]]
        sent, received = wire.link_bytes(sockets, sockets_idle, all_ends)
        # P → D (pings only): at P's end sent.
        p_sent = [sockets_idle.get(e, (0, 0))[0] - sockets.get(e, (0, 0))[0] for e in all_ends]
        heartbeat = {"d_to_p_bytes_per_link_s": round(statistics.fmean(sent) / idle_s, 1),
                     "p_to_d_bytes_per_link_s": round(statistics.fmean(p_sent) / idle_s, 1)}
        stats = [x.ask(op="stats") for x in procs]
        p_row = per_engine(ps, stats[len(ds):], idle[len(ds):], idle_s,
                           round(len(all_ends) / n, 2))
        d_row = per_engine(ds, stats[:len(ds)], idle[:len(ds)], idle_s,
                           round(statistics.fmean(d_links), 2))
        # Each P's index grows by `--grow-turns` turns of every D: its memory per entry.
        grow_turns = args.grow_turns if n <= args.grow_max_n else 0
        for d in ds:  # at most --grow-rate holds a second over the fleet
            d.send(op="grow", turns=grow_turns, spacing_s=len(ds) / args.grow_rate)
        for d in ds:
            d.reply()
        if grow_turns:
            time.sleep(2.0)  # the announcements arrive (the index count below checks them)
        grown = [x.ask(op="stats")["rss"] - s["rss"] for x, s in zip(procs, stats)]
        entries = n * grow_turns * args.blocks
        phase("grown")
        sizes, unsynced = [], 0
        for p in ps:
            got = p.ask(op="index")
            sizes += got["sizes"]
            unsynced += got["unsynced"]
        phase("indexes counted")
        # D0 announces turns one at a time, then frees them.
        d0, d0_ends = ds[0], ends[d_ports[0]]
        until = time.time() + args.announce_turns * 0.05 + 1.0  # every lease ends then
        c0 = [wire.process_cpu(x.pid) for x in procs]
        s0, t0 = wire.tcp_bytes(), time.monotonic()
        d0.ask(op="hold", turns=args.announce_turns, blocks=args.blocks, until=until,
               spacing_s=0.05)
        time.sleep(0.5)
        s1, t1 = wire.tcp_bytes(), time.monotonic()
        c1 = [wire.process_cpu(x.pid) for x in procs]
        # CPU beyond idle over the announcements: D0's process (its holds and its announcers)
        # and every P process (taking them into the index), per frame (a held turn to one P).
        busy = [sum(b) - sum(a) - sum(i) / idle_s * (t1 - t0) for a, b, i in zip(c0, c1, idle)]
        frames = args.announce_turns * n
        time.sleep(max(0.0, until + 0.1 - time.time()))
        freed = d0.ask(op="expire")["freed"]
        time.sleep(0.5)
        s2, t3 = wire.tcp_bytes(), time.monotonic()
        ping = heartbeat["d_to_p_bytes_per_link_s"]  # D to P, subtracted
        held_out, held_in = wire.link_bytes(s0, s1, d0_ends)
        freed_out, freed_in = wire.link_bytes(s1, s2, d0_ends)
        turns = args.announce_turns
        announce = {
            "turns": turns, "freed": freed, "blocks": args.blocks,
            "held_out_of_d_per_turn": round((sum(held_out) - ping * (t1 - t0) * n) / turns),
            "held_into_each_p_per_turn": round(
                (statistics.fmean(held_in) - ping * (t1 - t0)) / turns),
            "freed_out_of_d_per_turn": round((sum(freed_out) - ping * (t3 - t1) * n) / turns),
            "freed_into_each_p_per_turn": round(
                (statistics.fmean(freed_in) - ping * (t3 - t1)) / turns),
            "frame_bytes_by_format": wire.held_frame_bytes(args.blocks, authenticated),
            # The leases end together: one frame frees them all.
            "freed_frame_bytes_by_format_per_turn": round(
                wire.held_frame_bytes(turns * args.blocks, authenticated) / turns),
            "heartbeat_bytes_subtracted_per_link": round(ping * (t1 - t0 + t3 - t1), 1),
            "d_cpu_us_per_frame_sent": round(busy[0] / frames * 1e6, 1),
            "p_cpu_us_per_frame_taken": round(sum(busy[len(ds):]) / frames * 1e6, 1),
        }
        phase("announced")
        # Lookups by P0, asking all n D's.
        p0 = ps[0]
        main0, rest0 = wire.process_cpu(p0.pid)
        t0 = time.monotonic()
        got = p0.ask(op="lookups", engine=0, rounds=args.rounds, poll_us=args.poll_us,
                     turns=args.turns, blocks=args.blocks)
        elapsed = time.monotonic() - t0
        main1, rest1 = wire.process_cpu(p0.pid)
        alive = sum(len(e) for e in wire.links(wire.tcp_bytes(), set(d_ports)).values())
        idle_rate = sum(idle[len(ds)]) / idle_s
        lookup = {**percentiles(got["latencies"]),
                  "start_lookup_p50_us": round(statistics.median(got["sends"]) * 1e6, 1),
                  "asked_per_lookup": round(got["asked"] / args.rounds, 2),
                  "p_cpu_us_per_lookup": round(
                      (main1 + rest1 - main0 - rest0 - idle_rate * elapsed) / args.rounds * 1e6, 1)}
    finally:
        for x in ps + ds:  # readers first: an owner that leaves first is logged as gone
            x.stop()
    return {"n": n, "processes": len(ds) + len(ps), "connect_s": round(connect_s, 2),
            "links_total": len(all_ends), "links_at_end": alive,
            "links_served_by_p": served_by_p,
            "p": p_row, "d": d_row, "heartbeat": heartbeat, "announce": announce,
            "index": {"min": min(sizes), "max": max(sizes), "p_unsynced": unsynced,
                      "expected": n * (args.turns + grow_turns) * args.blocks,
                      "before_growth": n * args.turns * args.blocks,
                      "p_rss_bytes_per_entry": round(sum(grown[len(ds):]) / n / entries, 1)
                      if entries else None,
                      "d_rss_bytes_per_held_block": round(
                          sum(grown[:len(ds)]) / n / (grow_turns * args.blocks), 1)
                      if entries else None},
            "lookup": lookup, "load_average": os.getloadavg()[0],
            "seconds": round(time.monotonic() - started)}


def print_rows(rows: list[dict]) -> None:
    print(f"{'n':>3}{'P links':>8}{'D links':>8}{'P thr':>7}{'D thr':>7}{'P fds':>7}{'D fds':>7}"
          f"{'P MiB':>7}{'D MiB':>7}{'P idle':>8}{'D idle':>8}{'out/turn':>9}{'in/turn':>8}"
          f"{'index':>8}{'asked':>6}{'p50 us':>8}{'p99 us':>8}")
    for r in rows:
        p, d, a = r["p"], r["d"], r["announce"]
        print(f"{r['n']:>3}{p['links']:>8}{d['links']:>8}{p['threads']:>7.1f}{d['threads']:>7.1f}"
              f"{p['fds']:>7.1f}{d['fds']:>7.1f}{p['rss_kib'] / 1024:>7.1f}{d['rss_kib'] / 1024:>7.1f}"
              f"{p['idle_core_cpu_ms_per_s']:>8.2f}{d['idle_core_cpu_ms_per_s']:>8.2f}"
              f"{a['held_out_of_d_per_turn']:>9}{a['held_into_each_p_per_turn']:>8}"
              f"{r['index']['max']:>8}{r['lookup']['asked_per_lookup']:>6}"
              f"{r['lookup']['p50_us']:>8.0f}{r['lookup']['p99_us']:>8.0f}")
    print("(threads, fds, MiB, idle CPU ms/s of the core's threads: per engine; out/turn: Held "
          "bytes out of D0 per held turn, in/turn: into each P)")


def print_paper(model: dict) -> None:
    n = model["n"]
    print(f"paper, {n} × {n} (per engine + per link × n, every P linked to every D):")
    for key, line in model["lines"].items():
        print(f"  {key}: {line['per_engine']} + {line['per_link']} × n = {line[f'at_{n}']}")
    print(f"  Held bytes per held turn: out of each D {n} × {model['held_frame_bytes']} = "
          f"{model['held_bytes_per_turn_out_of_each_d']}, into each P "
          f"{model['held_bytes_per_turn_into_each_p_per_d_turn']} per D's turn")
    print(f"  each P's index: {n} D's × held blocks = {model['held_index_fingerprints_per_p']} "
          f"(cap {model['held_index_cap']}: over from n = {model['held_index_cap_hit_at_n']}; "
          f"scheduler's mirror cap {model['held_mirror_cap']}: untrusted from n = "
          f"{model['held_mirror_cap_hit_at_n']}); at {model['p_rss_bytes_per_index_entry']} B "
          f"an entry {model['p_index_mib']} MiB per P (kept to the cap); D's held blocks "
          f"{model['d_held_mib']} MiB at {model['d_rss_bytes_per_held_block']} B a block")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64],
                        help="engines a side")
    parser.add_argument("--engines-per-process", type=int, default=8)
    parser.add_argument("--turns", type=int, default=16, help="held turns per D")
    parser.add_argument("--blocks", type=int, default=128,
                        help="blocks per turn (16 tokens each: 2,048 tokens)")
    parser.add_argument("--announce-turns", type=int, default=8)
    parser.add_argument("--grow-turns", type=int, default=16,
                        help="turns every D holds more, to measure a P's memory per index entry")
    parser.add_argument("--rounds", type=int, default=300, help="lookups per size")
    # Finer than an engine step (which polls once per step), so that the latency measured is
    # the lookup's.
    parser.add_argument("--poll-us", type=float, default=20.0)
    parser.add_argument("--idle-s", type=float, default=5.0)
    # At 64 × 64 on the 2-core VM (128 engines, 16k threads, beside other work) a fleet-wide
    # burst of held turns (100 a second, 6,400 Held frames a second) starved the heartbeats
    # and every link died: growth is measured on the smaller fleets only.
    parser.add_argument("--grow-max-n", type=int, default=16,
                        help="grow the index only up to this many engines a side")
    parser.add_argument("--grow-rate", type=float, default=100.0,
                        help="held turns a second over the fleet while growing the index")
    parser.add_argument("--heartbeat-s", type=float, default=1.0,
                        help="every engine's heartbeat (the connector's peer_heartbeat_s)")
    parser.add_argument("--paper-n", type=int, default=100)
    parser.add_argument("--paper-held-blocks", type=int, default=14_400,
                        help="held blocks per D for the paper model")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    started = time.monotonic()
    rows = []
    for n in args.sizes:
        rows.append(measure(n, args))
        r = rows[-1]
        print(f"n={n}: {r['links_total']} links, {r['seconds']} s, load {r['load_average']:.1f}",
              file=sys.stderr, flush=True)
    authenticated = bool(os.environ.get("KVDUPLEX_SECRET"))
    model = wire.paper(rows, args.paper_n, args.paper_held_blocks, args.blocks, authenticated)
    print_rows(rows)
    print_paper(model)
    if args.json:
        report = {"authenticated": authenticated, "args": vars(args), "cpus": os.cpu_count(),
                  "seconds": round(time.monotonic() - started), "rows": rows, "paper": model}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
