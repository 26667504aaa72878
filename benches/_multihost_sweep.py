"""The `sweep` part of benches/multihost.py (see there), run by it on the simulated host
`client` inside the fabric it set up; $KVDUPLEX_SECRET is the run's shared secret.

Per history length L: turn 1 (L tokens; P computes it, D pulls it, links uncapped), then for
each link rate a turn 2 of its own: turn 1, its answer and `--new` tokens that differ per rate.
Before each, P's prefix cache is reset, so P pulls the turn-1 history from D across the capped
links (every rate pulls the same blocks). Then recompute: a plain server (no connector) on P's
host and CPUs gets the same turn-2 prompts, a length's first one on an empty prefix cache (what
P would spend without D's KV: `recompute_ttft_s`), the others with turn 1 in its cache (the
ideal with no transfer: `ideal_ttft_s`, as benches/history_sweep.py's ideal).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _netns import Fabric  # noqa: E402
from history_sweep import (  # noqa: E402
    KV_CACHE_GIB,
    MAX_MODEL_LEN,
    RECOMPUTE_THRESHOLD,
    breakdown,
    matches,
    prompt,
    reset_prefix_cache,
    server_args,
)
from kvduplex.demo import (  # noqa: E402
    ProxyThread,
    duplex_kv_transfer_config,
    read_metrics,
    read_metrics_after,
)
from kvduplex.demo.servers import ServerError, complete  # noqa: E402
from kvduplex_testing.servers import VllmServer, complete_streamed, node_cpu_sets, start_many  # noqa: E402
from kvduplex_testing.tiny_model import (  # noqa: E402
    REALISTIC_MODEL_CONFIG,
    build_realistic_chat_model,
)
from multihost import HOSTS, host_env, host_server, rate_label  # noqa: E402

logger = logging.getLogger("multihost")
SINGLE_HOST = HERE / "results" / "history_sweep_pinned.json"


def reset_p(server: VllmServer) -> None:
    """history_sweep's reset, tried for longer: a block P holds for D's read of a prompt too
    short to pull stays held until its lease ends (kv_lease_ttl_s, 30 s)."""
    deadline = time.monotonic() + 90
    while True:
        try:
            return reset_prefix_cache(server)
        except ServerError:
            if time.monotonic() > deadline:
                raise


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rates", type=float, nargs="+", required=True)
    parser.add_argument("--lengths", type=int, nargs="+", required=True)
    parser.add_argument("--answer", type=int, required=True)
    parser.add_argument("--new", type=int, required=True)
    parser.add_argument("--think", type=float, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    args = parser.parse_args()
    rates = [None if r == 0 else r for r in args.rates]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if max(args.lengths) + 2 * args.answer + args.new > MAX_MODEL_LEN:
        parser.error(f"history + answers + new tokens must fit in {MAX_MODEL_LEN}")
    started = time.monotonic()
    fabric = Fabric(HOSTS, prefix=args.prefix)  # set up by multihost.py
    secret = os.environ["KVDUPLEX_SECRET"]
    tmp = Path(tempfile.mkdtemp(prefix="multihost-sweep-", dir=args.out))
    model_dir = build_realistic_chat_model(args.model_dir)
    p_cpus, d_cpus = node_cpu_sets(2)

    def make(name: str, host: str, cpus, kv_config: dict | None) -> VllmServer:
        argv = server_args()
        if kv_config is not None:
            argv += ["--kv-transfer-config", json.dumps(kv_config)]
        env = {"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB}
        if host == "p":
            env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache
        return host_server(fabric, host, secret, model_dir, name=name, log_dir=tmp, argv=argv,
                           env=env, cpus=cpus)

    config = duplex_kv_transfer_config(bidirectional=True, recompute_threshold=RECOMPUTE_THRESHOLD)
    rows: list[dict] = []
    turn2_prompts: dict[tuple[int, str], list[int]] = {}
    answers = {}
    for host in ("p", "d"):
        fabric.set_rate(host, None)
    with start_many([make("prefill", "p", p_cpus, config), make("decode", "d", d_cpus, config)]) as (p, d):
        with ProxyThread([p.base_url], [d.base_url]) as proxy:
            # Long enough for D to pull (its read releases P's lease at once).
            complete_streamed(proxy.base_url, prompt(256, seed=-2), 2, timeout_s=900)
            for length in args.lengths:
                for host in ("p", "d"):
                    fabric.set_rate(host, None)
                turn1 = prompt(length, seed=length * 100)
                first = complete_streamed(proxy.base_url, turn1, args.answer, timeout_s=1800)
                logger.info("turn 1 of %d tokens: TTFT %.1f s", length, first.ttft_s)
                for i, gbit in enumerate(rates):
                    for host in ("p", "d"):
                        fabric.set_rate(host, gbit)
                    ids = turn1 + first.token_ids + prompt(args.new, seed=length * 1000 + i + 7)
                    turn2_prompts[(length, rate_label(gbit))] = ids
                    reset_p(p)
                    time.sleep(args.think)
                    p_before, d_before = read_metrics(p.base_url), read_metrics(d.base_url)
                    link_before = fabric.link_bytes("p")
                    second = complete_streamed(proxy.base_url, ids, args.answer, timeout_s=1800)
                    on_p = read_metrics_after(p.base_url, p_before, 1).minus(p_before)
                    on_d = read_metrics_after(d.base_url, d_before, 1).minus(d_before)
                    link_after = fabric.link_bytes("p")
                    row = {"history": length, "prompt_tokens": len(ids), "link_gbit": gbit,
                           **breakdown(second, on_p, on_d),
                           "p_link_rx_bytes": link_after["rx"] - link_before["rx"]}
                    if row["d_to_p_transfer_s"]:
                        row["pull_gbps"] = row["p_link_rx_bytes"] / row["d_to_p_transfer_s"] / 1e9
                    answers[(length, rate_label(gbit))] = second
                    rows.append(row)
                    logger.info("%d tokens, link %s: %s", length, rate_label(gbit), json.dumps(row))
    partial = args.out / "multihost_sweep.partial.json"  # kept if recompute fails
    partial.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    for host in ("p", "d"):
        fabric.set_rate(host, None)
    # No connector; its prefix cache is reset before each length's first turn 2.
    with start_many([make("recompute", "p", p_cpus, None)]) as (plain,):
        complete(plain.base_url, prompt(8, seed=-1), 2)
        for length in args.lengths:
            reset_p(plain)
            for i, gbit in enumerate(rates):
                ids = turn2_prompts[(length, rate_label(gbit))]
                got = complete_streamed(plain.base_url, ids, args.answer, timeout_s=1800)
                row = next(r for r in rows if r["history"] == length and r["link_gbit"] == gbit)
                row["recompute_ttft_s" if i == 0 else "ideal_ttft_s"] = got.ttft_s
                row["matches_recompute"] = matches(got, answers[(length, rate_label(gbit))])
                logger.info("plain server, %d tokens (%s): TTFT %.2f s", len(ids),
                            "cold" if i == 0 else "turn 1 cached", got.ttft_s)
    table = summarize(rows, args.lengths, rates)
    report = {"model": REALISTIC_MODEL_CONFIG, "lengths": args.lengths, "rates_gbit": args.rates,
              "answer_tokens": args.answer, "new_tokens": args.new, "think_s": args.think,
              "placement": f"P on CPUs {sorted(p_cpus)}, D on CPUs {sorted(d_cpus)}",
              "ucx": host_env(fabric, "p", "<secret>"), "load_average": os.getloadavg(),
              "seconds": round(time.monotonic() - started), "logs": str(tmp),
              "single_host_reference": SINGLE_HOST.name, "table": table, "rows": rows}
    path = args.out / "multihost_sweep.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    partial.unlink()
    print(format_table(table))
    print(f"wrote {path}")
    return 0 if all(r.get("matches_recompute") for r in rows) else 1


def summarize(rows: list[dict], lengths: list[int], rates: list) -> list[dict]:
    """One line per (length, rate), with the recompute reference of its length and the
    single-host pinned run's figures (benches/results/history_sweep_pinned.json)."""
    single = json.loads(SINGLE_HOST.read_text())["table"] if SINGLE_HOST.exists() else {}
    out = []
    for length in lengths:
        of_length = [r for r in rows if r["history"] == length]
        recompute = next((r["recompute_ttft_s"] for r in of_length if "recompute_ttft_s" in r), None)
        ideal = [r["ideal_ttft_s"] for r in of_length if "ideal_ttft_s" in r]
        for r in of_length:
            same_host = single.get("kvduplex-bidirectional", {}).get(str(length), {})
            out.append({
                "history": length, "link": rate_label(r["link_gbit"]), "ttft_s": r["ttft_s"],
                "lookup_s": r["lookup_s"], "pull_s": r["d_to_p_transfer_s"],
                "pull_gbps": r.get("pull_gbps"), "pulled_tokens": r["p_pulled_tokens"],
                "recompute_ttft_s": recompute,
                "recompute_over_ttft": recompute / r["ttft_s"] if recompute else None,
                "ideal_ttft_s": statistics.median(ideal) if ideal else None,
                "single_host_ttft_s": same_host.get("ttft_s"),
                "single_host_pull_s": same_host.get("d_to_p_transfer_s"),
                "single_host_recompute_ttft_s":
                    single.get("kvduplex-one-way", {}).get(str(length), {}).get("ttft_s"),
                "matches_recompute": r.get("matches_recompute"),
            })
    return out


def format_table(table: list[dict]) -> str:
    def ms(v):
        return f"{v * 1e3:.0f}" if v is not None else "-"

    lines = [f"{'history':>7} {'link':<14}{'TTFT ms':>8}{'lookup':>7}{'pull ms':>8}{'GB/s':>6}"
             f"{'pulled':>7}{'recomp ms':>10}{'x':>6}{'ideal':>7}{'1-host':>7}{'1h pull':>8}"
             f"{'1h recomp':>10}  match"]
    for t in table:
        lines.append(
            f"{t['history']:>7} {t['link']:<14}{ms(t['ttft_s']):>8}{ms(t['lookup_s']):>7}"
            f"{ms(t['pull_s']):>8}{(t['pull_gbps'] or 0):>6.2f}{t['pulled_tokens']:>7}"
            f"{ms(t['recompute_ttft_s']):>10}"
            f"{(t['recompute_over_ttft'] or 0):>6.1f}{ms(t['ideal_ttft_s']):>7}"
            f"{ms(t['single_host_ttft_s']):>7}{ms(t['single_host_pull_s']):>8}"
            f"{ms(t['single_host_recompute_ttft_s']):>10}  {t['matches_recompute']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
