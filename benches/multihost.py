#!/usr/bin/env python3
"""P and D on separate simulated hosts: transfer GB/s and turn-N TTFT per link rate.

Every host is a network namespace with one veth link to a bridge, and its processes run in a
pid namespace of their own (benches/_netns.py). The link of each host is capped with `tc tbf`
at each rate of `--rates` (Gbit/s; 0 = uncapped). Between hosts kvduplex reads through UCX over
TCP (UCX_TLS=tcp, UCX_NET_DEVICES=the host's veth), its side channels listen on the veth
addresses and authenticate each other with a shared secret ($KVDUPLEX_SECRET, made up per run).
Same-host reads are off twice over: UCX_TLS rules out cma, and the owner's pid, published from
its own pid namespace, names no process the reader can prove (the boot id, which the engine
compares first, is the same in every namespace). `--check-pidns` shows the second alone: one
batch with UCX_TLS=tcp,cma, whose transfer must still report same_host false. Every read's
bytes are counted on the reader's link (rx) as a check that they crossed it.

Two parts, each optional:

- `transfer`: compare_transfer.py's kvduplex owner on host `p`, its reader on host `d`; per rate
  the patterns of `--patterns` (default 100x1M and 1000x32K), GB/s (1e9 bytes/s) against the
  link's cap (rate / 8: the reference; TCP/IP headers take ~4% of it at MTU 1500).
- `sweep`: a vLLM P/D pair (benches/history_sweep.py's model, config and placement: P pinned to
  the first half of the CPUs, D to the second) on hosts `p` and `d`, behind the kvduplex proxy on
  host `client` (uncapped). Per history length: turn 1 (P computes it, D pulls it), then per
  rate a further turn: P's prefix cache is reset, so P finds the history on D and pulls it
  across the capped link (history_sweep's scenario; each turn adds the answer and `--new`
  tokens). Then recompute: a plain server without a prefix cache on P's host and CPUs is sent
  every turn's prompt; its TTFT is what P would spend without D's KV. Each P/D answer is
  compared with recompute's (tokens; logprobs within history_sweep's tolerance).

    sudo PYTHONPATH=python .venv/bin/python benches/multihost.py --out benches/results \\
        [--parts transfer sweep] [--rates 1 5 10 0] [--lengths 1024 2048 4096 8000]

writes OUT/multihost_transfer.json and OUT/multihost_sweep.json. Exit status 1 when a part
fails, a read came out same-host, or an answer differs.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import compare_transfer  # noqa: E402
from _bench_common import PATTERNS_BY_NAME  # noqa: E402
from _netns import HOST_IFACE, Fabric  # noqa: E402
from kvduplex_testing.servers import VllmServer  # noqa: E402

HOSTS = ("p", "d", "client")
UCX_TLS = "tcp"
SERVER_PORT = 8000  # every host has its own port space


def rate_label(gbit: float | None) -> str:
    return "uncapped" if gbit is None else f"{gbit:g} Gbit/s"


def host_env(fabric: Fabric, name: str, secret: str, ucx_tls: str = UCX_TLS) -> dict[str, str]:
    return {"UCX_TLS": ucx_tls, "UCX_NET_DEVICES": HOST_IFACE, "KVDUPLEX_SECRET": secret,
            "VLLM_HOST_IP": fabric.address(name)}


def host_server(fabric: Fabric, host: str, secret: str, model_dir: Path, *, name: str,
                log_dir: Path, argv: list[str], env: dict[str, str] | None = None,
                cpus=None, startup_timeout_s: float = 900) -> VllmServer:
    """A vLLM server on simulated host `host` (its own network and pid namespaces), reading its
    peers through UCX over the host's link (`host_env`); `argv` are the server's arguments."""
    return VllmServer(model_dir, name=name, host=fabric.address(host), port=SERVER_PORT,
                      extra_args=argv, env={**(env or {}), **host_env(fabric, host, secret)},
                      log_dir=log_dir, startup_timeout_s=startup_timeout_s, cpus=cpus,
                      python=fabric.launcher(host, log_dir))


def sides(fabric: Fabric, secret: str, ucx_tls: str = UCX_TLS) -> dict:
    return {role: compare_transfer.Side(prefix=tuple(fabric.exec_prefix(host)),
                                        env=host_env(fabric, host, secret, ucx_tls),
                                        host=fabric.address(host))
            for role, host in (("owner", "p"), ("reader", "d"))}


def run_transfer(fabric: Fabric, args, secret: str) -> tuple[list[dict], bool]:
    patterns = [PATTERNS_BY_NAME[n] for n in args.patterns]
    ct_args = compare_transfer.parse_args([
        "--systems", "kvduplex", "--transports", "tcp", "--region-mib", str(args.region_mib),
        "--reps", str(args.reps), "--small-reps", str(args.small_reps),
        "--ucx-tls-tcp", UCX_TLS, "--batch-timeout", "120",
    ])
    log_dir = Path(tempfile.mkdtemp(prefix="multihost-transfer-"))
    rows, ok = [], True
    for gbit in args.rates:
        for host in ("p", "d"):
            fabric.set_rate(host, gbit)
        compare_transfer.progress(f"link {rate_label(gbit)}: {fabric.qdisc('d') or 'no qdisc'}")
        before = fabric.link_bytes("d")
        got = compare_transfer.run_side_system("kvduplex", "tcp", patterns, ct_args, log_dir,
                                               sides(fabric, secret))
        after = fabric.link_bytes("d")
        for row in got:
            row["link_gbit"] = gbit
            row["reader_link_rx_bytes"] = after["rx"] - before["rx"]
            if gbit is not None and row.get("gbps") is not None:
                row["cap_gbps"] = gbit / 8
                row["of_cap"] = round(row["gbps"] / row["cap_gbps"], 3)
            ok &= bool(row.get("verified")) and row.get("same_host") is False
        rows += got
    if args.check_pidns:
        # cma allowed: only the pid namespaces keep the reads off the same-host path.
        for host in ("p", "d"):
            fabric.set_rate(host, None)
        got = compare_transfer.run_side_system(
            "kvduplex", "tcp", [PATTERNS_BY_NAME["16x4K"]], ct_args, log_dir,
            sides(fabric, secret, "tcp,cma"))
        for row in got:
            row["check"] = "UCX_TLS=tcp,cma: same_host must be false (pid namespaces)"
            ok &= bool(row.get("verified")) and row.get("same_host") is False
        rows += got
    compare_transfer.progress(f"side-process logs in {log_dir}")
    return rows, ok


def format_transfer(rows: list[dict]) -> str:
    lines = [f"{'link':<14}{'pattern':<18}{'GB/s':>8}{'cap GB/s':>10}{'of cap':>8}"
             f"{'p50 us':>11}{'same_host':>11}{'link rx MB':>12}  verified"]
    for r in rows:
        gbps = f"{r['gbps']:.3f}" if r.get("gbps") is not None else "FAILED"
        lines.append(
            f"{rate_label(r.get('link_gbit')) + (' cma' if r.get('check') else ''):<14}"
            f"{r['pattern']:<18}{gbps:>8}{r.get('cap_gbps', '-'):>10}{r.get('of_cap', '-'):>8}"
            f"{r.get('p50_us') or '-':>11}{str(r.get('same_host')):>11}"
            f"{(r.get('reader_link_rx_bytes') or 0) / 1e6:>12.0f}  {r.get('verified')}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", nargs="+", choices=("transfer", "sweep"),
                        default=["transfer", "sweep"])
    parser.add_argument("--rates", type=float, nargs="+", default=[1, 5, 10, 0],
                        help="link rates in Gbit/s; 0 = uncapped")
    parser.add_argument("--patterns", nargs="+", default=["100x1M", "1000x32K"],
                        choices=list(PATTERNS_BY_NAME))
    parser.add_argument("--region-mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--small-reps", type=int, default=50)
    parser.add_argument("--check-pidns", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8000])
    parser.add_argument("--answer", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--think", type=float, default=2.0)
    parser.add_argument("--model-dir", type=Path,
                        default=Path(tempfile.gettempdir()) / "kvduplex-realistic-model",
                        help="realistic model directory (built if missing, ~1.5 GB)")
    parser.add_argument("--prefix", default="kvdmh", help="namespace name prefix")
    args = parser.parse_args()
    args.rates = [None if r == 0 else r for r in args.rates]
    if os.geteuid() != 0:
        parser.error("needs root (network namespaces, tc)")
    args.out.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_hex(16)
    ok = True
    started = time.monotonic()
    with Fabric(HOSTS, prefix=args.prefix) as fabric:
        if "transfer" in args.parts:
            rows, part_ok = run_transfer(fabric, args, secret)
            ok &= part_ok
            report = {"ucx_tls": UCX_TLS, "region_mib": args.region_mib,
                      "load_average": os.getloadavg(), "cpus": os.cpu_count(),
                      "seconds": round(time.monotonic() - started), "rows": rows}
            path = args.out / "multihost_transfer.json"
            path.write_text(json.dumps(report, indent=1) + "\n")
            print(format_transfer(rows))
            print(f"wrote {path}")
        if "sweep" in args.parts:
            ok &= run_sweep_in_client(fabric, args, secret)
    return 0 if ok else 1


def run_sweep_in_client(fabric: Fabric, args, secret: str) -> bool:
    """The sweep's driver (client, proxy) runs on host `client`: it reaches P and D only
    through the links."""
    command = [*fabric.exec_prefix("client"), sys.executable, str(HERE / "_multihost_sweep.py"),
               "--prefix", args.prefix, "--out", str(args.out),
               "--rates", *[str(r or 0) for r in args.rates],
               "--lengths", *map(str, args.lengths), "--answer", str(args.answer),
               "--new", str(args.new), "--think", str(args.think), "--model-dir", str(args.model_dir)]
    env = dict(os.environ, KVDUPLEX_SECRET=secret)
    return subprocess.run(command, env=env).returncode == 0


if __name__ == "__main__":
    sys.exit(main())
