"""Two prefill servers behind `kvduplex proxy`: a conversation's turns on its own P (prefill
affinity, `--prefill-affinity-slack 2`, the default) against each turn on the least busy P
(`off`, the proxy before affinity), side by side on one set of servers.

Servers: P0 pinned to CPU 0, P1 to CPU 1, D on both (bidirectional DuplexConnector, the KV plan
of `benches/load.py`'s default workload: each server's cache holds about a third of the live
histories). Two proxies (threads of this process) in front of the same servers, one per
policy; rounds alternate between them (affinity first), each round with chats of its own seeds
(`load.point_plan`), so drifts of the machine touch both alike. The client is `load.py`'s
(streamed chats, real answers fed back, Poisson arrivals, exponential think times).

Per round: both P's prompt tokens computed, from their own prefix cache, and pulled from D
(`vllm:prompt_tokens_by_source`), D->P hits, lookups ruled out, preemptions, client errors
and TTFT p50/p90 on turns >= 2 (one machine running three servers on two cores: TTFT is
reported, the token counts are what the policy changes).

    UCX_NET_DEVICES=lo PYTHONPATH=python .venv/bin/python benches/multi_prefill.py --json OUT
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import logging
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import load
from kvduplex.demo import ProxyThread, duplex_kv_transfer_config, read_metrics
from kvduplex.proxy.config import DEFAULT_PREFILL_AFFINITY_SLACK
from kvduplex_testing.servers import VllmServer, start_many
from kvduplex_testing.tiny_model import build_tiny_chat_model

POLICIES = {"affinity": DEFAULT_PREFILL_AFFINITY_SLACK, "least_busy": None}


def round_summary(policy: str, index: int, records: list, deltas: dict) -> dict:
    prefills = [deltas["P0"], deltas["P1"]]
    later = [r.ttft_s for r in records if r.turn >= 1 and r.ttft_s is not None]
    return {
        "policy": policy,
        "round": index,
        "errors": sum(r.error is not None for r in records),
        "ttft_p50_s_turns_2_plus": statistics.median(later) if later else None,
        "ttft_p90_s_turns_2_plus": load.percentile(later, 0.9),
        "p_computed_tokens": sum(m.computed_tokens for m in prefills),
        "p_cache_hit_tokens": sum(m.cache_hit_tokens for m in prefills),
        "d_to_p_tokens": sum(m.transferred_tokens for m in prefills),
        "d_to_p_hits": int(sum(m.connector.get("lookups_hit", 0) for m in prefills)),
        "lookups_ruled_out": int(sum(m.connector.get("lookups_ruled_out", 0) for m in prefills)),
        "preemptions": int(sum(m.preemptions for m in deltas.values())),
    }


def run(args: argparse.Namespace) -> list[dict]:
    workload = load.FULL
    plan = load.kv_plan(workload)
    config = duplex_kv_transfer_config(
        bidirectional=True, recompute_threshold=load.RECOMPUTE_THRESHOLD
    )
    server_args = [*load.server_args(plan, plan["node_blocks"]),
                   "--kv-transfer-config", json.dumps(config)]
    servers = {
        role: VllmServer(args.model_dir, name=role.lower(), extra_args=server_args,
                         log_dir=args.work_dir, cpus=cpus)
        for role, cpus in (("P0", {0}), ("P1", {1}), ("D", {0, 1}))
    }
    prefill_urls = [servers["P0"].base_url, servers["P1"].base_url]
    rounds = []
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context("spawn")
    ) as client, start_many(list(servers.values())), contextlib.ExitStack() as stack:
        for seed, server in enumerate(servers.values(), start=1):
            client.submit(load.warm_up_chat, server.base_url, seed).result()
        proxies = {
            policy: stack.enter_context(ProxyThread(
                prefill_urls, [servers["D"].base_url], prefill_affinity_slack=slack
            ))
            for policy, slack in POLICIES.items()
        }
        client.submit(load.warm_up_chat, proxies["affinity"].base_url, 0).result()
        for index in range(2 * args.rounds):
            policy = list(POLICIES)[index % 2]
            time.sleep(load.PAUSE_BETWEEN_POINTS_S)
            before = {role: read_metrics(s.base_url) for role, s in servers.items()}
            point = load.point_plan(workload, args.rate, index)
            records = client.submit(load.run_point, [proxies[policy].base_url], point).result()
            time.sleep(load.PAUSE_BETWEEN_POINTS_S)  # the last turns' counters
            deltas = {role: read_metrics(s.base_url).minus(before[role])
                      for role, s in servers.items()}
            rounds.append(round_summary(policy, index, records, deltas))
            logging.info("%s", json.dumps(rounds[-1]))
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=1.0, help="chat arrivals per second")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per policy")
    parser.add_argument("--json", type=Path, help="write the rounds here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args.work_dir = Path(tempfile.mkdtemp(prefix="kvduplex-multi-prefill-"))
    args.model_dir = build_tiny_chat_model(args.work_dir / "tiny-chat-model")
    rounds = run(args)
    for policy in POLICIES:
        mine = [r for r in rounds if r["policy"] == policy]
        print(f"{policy:>10}: P computed {[r['p_computed_tokens'] for r in mine]} tokens, "
              f"cache hits {[r['p_cache_hit_tokens'] for r in mine]}, D->P "
              f"{[r['d_to_p_tokens'] for r in mine]}, TTFT p50 ms "
              f"{[round(1000 * r['ttft_p50_s_turns_2_plus'], 1) for r in mine]}, errors "
              f"{sum(r['errors'] for r in mine)}")
    if args.json:
        args.json.write_text(json.dumps({"rate": args.rate, "rounds": rounds}, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
