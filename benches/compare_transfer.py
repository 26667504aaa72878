#!/usr/bin/env python3
"""Scattered-block READ benchmark: kvduplex vs NIXL vs a raw-UCX reference, in one run.

For every transport (tcp, shared memory) and every system, two processes on loopback: an owner
that fills a region with a known pattern and a reader that READs blocks of it into its own
region. Same patterns, same region size and the same memory (anonymous mmap, 2 MiB aligned,
MADV_HUGEPAGE unless --no-thp) for all systems. kvduplex and NIXL check every byte of their
untimed warm-up and closing batches, and the timed ones by sentinels as the raw-UCX reference
checks its own: a word at each end of every block (raw-ucx: the first word; checking every
byte between timed batches would evict the blocks from the cache and slow the next batch by
~20%; see timed_batches).

    python benches/compare_transfer.py --json OUT [--quick] [--systems kvduplex,nixl]

- kvduplex: kvduplex._core.Engine, one segment whose block is the pattern's block; the reader
  calls read_blocks + wait per batch (timed: both). Over shm it reads the owner directly (same-host
  reads: one process_vm_readv per up to 1,024 blocks; every batch copied by that peer's copy
  thread, rust/src/engine/copier.rs).
- kvduplex-ucx: the same with same_host_reads=False, so every block is one UCX cma read: the
  path between hosts, and what kvduplex did on one host before same-host reads.
- nixl: nixl_cu12 with the UCX backend, progress thread off, per-block descriptors prepared once
  per pattern; per batch make_prepped_xfer + transfer + polling (timed: all three). NIXL
  1.5.1 merges descriptors contiguous on both sides itself (runs of 50: 20 reads).
- raw-ucx: ../shared/tools/ucp_rma_bench.c built at run time against this venv's libucx
  (ucp_get_nbx per block + one flush; timed: posting and completion). It only has scattered
  patterns, so 1000x32K-runs50 is n/a there, and it checks a sentinel word in every block plus
  sampled words of three blocks rather than every byte.

Over tcp the NIXL and raw-ucx owners spin on UCX progress (tcp reads need it); over shm, where
cma reads need nothing from the owner, raw-ucx's owner idles after wire-up and NIXL's polls once
a millisecond (--spin-owners: spin there too; on 2 cores a spinning owner takes the reader's
CPU). kvduplex's owner runs its engine's own progress thread.
--rounds N runs every system N times, interleaved, and reports each one's median round (by GB/s).
Prints a table to stdout (progress on stderr) and writes a JSON list of rows
{"system", "pattern", "transport", "gbps", "p50_us", "p99_us", "verified", ...}; a system that
fails gets rows with verified false and an "error" instead of aborting the run; the exit
status is 1 when any row failed.
"""

import argparse
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _bench_common import (  # noqa: E402
    PATTERNS,
    PATTERNS_BY_NAME,
    MiB,
    pattern_to_dict,
    repetitions,
)

SYSTEMS = ("kvduplex", "kvduplex-ucx", "nixl", "raw-ucx")
TRANSPORTS = ("tcp", "shm")
# UCX_TLS per transport, the same for every system. cma does the shared-memory READs; NIXL
# also needs tcp there for its active messages (with cma alone or sm,self its UCX backend fails).
UCX_TLS = {"tcp": "tcp,self", "shm": "cma,tcp"}
SIDE_SCRIPTS = {"kvduplex": HERE / "_kvduplex_side.py", "kvduplex-ucx": HERE / "_kvduplex_side.py",
                "nixl": HERE / "_nixl_side.py"}
# ucp_rma_bench's pattern names for ours; it has no runs-of-50 pattern.
RAW_UCX_PATTERNS = {"16x4K": "lat_16x4K", "1000x16K": "1000x16K", "1000x32K": "1000x32K",
                    "100x1M": "100x1M"}
DEFAULT_TOOLS = HERE.parent.parent / "shared" / "tools"
# UCX's log lines ("... UCX  ERROR ...") and NIXL's glog-style ones ("E1202 16:41:35.638 ...").
ERROR_LINE = re.compile(r" ERROR |^E\d{4} ")


@dataclass(frozen=True)
class Side:
    """Where an owner or reader process runs: a command prefix (benches/multihost.py enters a
    simulated host's namespaces with it), environment laid over the run's, and the address its
    engine listens on (kvduplex; NIXL's side processes ignore it)."""

    prefix: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=lambda: {"UCX_NET_DEVICES": "lo"})
    host: str = "127.0.0.1"


LOOPBACK = {"owner": Side(), "reader": Side()}


def progress(msg: str) -> None:
    print(f"[compare_transfer] {msg}", file=sys.stderr, flush=True)


class SideError(Exception):
    """A side process reported an error for one command; it is still usable."""


class SideDied(Exception):
    """A side process exited, timed out or broke the protocol; it is not usable any more."""


class SideProcess:
    """An owner or reader process of one system, driven over JSON lines on stdin/stdout.
    Its stderr goes to a log file whose tail is quoted when it fails."""

    def __init__(self, system: str, role: str, env: dict, log_dir: Path, verbose: bool,
                 prefix: tuple[str, ...] = ()):
        self.name = f"{system}-{role}"
        self.log_path = log_dir / f"{self.name}.log"
        self._log = None if verbose else open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, str(SIDE_SCRIPTS[system]), role],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env,
            cwd=HERE,
        )
        self._buf = b""

    def send(self, **msg) -> None:
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as exc:
            try:
                code = self.proc.wait(timeout=5)
                why = f"exited with code {code}"
            except subprocess.TimeoutExpired:
                why = f"cannot send ({exc})"
            raise SideDied(f"{self.name} {why}{self.log_tail()}") from exc

    def expect(self, event: str, timeout_s: float) -> dict:
        msg = self._recv(timeout_s)
        if msg.get("event") == "error":
            raise SideError(msg.get("error", "unknown error") + self.logged_errors())
        if msg.get("event") != event:
            raise SideDied(f"{self.name}: expected {event!r}, got {msg!r}")
        return msg

    def _recv(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SideDied(f"{self.name}: no answer within {timeout_s:.0f} s{self.log_tail()}")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    code = self.proc.wait()
                    raise SideDied(f"{self.name} exited with code {code}{self.log_tail()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except json.JSONDecodeError as exc:
            raise SideDied(f"{self.name}: bad protocol line {line[:200]!r}") from exc

    def _log_lines(self) -> list[str]:
        if self._log is None or not self.log_path.exists():
            return []
        self._log.flush()
        return self.log_path.read_text(errors="replace").splitlines()

    def log_tail(self, lines: int = 8) -> str:
        tail = self._log_lines()[-lines:]
        return ("\n    " + "\n    ".join(tail)) if tail else ""

    def logged_errors(self, lines: int = 2) -> str:
        """The last UCX/NIXL error lines of the log (they say why; the exception often does not)."""
        errors = [ln.strip() for ln in self._log_lines() if ERROR_LINE.search(ln)]
        return ("; " + " | ".join(errors[-lines:])) if errors else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(cmd="quit")
                self.proc.wait(timeout=20)
            except (SideDied, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()


def failed_row(system, pattern, transport, error, **extra) -> dict:
    row = {"system": system, "pattern": pattern, "transport": transport, "gbps": None,
           "p50_us": None, "p99_us": None, "verified": False, "error": error}
    row.update(extra)
    return row


def run_side_system(system, transport, patterns, args, log_dir, sides=LOOPBACK) -> list[dict]:
    """Owner + reader processes of kvduplex or NIXL, all patterns of one transport, placed
    as `sides` says (by role)."""
    tls = args.ucx_tls[transport]
    config = {"region_bytes": args.region_mib * MiB, "hugepages": not args.no_thp,
              "owner_poll": args.owner_poll[transport],
              "same_host_reads": system != "kvduplex-ucx"}
    owner_poll = args.owner_poll[transport] if system == "nixl" else "engine progress thread"
    common = {"ucx_tls": tls, "owner_poll": owner_poll}
    rows = []
    owner = reader = None
    todo = list(patterns)
    def start(role: str) -> SideProcess:
        side = sides[role]
        env = {**os.environ, "UCX_TLS": tls, **side.env}
        process = SideProcess(system, role, env, log_dir, args.verbose, side.prefix)
        process.send(**config, host=side.host)
        return process

    try:
        owner = start("owner")
        owner_ready = owner.expect("ready", args.timeout)
        reader = start("reader")
        reader_ready = reader.expect("ready", args.timeout)
        common["memory"] = owner_ready["memory"]["memory"]
        common["hugepage_fraction"] = {
            "owner": owner_ready["memory"]["hugepage_fraction"],
            "reader": reader_ready["memory"]["hugepage_fraction"],
        }
        reader.send(cmd="connect", owner=owner_ready["info"])
        reader.expect("connect", args.timeout)
        while todo:
            pattern = todo[0]
            reps = repetitions(pattern, args.reps, args.small_reps)
            owner.send(cmd="setup", pattern=pattern_to_dict(pattern))
            try:
                setup = owner.expect("setup", args.timeout)
                reader.send(
                    cmd="run", pattern=pattern_to_dict(pattern), reps=reps, warmup=args.warmup,
                    owner={**owner_ready["info"], **setup["info"]},
                    batch_timeout_s=args.batch_timeout,
                )
                result = reader.expect("result", args.timeout)
                result.pop("event")
                row = {"system": system, "pattern": pattern.name, "transport": transport,
                       **result, **common}
            except SideError as exc:
                row = failed_row(system, pattern.name, transport, str(exc), **common)
            finally:
                if owner.proc.poll() is None:
                    owner.send(cmd="teardown")
                    owner.expect("teardown", args.timeout)
            rows.append(row)
            report(row)
            todo.pop(0)
    except (SideError, SideDied, OSError) as exc:
        msg = str(exc)
        progress(f"{system}/{transport} failed: {msg}")
        for pattern in todo:
            rows.append(failed_row(system, pattern.name, transport, msg.split("\n")[0], **common))
    finally:
        for side in (reader, owner):
            if side is not None:
                side.stop()
    return rows


def build_raw_ucx(tools: Path, out_dir: Path) -> Path:
    script = tools / "build_ucp_rma_bench.sh"
    if not script.exists():
        raise FileNotFoundError(f"raw-UCX reference not found: {script} (see --raw-ucx-tools)")
    binary = out_dir / "ucp_rma_bench"
    done = subprocess.run(["bash", str(script), sys.executable, str(binary)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building ucp_rma_bench failed:\n{done.stdout}{done.stderr}")
    return binary


def run_raw_ucx(binary, transport, patterns, args) -> list[dict]:
    tls = args.ucx_tls[transport]
    idle_target = args.owner_poll[transport] == "idle"
    env = dict(os.environ, UCX_TLS=tls, UCX_NET_DEVICES="lo",
               BENCH_HUGEPAGE="0" if args.no_thp else "1",
               BENCH_TARGET_SLEEP="1" if idle_target else "0")
    failure = None
    common = {"ucx_tls": tls, "owner_poll": args.owner_poll[transport],
              "memory": "mmap (4 KiB pages)" if args.no_thp else "mmap+MADV_HUGEPAGE"}
    measured = {}
    try:
        if not any(p.name in RAW_UCX_PATTERNS for p in patterns):
            raise LookupError("none of the chosen patterns")
        done = subprocess.run([str(binary), str(args.region_mib), str(args.reps)], env=env,
                              capture_output=True, text=True, timeout=args.timeout * 4)
        ucx_log = []
        for line in done.stdout.splitlines():
            if not line.startswith("{"):
                ucx_log.append(line.strip())  # UCX logs to stdout
                continue
            rec = json.loads(line)
            if "pattern" in rec:
                measured[rec["pattern"]] = rec
        if done.returncode != 0 and not measured:
            why = " | ".join([*ucx_log[-2:], *done.stderr.strip().splitlines()[-2:]])
            raise RuntimeError(f"ucp_rma_bench exited {done.returncode}: {why}")
    except LookupError:
        pass  # only n/a rows below
    except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
        failure = str(exc)
    rows = []
    for pattern in patterns:
        tool_name = RAW_UCX_PATTERNS.get(pattern.name)
        if tool_name is None:
            rows.append(failed_row("raw-ucx", pattern.name, transport, None, **common,
                                   note="n/a: ucp_rma_bench has no runs-of-50 pattern"))
            continue
        if failure:
            rows.append(failed_row("raw-ucx", pattern.name, transport, failure, **common))
            continue
        rec = measured.get(tool_name)
        if rec is None:
            rows.append(failed_row("raw-ucx", pattern.name, transport,
                                   f"ucp_rma_bench printed no {tool_name} result "
                                   f"(exit {done.returncode}): {done.stderr.strip()[-300:]}",
                                   **common))
            continue
        row = {"system": "raw-ucx", "pattern": pattern.name, "transport": transport,
               "gbps": round(rec["GBps_med"], 3), "p50_us": rec["med_us"],
               "p99_us": rec["p99_us"], "verified": rec["verified"], "reps": rec["reps"],
               "num_descriptors": rec["n_desc"], **common}
        rows.append(row)
    for row in rows:
        report(row)
    return rows


def median_of_rounds(rows: list[dict]) -> list[dict]:
    """One row per (system, pattern, transport): its median round by GB/s (of an even number,
    the lower of the two middle ones), so one lucky or unlucky round moves no ratio. Verified
    only if every round was."""
    grouped: dict[tuple, list[dict]] = {}
    for row in rows:
        grouped.setdefault((row["system"], row["pattern"], row["transport"]), []).append(row)
    medians = []
    for runs in grouped.values():
        measured = sorted((r for r in runs if r["gbps"] is not None), key=lambda r: r["gbps"])
        row = dict(measured[(len(measured) - 1) // 2] if measured else runs[-1])
        if len(runs) > 1:
            row["verified"] = all(r["verified"] for r in runs)
            row["gbps_rounds"] = [r["gbps"] for r in runs]
            errors = sorted({r["error"] for r in runs if r.get("error")})
            if errors and not row.get("error"):
                row["error"] = "; ".join(errors)
        medians.append(row)
    return medians


def report(row: dict) -> None:
    where = f"{row['system']}/{row['transport']}/{row['pattern']}"
    if row.get("gbps") is not None:
        progress(f"{where}: {row['gbps']:.2f} GB/s, p50 {row['p50_us']:.1f} us, "
                 f"p99 {row['p99_us']:.1f} us, verified={row['verified']}")
    else:
        progress(f"{where}: {row.get('note') or 'FAILED: ' + str(row.get('error'))}")


def format_table(rows: list[dict], systems, patterns, transports) -> str:
    by_key = {(r["system"], r["pattern"], r["transport"]): r for r in rows}

    def cell(system, pattern, transport):
        row = by_key.get((system, pattern, transport))
        if row is None:
            return "-"
        if row.get("note"):
            return "n/a"
        if row["gbps"] is None:
            return "FAILED"
        mark = "" if row["verified"] else " UNVERIFIED"
        return f"{row['gbps']:.2f} GB/s {row['p50_us']:.0f}us{mark}"

    def ratio(a, b, pattern, transport):
        ra, rb = by_key.get((a, pattern, transport)), by_key.get((b, pattern, transport))
        if not ra or not rb or not ra.get("gbps") or not rb.get("gbps"):
            return "-"
        return f"{ra['gbps'] / rb['gbps']:.2f}x"

    header = ["pattern", "transport", *systems]
    ratios = [(a, b) for a, b in (("kvduplex", "raw-ucx"), ("kvduplex-ucx", "raw-ucx"),
                                  ("kvduplex", "nixl"))
              if a in systems and b in systems]
    header += [f"{a.replace('kvduplex', 'kvd')}/{b}" for a, b in ratios]
    lines = [header]
    for transport in transports:
        for pattern in patterns:
            lines.append([pattern.name, transport,
                          *(cell(s, pattern.name, transport) for s in systems),
                          *(ratio(a, b, pattern.name, transport) for a, b in ratios)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="OUT", help="write the result rows here as a JSON list")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"comma-separated subset of {','.join(SYSTEMS)}")
    ap.add_argument("--transports", default=",".join(TRANSPORTS),
                    help=f"comma-separated subset of {','.join(TRANSPORTS)}")
    ap.add_argument("--patterns", default=",".join(p.name for p in PATTERNS),
                    help="comma-separated subset of the patterns")
    ap.add_argument("--quick", action="store_true",
                    help="development run: 256 MiB regions, 5 reps (50 for small batches)")
    ap.add_argument("--region-mib", type=int, help="region size per process (default 1024)")
    ap.add_argument("--reps", type=int, help="timed batches per pattern (default 20)")
    ap.add_argument("--small-reps", type=int,
                    help="timed batches for batches under 16 MiB (default 200; raw-ucx always 200)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every system this many times, interleaved; report each one's "
                         "median round (steadier ratios on a busy machine)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed batches first (raw-ucx: 2)")
    ap.add_argument("--no-thp", action="store_true", help="plain 4 KiB pages for all systems")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds any one step (start, one pattern) may take")
    ap.add_argument("--batch-timeout", type=float, default=30.0,
                    help="seconds one batch may take before it counts as failed")
    ap.add_argument("--raw-ucx-tools", type=Path, default=DEFAULT_TOOLS,
                    help="directory with ucp_rma_bench.c and build_ucp_rma_bench.sh")
    for transport in TRANSPORTS:
        ap.add_argument(f"--ucx-tls-{transport}", metavar="TLS", default=UCX_TLS[transport],
                        help=f"UCX_TLS for the {transport} transport (default {UCX_TLS[transport]})")
    ap.add_argument("--spin-owners", action="store_true",
                    help="NIXL's and raw-ucx's owners spin on UCX progress over shm too; by "
                         "default they spin only over tcp (whose reads need it) and over shm "
                         "raw-ucx's idles after wire-up and NIXL's polls once a millisecond. "
                         "kvduplex's owner always runs its own progress thread")
    ap.add_argument("--verbose", action="store_true", help="pass the side processes' stderr through")
    args = ap.parse_args(argv)
    if args.region_mib is None:
        args.region_mib = 256 if args.quick else 1024
    if args.reps is None:
        args.reps = 5 if args.quick else 20
    if args.small_reps is None:
        args.small_reps = 50 if args.quick else 200

    def subset(value, allowed, what):
        chosen = [v for v in value.split(",") if v]
        unknown = [v for v in chosen if v not in allowed]
        if unknown or not chosen:
            ap.error(f"--{what}: unknown {unknown or value!r}; choose from {', '.join(allowed)}")
        return [v for v in allowed if v in chosen]

    args.ucx_tls = {t: getattr(args, f"ucx_tls_{t}") for t in TRANSPORTS}
    args.owner_poll = {t: "spin" if args.spin_owners or t == "tcp" else "idle"
                       for t in TRANSPORTS}
    args.systems = subset(args.systems, SYSTEMS, "systems")
    args.transports = subset(args.transports, TRANSPORTS, "transports")
    args.patterns = [PATTERNS_BY_NAME[n]
                     for n in subset(args.patterns, list(PATTERNS_BY_NAME), "patterns")]
    if args.region_mib <= 0 or args.region_mib % 2:
        ap.error("--region-mib must be a positive even number (regions are 2 MiB aligned)")
    if args.reps < 1 or args.small_reps < 1 or args.rounds < 1 or args.warmup < 0:
        ap.error("--reps, --small-reps and --rounds must be >= 1, --warmup >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    rows = []
    log_dir = Path(tempfile.mkdtemp(prefix="compare_transfer."))
    raw_binary = raw_error = None
    if "raw-ucx" in args.systems:
        try:
            raw_binary = build_raw_ucx(args.raw_ucx_tools, log_dir)
            progress(f"built {raw_binary.name} from {args.raw_ucx_tools}")
        except (OSError, RuntimeError) as exc:
            raw_error = str(exc)
            progress(f"raw-ucx unavailable: {raw_error}")
    for round_no in range(1, args.rounds + 1):
        for transport in args.transports:
            for system in args.systems:
                progress(f"round {round_no}/{args.rounds}: {system} over {transport} "
                         f"(UCX_TLS={args.ucx_tls[transport]}, {args.region_mib} MiB regions)")
                if system != "raw-ucx":
                    rows += run_side_system(system, transport, args.patterns, args, log_dir)
                elif raw_binary is None:
                    rows += [failed_row(system, p.name, transport, raw_error)
                             for p in args.patterns]
                else:
                    rows += run_raw_ucx(raw_binary, transport, args.patterns, args)
    rows = median_of_rounds(rows)
    failed = [r for r in rows if not r["verified"] and not r.get("note")]
    if failed and not args.verbose:
        progress(f"{len(failed)} rows failed; side-process logs kept in {log_dir}")
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    print(format_table(rows, args.systems, args.patterns, args.transports))
    memory = sorted({r["memory"] for r in rows if r.get("memory")})
    print(f"memory: {', '.join(memory) or 'n/a'}; region {args.region_mib} MiB per process; "
          "UCX_TLS " + ", ".join(f"{t}={args.ucx_tls[t]}" for t in args.transports)
          + "; UCX_NET_DEVICES=lo")
    print(f"1-minute load average: {load_before:.1f} at start, {os.getloadavg()[0]:.1f} at end "
          f"({os.cpu_count()} CPUs; other load slows every system, busy-polling ones most)")
    if "raw-ucx" in args.systems and any(p.run_length > 1 for p in args.patterns):
        print("raw-ucx: n/a for runs-of-50 (ucp_rma_bench only has scattered patterns)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        progress(f"wrote {len(rows)} rows to {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
