"""Pieces the benches share: the text tables of their reports (`format_table`), and what
compare_transfer.py and its per-system owner/reader processes share.

Every system reads the same patterns between the same kind of memory: an anonymous mapping,
2 MiB aligned and advised with MADV_HUGEPAGE (transparent huge pages) unless told otherwise.
The owner fills its region with 64-bit words w[i] = i, so every block's expected content
follows from its block id alone. The reader checks batches in two ways (see timed_batches):
every byte of the untimed warm-up and closing batches, and a sentinel word at each end of
every block of the timed ones (the raw-UCX reference checks its timed batches by a sentinel
too, in each block's first word).
"""

import json
import mmap
import os
import select
import sys
import time
import traceback
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NoReturn

import numpy as np

KiB = 1024
MiB = 1024 * KiB
HUGE_PAGE = 2 * MiB
WORD = 8
# Never equal to a filled word (w[i] = i < region words), so a block that was not written fails.
POISON = np.uint64(0xDEADBEEFDEADBEEF)
# Batches smaller than this get more repetitions (the raw-UCX reference tool uses the same rule).
SMALL_BATCH_BYTES = 16 * MiB
# Untimed batches after the timed ones whose every byte is checked (see timed_batches).
CLOSING_BATCHES = 2


@dataclass(frozen=True)
class Pattern:
    name: str
    count: int
    block_bytes: int
    # 1: scattered ids, no two adjacent; >1: ids come in runs of this many consecutive blocks.
    run_length: int = 1

    @property
    def batch_bytes(self) -> int:
        return self.count * self.block_bytes


PATTERNS = (
    Pattern("16x4K", 16, 4 * KiB),
    Pattern("1000x16K", 1000, 16 * KiB),
    Pattern("1000x32K", 1000, 32 * KiB),
    Pattern("100x1M", 100, 1 * MiB),
    Pattern("1000x32K-runs50", 1000, 32 * KiB, run_length=50),
)
PATTERNS_BY_NAME = {p.name: p for p in PATTERNS}


def pattern_from_dict(d: dict) -> Pattern:
    return Pattern(**d)


def pattern_to_dict(p: Pattern) -> dict:
    return asdict(p)


def block_ids(pattern: Pattern, num_slots: int, side: str) -> np.ndarray:
    """Deterministic block ids for one side ('local' or 'remote') of a pattern.

    Scattered: `count` distinct ids in random order, no two adjacent, so no two blocks can be
    merged into one read. Runs: count/run_length runs of consecutive ids, runs in random order
    and separated by at least one unused block.
    """
    rng = np.random.default_rng(zlib.crc32(f"{pattern.name}/{side}".encode()))
    if pattern.run_length == 1:
        # Sorted distinct picks s_i from [0, num_slots - count + 1); t_i = s_i + i keeps gaps >= 2.
        span = num_slots - pattern.count + 1
        if span < pattern.count:
            raise ValueError(
                f"pattern {pattern.name} needs {2 * pattern.count - 1} blocks of "
                f"{pattern.block_bytes} bytes; the region holds {num_slots}"
            )
        picks = np.sort(rng.choice(span, size=pattern.count, replace=False))
        ids = picks + np.arange(pattern.count)
        rng.shuffle(ids)
        return ids.astype(np.int64)
    if pattern.count % pattern.run_length:
        raise ValueError(f"pattern {pattern.name}: count is not a multiple of the run length")
    num_runs = pattern.count // pattern.run_length
    unit = pattern.run_length + 1  # a run and the gap after it
    num_units = num_slots // unit
    if num_units < num_runs:
        raise ValueError(
            f"pattern {pattern.name} needs {num_runs * unit} blocks of {pattern.block_bytes} "
            f"bytes; the region holds {num_slots}"
        )
    starts = rng.choice(num_units, size=num_runs, replace=False) * unit
    return (starts[:, None] + np.arange(pattern.run_length)).reshape(-1).astype(np.int64)


def repetitions(pattern: Pattern, reps: int, small_reps: int) -> int:
    return reps if pattern.batch_bytes >= SMALL_BATCH_BYTES else max(reps, small_reps)


class Region:
    """An anonymous private mapping of `nbytes`, 2 MiB aligned, optionally advised to use THP."""

    def __init__(self, nbytes: int, hugepages: bool):
        if nbytes <= 0 or nbytes % HUGE_PAGE:
            raise ValueError(f"region size must be a positive multiple of 2 MiB, got {nbytes}")
        self.nbytes = nbytes
        self.hugepages = hugepages
        self._map = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = np.frombuffer(self._map, dtype=np.uint8)
        skip = (-whole.ctypes.data) % HUGE_PAGE
        self.bytes = whole[skip : skip + nbytes]
        self.addr = self.bytes.ctypes.data
        if hugepages:
            # madvise needs a page-aligned start; the aligned window is what we use.
            self._map.madvise(mmap.MADV_HUGEPAGE, skip, nbytes)
        self.words = self.bytes.view(np.uint64)

    def fill_pattern(self) -> None:
        chunk = 16 * MiB // WORD
        for start in range(0, self.words.size, chunk):
            stop = min(start + chunk, self.words.size)
            self.words[start:stop] = np.arange(start, stop, dtype=np.uint64)

    def touch(self) -> None:
        """Fault every page in, so no system pays first-touch costs inside its timings."""
        self.bytes[::4096] = 0

    def blocks(self, block_bytes: int) -> np.ndarray:
        """The region as a [num_blocks, words_per_block] array of 64-bit words."""
        return self.words[: self.nbytes // block_bytes * block_bytes // WORD].reshape(
            -1, block_bytes // WORD
        )

    def hugepage_fraction(self) -> float:
        """Share of the region backed by transparent huge pages right now (from /proc/self/smaps)."""
        lo, hi = self.addr, self.addr + self.nbytes
        huge_kib = 0
        inside = False
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    start, end = (int(x, 16) for x in head.split("-"))
                    inside = start < hi and end > lo
                elif inside and head == "AnonHugePages:":
                    huge_kib += int(line.split()[1])
        return min(1.0, huge_kib * KiB / self.nbytes)

    def describe(self) -> dict:
        return {
            "memory": "mmap+MADV_HUGEPAGE" if self.hugepages else "mmap (4 KiB pages)",
            "hugepage_fraction": round(self.hugepage_fraction(), 3),
        }


def poison(dest: np.ndarray, local_ids: np.ndarray) -> None:
    dest[local_ids] = POISON


def set_sentinels(dest: np.ndarray, local_ids: np.ndarray) -> None:
    """POISON in the first and the last word of every destination block."""
    dest[local_ids, 0] = POISON
    dest[local_ids, -1] = POISON


def sentinels_overwritten(dest: np.ndarray, local_ids: np.ndarray, remote_ids: np.ndarray) -> int:
    """The number of blocks whose first or last word is not what the owner wrote there."""
    words_per_block = np.uint64(dest.shape[1])
    first = remote_ids.astype(np.uint64) * words_per_block
    last = first + words_per_block - np.uint64(1)
    return int(np.count_nonzero((dest[local_ids, 0] != first) | (dest[local_ids, -1] != last)))


def verify(dest: np.ndarray, local_ids: np.ndarray, remote_ids: np.ndarray) -> int:
    """Compare every word of every destination block with what the owner wrote; returns the
    number of blocks that differ."""
    words_per_block = dest.shape[1]
    offsets = np.arange(words_per_block, dtype=np.uint64)
    rows_per_chunk = max(1, 4 * MiB // (words_per_block * WORD))
    bad = 0
    for i in range(0, local_ids.size, rows_per_chunk):
        got = dest[local_ids[i : i + rows_per_chunk]]
        want = remote_ids[i : i + rows_per_chunk, None].astype(np.uint64) * np.uint64(
            words_per_block
        ) + offsets
        bad += int(np.count_nonzero((got != want).any(axis=1)))
    return bad


def summarize(pattern: Pattern, seconds: list[float]) -> dict:
    """p50 and p99 per batch and GB/s from the median (same estimators as ucp_rma_bench)."""
    ts = sorted(seconds)
    p50 = ts[len(ts) // 2]
    p99 = ts[int(0.99 * (len(ts) - 1))]
    return {
        "gbps": round(pattern.batch_bytes / p50 / 1e9, 3),
        "p50_us": round(p50 * 1e6, 2),
        "p99_us": round(p99 * 1e6, 2),
        "reps": len(ts),
    }


def timed_batches(pattern, dest, local_ids, remote_ids, run_batch, warmup, reps,
                  closing=CLOSING_BATCHES) -> dict:
    """Run `warmup` batches, `reps` timed ones and `closing` more; returns the timed batches'
    summary. `run_batch()` posts the batch and returns once it completed (it raises on failure).

    Every byte of the warm-up and closing batches is checked: the destination blocks are
    poisoned whole before, and compared whole after. A timed batch is checked by sentinels, as
    the raw-UCX reference (ucp_rma_bench) checks its own (it uses each block's first word): a
    sentinel at both ends of every block before, compared after. Poisoning and comparing 16 MiB
    between timed batches would evict the pattern's blocks from the cache and slow the next
    batch by about 20% (measured), so the timed batches of every system would be measured
    under other conditions than raw UCX's.
    """
    seconds = []
    bad = {"every byte": 0, "sentinels": 0}
    for rep in range(-warmup, reps + closing):
        timed = 0 <= rep < reps
        if timed:
            set_sentinels(dest, local_ids)
        else:
            poison(dest, local_ids)
        start = time.perf_counter()
        run_batch()
        elapsed = time.perf_counter() - start
        if timed:
            seconds.append(elapsed)
            bad["sentinels"] += bool(sentinels_overwritten(dest, local_ids, remote_ids))
        else:
            bad["every byte"] += bool(verify(dest, local_ids, remote_ids))
    result = summarize(pattern, seconds)
    result["verified"] = not any(bad.values())
    if not result["verified"]:
        result["error"] = "; ".join(
            f"{n} of {total} batches had wrong bytes ({how} checked)"
            for (how, n), total in zip(bad.items(), (warmup + closing, reps)) if n
        )
    return result


class Channel:
    """JSON-lines control channel of a side process: commands on stdin, replies on a private
    duplicate of stdout. fd 1 is pointed at stderr so that library chatter cannot corrupt it."""

    def __init__(self):
        self._out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        self._buf = b""

    def send(self, **msg) -> None:
        self._out.write(json.dumps(msg) + "\n")
        self._out.flush()

    def send_error(self, exc: Exception) -> None:
        self.send(event="error", error=f"{type(exc).__name__}: {exc}")

    def poll(self, timeout_s: float = 0.0) -> dict | None:
        """Return the next command if one arrives within `timeout_s`, else None."""
        return self._next(timeout=timeout_s)

    def recv(self) -> dict:
        return self._next(timeout=None)

    def _next(self, timeout):
        while b"\n" not in self._buf:
            ready, _, _ = select.select([0], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(0, 65536)
            if not chunk:
                raise EOFError("control channel closed")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)


def side_log(role: str, msg: str) -> None:
    print(f"[{role} {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def serve_commands(chan: Channel, role: str, handlers: dict[str, Callable[[dict], None]]) -> None:
    """Answer the driver's commands with `handlers[cmd]` until "quit". A failing command is
    logged and answered with an error event; the process stays usable for the next one."""
    while True:
        cmd = chan.recv()
        if cmd["cmd"] == "quit":
            return
        try:
            handler = handlers.get(cmd["cmd"])
            if handler is None:
                raise ValueError(f"unknown command {cmd['cmd']!r}")
            handler(cmd)
        except Exception as exc:
            side_log(role, traceback.format_exc())
            chan.send_error(exc)


def run_side(
    system: str,
    roles: dict[str, Callable[[Channel, dict], None]],
    preflight: Callable[[], None] = lambda: None,
) -> NoReturn:
    """Main of a side process: `preflight()`, then the role named by argv[1] with the config
    the driver sends first. A failure is reported on the channel before the process exits.
    Ends with os._exit: NIXL crashes at interpreter exit after creating a UCX backend."""
    role = sys.argv[1]
    chan = Channel()
    try:
        preflight()
        config = chan.recv()
        roles[role](chan, config)
        code = 0
    except Exception as exc:
        side_log(f"{system}-{role}", traceback.format_exc())
        try:
            chan.send_error(exc)
        except OSError:
            pass
        code = 1
    sys.stderr.flush()
    os._exit(code)


def ms(seconds: float | None) -> str:
    """Seconds as whole milliseconds for a table cell; "-" for none."""
    return "-" if seconds is None else f"{1e3 * seconds:.0f}"


def format_table(columns: Sequence[tuple[str, int]], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A fixed-width text table: a header of the `columns`' titles and a line per row, every
    cell padded to its column's width, the first (the row's name) left-aligned and the others
    right-aligned. A row with fewer cells than columns ends in free text, written unpadded
    (e.g. ``(system, "failed: ...")``)."""

    def line(cells: Sequence[Any]) -> str:
        if len(cells) > len(columns):
            raise ValueError(f"{len(cells)} cells for {len(columns)} columns: {cells}")
        out = []
        for i, (cell, (_, width)) in enumerate(zip(cells, columns, strict=False)):
            text = str(cell)
            if i == len(cells) - 1 and len(cells) < len(columns):
                out.append(text)
            else:
                out.append(text.ljust(width) if i == 0 else text.rjust(width))
        return "".join(out)

    return [line([title for title, _ in columns]), *(line(row) for row in rows)]
