"""The engine processes of `benches/fleet.py`: each hosts several transfer-core engines of one
role (P: readers that look up; D: owners that hold finished turns) and answers the
controller's commands, one JSON line each way on stdin/stdout.

    python benches/_fleet_engines.py ROLE FIRST COUNT N TURNS BLOCKS HEARTBEAT_MS

starts engines FIRST..FIRST+COUNT-1 of the role in a fleet of N a side. D engine d holds
TURNS turns of BLOCKS blocks: conversations d, d+N, d+2N, ... (so each conversation has one
holder). Fingerprints are 64-bit hashes, as the connector's are (each 9 bytes in msgpack).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import resource
import select
import sys
import time
from collections import defaultdict

from kvduplex import protocol
from kvduplex._core import Engine

FINGERPRINT = {"model": "fleet"}
HOST = "127.0.0.1"
# Announced turns (the bytes per held turn) are numbered from here, and the turns that grow the
# index (its memory per entry) from twice that: no lookup asks for them.
ANNOUNCED_BASE = 1 << 40


def fingerprints(conversation: int, blocks: int) -> list[str]:
    """A conversation's block fingerprints: 64-bit hashes, distinct between conversations."""
    return [hashlib.blake2b(f"{conversation}/{i}".encode(), digest_size=8).hexdigest()
            for i in range(blocks)]


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


def process_stats() -> dict:
    """This process's resident memory, threads (by name) and open fds now."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    names: dict[str, int] = defaultdict(int)
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names[f.read().strip()] += 1
        except OSError:
            continue
    return {"rss": rss, "threads": sum(names.values()), "thread_names": dict(names),
            "fds": len(os.listdir("/proc/self/fd"))}


def make_engine(name: str, heartbeat_s: float) -> tuple[Engine, ctypes.Array]:
    secret = os.environ.get("KVDUPLEX_SECRET")
    buffer = ctypes.create_string_buffer(4096 * 4)
    engine = Engine(name, FINGERPRINT, host=HOST, secret=secret.encode() if secret else None,
                    heartbeat_s=heartbeat_s)
    engine.register_region(ctypes.addressof(buffer), len(buffer))
    engine.set_layout([ctypes.addressof(buffer)], 4096, 4096, 4)
    return engine, buffer


def lookups(engine: Engine, targets: list[tuple[str, int]], cmd: dict) -> dict:
    """`rounds` lookups asking every target, each for a conversation one of them holds; polls
    every `poll_us` µs until all answered, then hands the hit's claim back."""
    n, turns, blocks = len(targets), cmd["turns"], cmd["blocks"]
    wanted = {c: fingerprints(c, blocks) for c in range(n * turns)}
    poll_s = cmd["poll_us"] / 1e6
    latencies, sends, asked = [], [], 0
    cpu_before = time.process_time()
    for r in range(cmd["rounds"]):
        holder = r % n
        conversation = holder + n * (r // n % turns)
        started = time.perf_counter()
        lookup = engine.start_lookup(targets, wanted[conversation], 5.0)
        sends.append(time.perf_counter() - started)
        asked += lookup.asked
        answers = lookup.answers()
        while any(a is None for a in answers):
            time.sleep(poll_s)
            answers = lookup.answers()
        latencies.append(time.perf_counter() - started)
        hits = [a for a in answers if a[2] is not None]
        errors = [a[3] for a in answers if a[3] is not None]
        if errors or len(hits) != 1 or hits[0][2][1] != blocks:
            raise RuntimeError(f"lookup of conversation {conversation} on {n} D's: {answers}")
        _, owner_id, found, _ = hits[0]
        engine.notify(owner_id, protocol.encode_release(found[0], found[2]))
    return {"latencies": latencies, "sends": sends, "asked": asked,
            "cpu": time.process_time() - cpu_before}


def connect_all(engines: list[Engine], targets: list[tuple[str, int]]) -> float:
    """Connects every engine to every target, then waits until each has every target's
    announcements (its index is synced); returns the seconds it took."""
    started = time.monotonic()
    for engine in engines:
        for host, port in targets:
            engine.connect(host, port, timeout_s=60)
    for engine in engines:
        while not engine.announced_changes(None, targets, 0)[5]:
            time.sleep(0.01)
    return time.monotonic() - started


def index_sizes(engines: list[Engine], targets: list[tuple[str, int]]) -> tuple[list[int], int]:
    """The fingerprints each engine's held index has from the targets (the whole set), once
    synced with every target (at most 60 s: a link lost meanwhile never syncs again), and
    how many engines are not."""
    sizes, unsynced = [], 0
    for engine in engines:
        deadline = time.monotonic() + 60
        while not engine.announced_changes(None, targets, 0)[5] and time.monotonic() < deadline:
            time.sleep(0.05)
        _, whole, too_large, added, _, synced = engine.announced_changes(None, targets, 1 << 22)
        assert whole and not too_large, (whole, too_large)
        sizes.append(len(added))
        unsynced += not synced
    return sizes, unsynced


def serve(role: str, first: int, count: int, n: int, turns: int, blocks: int,
          heartbeat_ms: int) -> None:
    # A P process holds a link per D for each of its engines (a D, one per P): one fd each.
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    base = process_stats()
    engines, buffers = [], []
    for i in range(first, first + count):
        engine, buffer = make_engine(f"fleet-{role.lower()}{i}", heartbeat_ms / 1e3)
        engines.append(engine)
        buffers.append(buffer)
        if role == "D":
            for t in range(turns):
                conversation = i + t * n
                engine.hold(f"turn-{conversation}", 4, time.time() + 1e6,
                            fingerprints=fingerprints(conversation, blocks), turn=True, offer=b"{}")
    reply = {"pid": os.getpid(), "ports": [e.side_channel_port for e in engines],
             "base": base, "engines": process_stats()}
    print(json.dumps(reply), flush=True)
    targets: list[tuple[str, int]] = []
    while True:
        # D: take the readers' releases every 10 ms (an engine step would).
        if role == "D" and not select.select([sys.stdin], [], [], 0.01)[0]:
            for engine in engines:
                for sender, payload in engine.take_notifications():
                    release = protocol.decode_notification(payload)
                    assert isinstance(release, protocol.Release)
                    engine.release_hold(sender, release.owner_request_id, release.claim_id)
            continue
        line = sys.stdin.readline()
        if not line:
            break
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "connect":
            targets = [(HOST, port) for port in cmd["ports"]]
            out = {"seconds": connect_all(engines, targets)}
        elif op == "index":
            sizes, unsynced = index_sizes(engines, targets)
            out = {"sizes": sizes, "unsynced": unsynced}
        elif op == "stats":
            out = {**process_stats(), "cpu": dict(thread_cpu())}
        elif op == "hold":  # announcement turns on this process's first engine, spaced
            for t in range(cmd["turns"]):
                conversation = ANNOUNCED_BASE + t
                engines[0].hold(f"announced-{t}", 4, cmd["until"],
                                fingerprints=fingerprints(conversation, cmd["blocks"]),
                                turn=True, offer=b"{}")
                time.sleep(cmd["spacing_s"])
            out = {}
        elif op == "grow":  # more turns on every engine, spaced, held to the end
            for t in range(cmd["turns"]):
                for i, engine in enumerate(engines, start=first):
                    time.sleep(cmd["spacing_s"])
                    conversation = 2 * ANNOUNCED_BASE + i * cmd["turns"] + t
                    engine.hold(f"grown-{conversation}", 4, time.time() + 1e6,
                                fingerprints=fingerprints(conversation, blocks), turn=True,
                                offer=b"{}")
            out = {}
        elif op == "expire":
            out = {"freed": sum(len(e.expire_holds()) for e in engines)}
        elif op == "lookups":
            out = lookups(engines[cmd["engine"]], targets, cmd)
        else:
            raise ValueError(op)
        print(json.dumps(out), flush=True)
    for engine in engines:
        engine.close()


if __name__ == "__main__":
    role, *numbers = sys.argv[1:]
    serve(role, *map(int, numbers))
