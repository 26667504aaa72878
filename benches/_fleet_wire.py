"""What `benches/fleet.py` reads from outside its engines: each side-channel connection's bytes
on the wire (the kernel's TCP counters, through `ss`), a process's CPU, the size of a `Held`
frame as the transfer core encodes it, and the paper model at 100 × 100."""

from __future__ import annotations

import os
import subprocess

from kvduplex import _core

# rust/src/handshake/wire.rs: MAGIC (4) + protocol version (2) + kind (1) + body length (4).
FRAME_HEADER_LEN = 11
# rust/src/handshake/auth.rs: TAG_LEN, after every frame of an authenticated link.
TAG_LEN = 16
# Caps a P's index of what D's hold meets (rust/src/held_index.rs, and the scheduler's copy:
# python/kvduplex/connector/worker_lookup.py `_MAX_WHOLE`, held_mirror.py).
HELD_INDEX_MAX_ENTRIES = 1 << 20
HELD_INDEX_MAX_PER_OWNER = 1 << 18
HELD_MIRROR_MAX = 1 << 18
# rust/src/side_channel/mod.rs: connections a side-channel server takes, in all and from one IP.
MAX_CONNECTIONS = 1024
MAX_CONNECTIONS_PER_ADDRESS = 256


def tcp_bytes() -> dict[tuple[int, int], tuple[int, int]]:
    """(local port, peer port) -> (bytes sent, bytes received) of every established TCP
    connection on this host (loopback: both ends are listed)."""
    out = subprocess.run(["ss", "-tinH", "state", "established"], capture_output=True,
                         text=True, check=True).stdout
    sockets: dict[tuple[int, int], tuple[int, int]] = {}
    key = None
    for line in out.splitlines():
        if not line.startswith(("\t", " ")):
            fields = line.split()
            key = (int(fields[2].rsplit(":", 1)[1]), int(fields[3].rsplit(":", 1)[1]))
            continue
        if key is None:
            continue
        counters = dict(f.split(":", 1) for f in line.split() if f.startswith("bytes_"))
        sockets[key] = (int(counters.get("bytes_sent", 0)), int(counters.get("bytes_received", 0)))
        key = None
    return sockets


def links(sockets: dict, d_ports: set[int]) -> dict[int, list[tuple[int, int]]]:
    """Per D side-channel port, the (local, peer) keys of its links' ends on the P side (the
    peer is D's port; D's end is the same pair swapped)."""
    out: dict[int, list[tuple[int, int]]] = {p: [] for p in d_ports}
    for local, peer in sockets:
        if peer in d_ports and local not in d_ports:
            out[peer].append((local, peer))
    return out


def link_bytes(before: dict, after: dict, ends: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Per link (key on P's side): bytes D sent on it (counted at D's end) and bytes P received
    (at P's end) between two snapshots."""
    sent, received = [], []
    for local, peer in ends:
        d_end = (peer, local)
        sent.append(after.get(d_end, (0, 0))[0] - before.get(d_end, (0, 0))[0])
        received.append(after.get((local, peer), (0, 0))[1] - before.get((local, peer), (0, 0))[1])
    return sent, received


def process_cpu(pid: int) -> tuple[float, float]:
    """(main thread, every other thread) CPU seconds of a process (schedstat's run time)."""
    main = rest = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                seconds = int(f.read().split()[0]) / 1e9
        except OSError:
            continue  # the thread ended
        if int(tid) == pid:
            main += seconds
        else:
            rest += seconds
    return main, rest


def _msgpack_array_header(n: int) -> int:
    return 1 if n < 16 else 3 if n < 1 << 16 else 5


# Of a held turn, D announces block 0, every `ANNOUNCE_STRIDE`-th, its prompt's last full block
# and its last two (`rust/src/holds/feed.rs`, `announced`).
ANNOUNCE_STRIDE = _core.ANNOUNCE_STRIDE


def announced_per_turn(blocks: int, prompt_blocks: int = 0) -> int:
    """How many of a held turn's `blocks` fingerprints D announces (the same rule)."""
    return sum(
        1 for i in range(blocks)
        if i == 0 or (i + 1) % ANNOUNCE_STRIDE == 0 or i + 1 == prompt_blocks or i + 2 >= blocks
    )


def held_frame_bytes(fingerprints: int, authenticated: bool) -> int:
    """One `Held` frame of `fingerprints` 64-bit fingerprints, held or freed, on the wire:
    the header, the msgpack body rmp_serde's `to_vec_named` writes for `HeldUpdate` (a map of
    `reset`, `held`, `freed`, `synced`; a u64 of 2^32 or more is 9 bytes), and the tag."""
    keys = sum(1 + len(k) for k in ("reset", "held", "freed", "synced"))
    body = 1 + keys + 2 + _msgpack_array_header(fingerprints) + _msgpack_array_header(0) \
        + 9 * fingerprints
    return FRAME_HEADER_LEN + body + (TAG_LEN if authenticated else 0)


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return my - b * mx, b


def paper(rows: list[dict], n: int, held_blocks_per_d: int, turn_blocks: int,
          authenticated: bool) -> dict:
    """Per-engine costs at `n` a side, and the counts that follow from the frame format and
    the caps. Every P has a link to every D, so each cost is one part per engine and one per
    link: threads, fds and memory per engine alone as measured at the largest size (the
    processes then full, so what a process loads once is shared as in the measurement), per
    link as the least-squares slope, through 0, of (connected - alone) against links over the
    sizes measured; idle CPU as a straight line through every size."""
    big = max(rows, key=lambda r: r["n"])
    grown = [r for r in rows if r["index"]["p_rss_bytes_per_entry"]]
    grown_big = max(grown, key=lambda r: r["n"])["index"] if grown else {}
    entry = grown_big.get("p_rss_bytes_per_entry", 0.0)
    block = grown_big.get("d_rss_bytes_per_held_block", 0.0)
    # What the index (P) and the held turns (D) took at connection time, not the links.
    held = {"p": lambda r: r["index"]["before_growth"] * entry / 1024,
            "d": lambda r: r["index"]["before_growth"] / r["n"] * block / 1024}
    line = {}
    for side in ("p", "d"):
        for what in ("threads", "fds", "rss_kib"):
            alone = big[side][f"{what}_alone"]
            less = held[side] if what == "rss_kib" else lambda r: 0.0
            pairs = [(r[side]["links"], r[side][what] - r[side][f"{what}_alone"] - less(r))
                     for r in rows]
            b = sum(x * y for x, y in pairs) / sum(x * x for x, _ in pairs)
            line[f"{side}_{what}"] = {"per_engine": round(alone, 2), "per_link": round(b, 3),
                                      f"at_{n}": round(alone + b * n, 1)}
        a, b = fit([r["n"] for r in rows], [r[side]["idle_core_cpu_ms_per_s"] for r in rows])
        line[f"{side}_idle_core_cpu_ms_per_s"] = {"per_engine": round(a, 3), "per_link": round(b, 4),
                                                  f"at_{n}": round(a + b * n, 2)}
    # A vLLM engine's turns also announce their prompt's end (about the middle of the turn).
    per_turn = announced_per_turn(turn_blocks, turn_blocks // 2)
    frame = held_frame_bytes(per_turn, authenticated)
    per_d = held_blocks_per_d // turn_blocks * per_turn
    index = n * per_d
    return {
        "n": n, "links_per_p": n, "links_per_d": n, "lines": line,
        "p_rss_bytes_per_index_entry": entry, "d_rss_bytes_per_held_block": block,
        "p_index_mib": round(min(index, HELD_INDEX_MAX_ENTRIES) * entry / 2**20, 1),
        "d_held_mib": round(held_blocks_per_d * block / 2**20, 1),
        "held_frame_bytes": frame,
        "held_bytes_per_turn_out_of_each_d": n * frame,
        "held_bytes_per_turn_into_each_p_per_d_turn": frame,
        "held_index_fingerprints_per_p": index,
        "held_index_cap": HELD_INDEX_MAX_ENTRIES,
        "held_index_over_cap": index > HELD_INDEX_MAX_ENTRIES,
        "announced_per_turn": per_turn,
        "held_index_cap_hit_at_n": HELD_INDEX_MAX_ENTRIES // per_d + 1,
        "held_mirror_cap": HELD_MIRROR_MAX,
        "held_mirror_untrusted": index > HELD_MIRROR_MAX,
        "held_mirror_cap_hit_at_n": HELD_MIRROR_MAX // per_d + 1,
        "per_owner_cap_hit": held_blocks_per_d > HELD_INDEX_MAX_PER_OWNER,
        "d_connections_vs_cap": [n, MAX_CONNECTIONS],
        "same_host_connections_per_address_cap": MAX_CONNECTIONS_PER_ADDRESS,
    }
