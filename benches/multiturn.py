"""Multi-turn P/D benchmark: the same conversations through four systems, one after another.

Systems (each: one prefill server P, one decode server D, the kvduplex proxy in front):
- `kvduplex-bidirectional` (the "conversation-id" mode): DuplexConnector with
  `bidirectional_kv_xfer: true`; turns are non-streaming and carry the proxy's conversation-id
  header, so the proxy replays D's `kv_transfer_params` to P and on each later turn P pulls the
  history's KV back from the D that decoded the previous turn.
- `kvduplex-bidirectional-stream`: the same servers and proxy, but every turn is streamed
  (`"stream": true`) and sent without a conversation id: the proxy routes the conversation to a D
  by hashing its start, and P finds the previous turn's KV on D by the prompt itself (a lookup of
  the prompt's block fingerprints over the side channel).
- `kvduplex-one-way`: DuplexConnector, P->D only; P recomputes whatever its own prefix cache
  lacks.
- `nixl-bidirectional`: vLLM's NixlConnector with `bidirectional_kv_xfer: true` and the same
  threshold. The kvduplex proxy replays D's `kv_transfer_params` to P on the next turn, as
  vLLM's multi-turn P/D proxy recipe does; it speaks the same keys.
A plain single server (`single-server`) runs the conversations first: its answers are the
expected outputs, its prompts (history = earlier prompts and its answers) are replayed verbatim
through every system, and its TTFT is what the P/D systems are compared with. Its turns are
streamed, so its client-side TTFT stands beside the streaming mode's.

Turns are lockstep: turn k of all conversations is sent at once, then, 2 s after the last
answer (users reading it), turn k+1. The pause also lets vLLM's processes end the 1 s
spin-wait that follows each step (its shm queue readers busy-wait with sched_yield): on 2
shared cores a P/D pair's idle-but-spinning server otherwise takes a core from the other's
compute, which on a real P/D pair runs on its own accelerator. So by default (`--pin`) each
server of a P/D pair is pinned (with its engine and worker processes) to its own half of the
CPUs, P to the first and D to the second, and computes on that half's threads: neither runs
on the other's core, as on a real pair. The single server runs on the whole machine (with an
even number of CPUs, as many as the pair together). vLLM's NixlConnector re-pins its CPU
worker to the last CPU of each NUMA node, whatever it inherited, so its P and D both compute
there. `--no-pin` lets P and D share every CPU, each on half as many threads. Per turn and
system: mean time to first token (P's TTFT + D's TTFT from their `/metrics` histograms; the
conversation-id mode is non-streaming because vLLM 0.32 returns `kv_transfer_params` only there;
the streamed runs, the single server's and the streaming mode's, also report the client-side
TTFT: request sent to first streamed token),
prompt tokens P computed, took from its prefix cache and pulled from D
(`vllm:prompt_tokens_by_source`), wall time, and how many answers equal the single server's
(tokens, logprobs within 1e-3).

The lookup's own cost, from P's `/metrics` read around every turn: lookups that hit, missed,
failed (per peer) or were skipped (`vllm:kvduplex_lookups_*_total`), and p50/p99 of
`vllm:kvduplex_lookup_seconds` on a miss and on a hit. The histogram does not split hits from
misses, so its bucket deltas are pooled per turn: a turn whose lookups all missed (turn 1, whose
nonce-prefixed prompt nobody holds) counts as misses, one whose lookups all hit (turns >= 2 when
P finds D's held turn) as hits, anything else as "mixed". The percentiles are bucket upper bounds
(buckets 0.5 ms .. 1 s), not exact values.

Targets: bidirectional computes only the new tokens on turns >= 2 (the new user message plus the
previous answer's last token, whose KV D never computed), and its mean TTFT on turns >= 2 is at
most 0.5x NixlConnector's.

Usage (repository root; at most 3 vLLM servers run at once):
    PYTHONPATH=python .venv/bin/python benches/multiturn.py [--quick] [--json OUT]
Exit status 1 when a kvduplex system's output differs from the single server's.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from _bench_common import format_table, ms
from kvduplex.demo import (
    LOGPROB_ATOL,
    MetricsSnapshot,
    ProxyThread,
    duplex_kv_transfer_config,
    read_metrics,
    read_metrics_after,
    user_turns,
)
from kvduplex.demo.servers import (
    WHOLE_MACHINE_ENV,
    Completion,
    ServerError,
    complete,
    describe_mismatch,
    with_nonce,
)
from kvduplex.demo.tiny_model import SERVER_ARGS, build_tiny_model
from kvduplex.protocol import METRIC_PREFIX
from kvduplex.proxy.config import CONVERSATION_HEADER
from kvduplex_testing.servers import (
    StreamedCompletion,
    VllmServer,
    complete_streamed,
    node_cpu_sets,
    start_many,
)
from nixl_pd_baseline import nixl_pd_envs

logger = logging.getLogger("multiturn")

RECOMPUTE_THRESHOLD = 64
NIXL_BIDIRECTIONAL_CONFIG = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_both",
    "kv_buffer_device": "cpu",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {
        "bidirectional_kv_xfer": True,
        "kv_recompute_threshold": RECOMPUTE_THRESHOLD,
    },
}
SINGLE_SERVER = "single-server"
BIDIRECTIONAL = "kvduplex-bidirectional"
STREAM = "kvduplex-bidirectional-stream"
ONE_WAY = "kvduplex-one-way"
NIXL = "nixl-bidirectional"
SYSTEMS = (BIDIRECTIONAL, STREAM, ONE_WAY, NIXL)
# The kvduplex systems, whose outputs must equal the single server's.
KVDUPLEX_SYSTEMS = (BIDIRECTIONAL, STREAM, ONE_WAY)
# Systems sent with "stream": true and no conversation id.
STREAMED_SYSTEMS = (STREAM,)
# DuplexConnector histograms as `MetricsSnapshot` names them (`vllm:kvduplex_<name>`): how long
# a lookup took, and what a request waited in P's scheduler for its lookup (or grant) answer,
# steps included.
LOOKUP = "lookup_seconds"
LOOKUP_WAIT = "lookup_wait_seconds"
LOOKUP_WAIT_HISTOGRAM = f"{METRIC_PREFIX}{LOOKUP_WAIT}"
LOOKUP_PERCENTILES_NOTE = (
    "lookup p50/p99 are upper bounds of vllm:kvduplex_lookup_seconds buckets (0.5 ms .. 1 s), "
    "pooled over turns whose lookups all missed (miss) or all hit (hit)"
)


THINK_S = 2.0
"""Seconds a user reads an answer before sending the next turn (here and in history_sweep)."""


@dataclass(frozen=True)
class Workload:
    conversations: int
    turns: int
    first_words: int
    user_words: int
    max_tokens: int
    # Seconds between a turn's answers and the next turn (module doc).
    think_s: float = THINK_S


FULL = Workload(conversations=4, turns=6, first_words=300, user_words=60, max_tokens=80)
QUICK = Workload(conversations=2, turns=3, first_words=150, user_words=40, max_tokens=80)


@dataclass(frozen=True)
class TurnStats:
    turn: int
    # Sums over the turn's conversations.
    prompt_tokens: int
    new_tokens: int
    prefill_computed_tokens: int
    prefill_cache_hit_tokens: int
    pulled_from_decode_tokens: int
    # Means over the turn's conversations (server-side).
    mean_ttft_s: float | None
    mean_prefill_ttft_s: float | None
    mean_decode_ttft_s: float | None
    wall_s: float
    matches: int
    mismatches: list[str]
    # Mean client-side time to first token (streamed systems only).
    mean_client_ttft_s: float | None = None
    # P's lookups during the turn (DuplexConnector counters; 0 elsewhere).
    lookups_hit: int = 0
    lookups_missed: int = 0
    lookup_failures: int = 0
    lookups_skipped: int = 0
    # Growth of P's lookup-time histogram during the turn: cumulative count per bucket upper
    # bound ("le" label, e.g. "0.001", "+Inf").
    lookup_buckets: dict[str, float] | None = None
    # The same for P's lookup-wait histogram (`LOOKUP_WAIT`).
    lookup_wait_buckets: dict[str, float] | None = None


def _le_key(le: str) -> float:
    return float("inf") if le in ("+Inf", "Inf", "inf") else float(le)


def bucket_quantile(buckets: dict[str, float], q: float) -> str | None:
    """The upper bound ("le") of the bucket holding quantile `q` of a cumulative histogram;
    None when it has no samples."""
    ordered = sorted(buckets.items(), key=lambda item: _le_key(item[0]))
    total = ordered[-1][1] if ordered else 0.0
    if total <= 0:
        return None
    rank = max(1.0, q * total)
    for le, count in ordered:
        if count >= rank - 1e-9:
            return le
    return ordered[-1][0]


def lookup_summary(stats: Sequence[TurnStats]) -> dict[str, Any]:
    """Lookup counts and p50/p99 (bucket upper bounds) on misses and hits over `stats`."""
    pools: dict[str, dict[str, float]] = {"miss": {}, "hit": {}, "mixed": {}}
    for t in stats:
        if not t.lookup_buckets:
            continue
        if t.lookups_missed and not t.lookups_hit:
            pool = pools["miss"]
        elif t.lookups_hit and not t.lookups_missed:
            pool = pools["hit"]
        else:
            pool = pools["mixed"]
        for le, count in t.lookup_buckets.items():
            pool[le] = pool.get(le, 0.0) + count
    summary: dict[str, Any] = {
        "hits": sum(t.lookups_hit for t in stats),
        "misses": sum(t.lookups_missed for t in stats),
        "failures": sum(t.lookup_failures for t in stats),
        "skipped": sum(t.lookups_skipped for t in stats),
        "hits_turn_1": sum(t.lookups_hit for t in stats if t.turn == 0),
        "misses_turns_2_plus": sum(t.lookups_missed for t in stats if t.turn >= 1),
    }
    for name, pool in pools.items():
        summary[f"on_{name}"] = {
            "samples": int(max(pool.values(), default=0.0)),
            "p50_le_s": bucket_quantile(pool, 0.5),
            "p99_le_s": bucket_quantile(pool, 0.99),
        }
    waits: dict[str, float] = {}
    for t in stats:
        for le, count in (t.lookup_wait_buckets or {}).items():
            waits[le] = waits.get(le, 0.0) + count
    summary["wait"] = {
        "samples": int(max(waits.values(), default=0.0)),
        "p50_le_s": bucket_quantile(waits, 0.5),
        "p99_le_s": bucket_quantile(waits, 0.99),
    }
    summary["note"] = LOOKUP_PERCENTILES_NOTE
    return summary


def _sum_or_none(first: float | None, second: float | None) -> float | None:
    return None if first is None or second is None else first + second


def run_turn(
    url: str,
    prompts: Sequence[list[int]],
    max_tokens: int,
    conversation_ids: Sequence[str] | None,
    streamed: bool = False,
) -> tuple[list[Completion], float]:
    """Send one turn of every conversation at once; return the answers and the wall time.

    `streamed`: each request with `"stream": true` (answers are `StreamedCompletion`s)."""

    def send(index: int) -> Completion:
        headers = (
            {CONVERSATION_HEADER: conversation_ids[index]} if conversation_ids is not None else None
        )
        if streamed:
            return complete_streamed(url, prompts[index], max_tokens, headers=headers)
        return complete(url, prompts[index], max_tokens, headers=headers)

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        answers = list(pool.map(send, range(len(prompts))))
    return answers, time.perf_counter() - started


def run_conversations(
    url: str,
    prefill_url: str,
    decode_url: str | None,
    messages: list[list[list[int]]],
    workload: Workload,
    *,
    conversation_prefix: str | None,
    expected: list[list[Completion]] | None,
    streamed: bool = False,
) -> tuple[list[TurnStats], list[list[Completion]]]:
    """Run all conversations turn by turn through `url`.

    With `expected` (the single server's answers), every prompt is the single server's history,
    so all systems see identical conversations; without, the history grows from the answers.
    `prefill_url` / `decode_url` are the servers whose /metrics count the turn (for a single
    server, `prefill_url` is that server and `decode_url` is None). `conversation_prefix` None
    sends no conversation-id header; `streamed` streams every answer.
    """
    n = workload.conversations
    conversation_ids = (
        [f"{conversation_prefix}-{c}" for c in range(n)] if conversation_prefix else None
    )
    histories: list[list[int]] = [[] for _ in range(n)]
    answers_by_turn: list[list[Completion]] = []
    stats = []
    for turn in range(workload.turns):
        if turn:
            time.sleep(workload.think_s)
        prompts = [histories[c] + messages[c][turn] for c in range(n)]
        prefill_before = read_metrics(prefill_url)
        decode_before = read_metrics(decode_url) if decode_url else None
        answers, wall_s = run_turn(
            url, prompts, workload.max_tokens, conversation_ids, streamed=streamed
        )
        prefill = read_metrics_after(prefill_url, prefill_before, n).minus(prefill_before)
        # A lookup is recorded before its request is scheduled, so before it finishes.
        lookup_buckets = prefill.buckets_of(LOOKUP)
        wait_buckets = prefill.buckets_of(LOOKUP_WAIT)
        client_ttfts = [
            a.ttft_s for a in answers if isinstance(a, StreamedCompletion) and a.ttft_s is not None
        ]
        decode: MetricsSnapshot | None = None
        if decode_url and decode_before is not None:
            decode = read_metrics_after(decode_url, decode_before, n).minus(decode_before)
        mismatches = []
        if expected is not None:
            for c in range(n):
                problem = describe_mismatch(
                    expected[turn][c], answers[c], logprob_atol=LOGPROB_ATOL
                )
                if problem is not None:
                    mismatches.append(f"conversation {c}: {problem}")
        decode_ttft = decode.mean_ttft_s if decode is not None else 0.0
        stats.append(
            TurnStats(
                turn=turn,
                prompt_tokens=sum(len(p) for p in prompts),
                new_tokens=sum(len(messages[c][turn]) for c in range(n)),
                prefill_computed_tokens=prefill.computed_tokens,
                prefill_cache_hit_tokens=prefill.cache_hit_tokens,
                pulled_from_decode_tokens=prefill.transferred_tokens,
                mean_ttft_s=_sum_or_none(prefill.mean_ttft_s, decode_ttft),
                mean_prefill_ttft_s=prefill.mean_ttft_s,
                mean_decode_ttft_s=decode.mean_ttft_s if decode is not None else None,
                wall_s=wall_s,
                matches=n - len(mismatches),
                mismatches=mismatches,
                mean_client_ttft_s=statistics.fmean(client_ttfts) if client_ttfts else None,
                lookups_hit=int(prefill.connector.get("lookups_hit", 0.0)),
                lookups_missed=int(prefill.connector.get("lookups_missed", 0.0)),
                lookup_failures=int(prefill.connector.get("lookup_failures", 0.0)),
                lookups_skipped=int(prefill.connector.get("lookups_skipped", 0.0)),
                lookup_buckets=lookup_buckets or None,
                lookup_wait_buckets=wait_buckets or None,
            )
        )
        logger.info("turn %d: %s", turn + 1, json.dumps(asdict(stats[-1])))
        reference_answers = expected[turn] if expected is not None else answers
        histories = [prompts[c] + reference_answers[c].token_ids for c in range(n)]
        answers_by_turn.append(answers)
    return stats, answers_by_turn


def warm_up(servers: Sequence[VllmServer]) -> None:
    """A fresh server's first request pays one-time costs; pay them outside the measurement."""
    for server in servers:
        complete(server.base_url, with_nonce("warm up"), max_tokens=2)


def warm_up_transfer_path(proxy_url: str, model_dir: Path, streamed: bool = False) -> None:
    """A two-turn conversation through the proxy: connects P->D and, where the second turn pulls,
    D->P, so no system's first measured turn includes a transfer-engine handshake. `streamed`:
    sent the way the streaming mode sends (streamed, no conversation id), so P's second turn
    also makes its first lookup on D."""
    messages = user_turns(model_dir, 2, first_words=100, user_words=20, seed=999)
    history: list[int] = []
    conversation_id = f"warm-up-{time.time_ns()}"
    for message in messages:
        prompt = history + message
        if streamed:
            answer: Completion = complete_streamed(proxy_url, prompt, 80)
        else:
            answer = complete(proxy_url, prompt, 80, headers={CONVERSATION_HEADER: conversation_id})
        history = prompt + answer.token_ids


def server_factory(model_dir: Path, log_dir: Path) -> Callable[..., VllmServer]:
    def make(
        name: str,
        kv_transfer_config: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        cpus: frozenset[int] | None = None,
    ) -> VllmServer:
        extra = list(SERVER_ARGS)
        if kv_transfer_config is not None:
            extra += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        return VllmServer(
            model_dir, name=name, extra_args=extra, env=env, log_dir=log_dir, cpus=cpus
        )

    return make


PdCpus = tuple[frozenset[int], frozenset[int]] | None
"""P's and D's CPUs when they are pinned (each a half of the machine), else None."""


def add_pin_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="P on the first half of the CPUs, D on the second (module doc); --no-pin lets "
        "them share every CPU",
    )


def pd_cpus(parser: argparse.ArgumentParser, pin: bool) -> PdCpus:
    """P's and D's CPUs for `--pin`; a machine that cannot be split is a usage error."""
    if not pin:
        return None
    try:
        prefill, decode = node_cpu_sets(2)
    except ValueError as exc:
        parser.error(f"{exc}: use --no-pin")
    return prefill, decode


def nixl_config(num_threads: int | None) -> dict[str, Any]:
    """NixlConnector's config; `num_threads` sets its UCX backend threads (vLLM's default: 4)."""
    config = json.loads(json.dumps(NIXL_BIDIRECTIONAL_CONFIG))
    if num_threads is not None:
        config["kv_connector_extra_config"]["num_threads"] = num_threads
    return config


def pd_servers(
    system: str,
    make: Callable[..., VllmServer],
    work_dir: Path,
    nixl_num_threads: int | None,
    cpus: PdCpus,
) -> tuple[VllmServer, VllmServer]:
    p_cpus, d_cpus = cpus or (None, None)
    if system in KVDUPLEX_SYSTEMS:
        config = duplex_kv_transfer_config(
            bidirectional=system != ONE_WAY, recompute_threshold=RECOMPUTE_THRESHOLD
        )
        return (
            make(f"{system}-prefill", config, cpus=p_cpus),
            make(f"{system}-decode", config, cpus=d_cpus),
        )
    prefill_env, decode_env = nixl_pd_envs(work_dir)
    return (
        make(f"{system}-prefill", nixl_config(nixl_num_threads), prefill_env, p_cpus),
        make(f"{system}-decode", nixl_config(nixl_num_threads), decode_env, d_cpus),
    )


def summarize(stats: list[TurnStats], conversations: int) -> dict[str, Any]:
    later = [t for t in stats if t.turn >= 1]
    ttfts = [t.mean_ttft_s for t in later if t.mean_ttft_s is not None]
    client_ttfts = [t.mean_client_ttft_s for t in later if t.mean_client_ttft_s is not None]
    return {
        "mean_ttft_s_turns_2_plus": statistics.fmean(ttfts) if ttfts else None,
        "mean_client_ttft_s_turns_2_plus": (
            statistics.fmean(client_ttfts) if client_ttfts else None
        ),
        "prefill_computed_tokens_turns_2_plus": sum(t.prefill_computed_tokens for t in later),
        "new_tokens_turns_2_plus": sum(t.new_tokens for t in later),
        "pulled_from_decode_tokens_turns_2_plus": sum(t.pulled_from_decode_tokens for t in later),
        # The new user message plus, per conversation, the previous answer's last token.
        "computes_only_new_tokens": all(
            t.prefill_computed_tokens <= t.new_tokens + conversations for t in later
        ),
        "total_s": sum(t.wall_s for t in stats),
        "all_match": all(not t.mismatches for t in stats),
        "lookup": lookup_summary(stats),
    }


def _fmt_le(le: str | None) -> str:
    if le is None:
        return "-"
    if _le_key(le) == float("inf"):
        return ">1000"
    return f"<={1e3 * float(le):g}"


def format_tables(report: dict[str, Any]) -> str:
    width = max([30, *(len(name) + 1 for name in report["systems"])])
    conversations = report["workload"]["conversations"]
    measured = {
        system: result for system, result in report["systems"].items() if "error" not in result
    }
    turn_rows: list[tuple[Any, ...]] = []
    for system, result in report["systems"].items():
        if "error" in result:
            turn_rows.append((system, f"failed: {result['error']}"))
            continue
        for t in result["turns"]:
            lookups = f"{t['lookups_hit']}/{t['lookups_missed']}/{t['lookup_failures']}"
            turn_rows.append((
                system, t["turn"] + 1, t["new_tokens"], t["prefill_computed_tokens"],
                t["prefill_cache_hit_tokens"], t["pulled_from_decode_tokens"],
                ms(t["mean_ttft_s"]), ms(t["mean_prefill_ttft_s"]), ms(t["mean_decode_ttft_s"]),
                ms(t["mean_client_ttft_s"]), lookups, f"{t['wall_s']:.1f}",
                f"{t['matches']}/{conversations}",
            ))
    summary_rows = []
    for system, result in measured.items():
        s = result["summary"]
        summary_rows.append((
            system, ms(s["mean_ttft_s_turns_2_plus"]), ms(s["mean_client_ttft_s_turns_2_plus"]),
            s["prefill_computed_tokens_turns_2_plus"], s["new_tokens_turns_2_plus"],
            s["pulled_from_decode_tokens_turns_2_plus"], f"{s['total_s']:.1f}",
            "equal" if s["all_match"] else "DIFFER",
        ))
    lookup_rows = []
    for system, result in measured.items():
        lookup = result["summary"]["lookup"]
        miss, hit = lookup["on_miss"], lookup["on_hit"]
        lookup_rows.append((
            system, lookup["hits"], lookup["misses"], lookup["failures"], lookup["skipped"],
            miss["samples"], _fmt_le(miss["p50_le_s"]), _fmt_le(miss["p99_le_s"]),
            hit["samples"], _fmt_le(hit["p50_le_s"]), _fmt_le(hit["p99_le_s"]),
            lookup["on_mixed"]["samples"],
        ))
    lines = [
        *format_table(
            [("system", width), ("turn", 5), ("new", 7), ("P computed", 12), ("P cache", 9),
             ("pulled", 8), ("TTFT ms", 9), ("P ms", 7), ("D ms", 7), ("client ms", 10),
             ("lookups hit/miss/fail", 22), ("wall s", 8), ("match", 7)],
            turn_rows,
        ),
        "",
        *format_table(
            [("system", width), ("TTFT ms t>=2", 13), ("client ms t>=2", 15),
             ("P computed t>=2", 16), ("new t>=2", 10), ("pulled t>=2", 12), ("total s", 9),
             ("outputs", 9)],
            summary_rows,
        ),
        "",
        *format_table(
            [("system", width), ("hits", 6), ("misses", 8), ("failed", 8), ("skipped", 9),
             ("miss n", 8), ("miss p50 ms", 13), ("miss p99 ms", 13), ("hit n", 7),
             ("hit p50 ms", 12), ("hit p99 ms", 12), ("mixed n", 9)],
            lookup_rows,
        ),
    ]
    lines.append(f"({LOOKUP_PERCENTILES_NOTE}; '<=x': the bucket's upper bound)")
    for system, result in report["systems"].items():
        wait = result.get("summary", {}).get("lookup", {}).get("wait")
        if wait and wait["samples"]:
            lines.append(
                f"{system}: requests waited for their lookup/grant answer p50 "
                f"{_fmt_le(wait['p50_le_s'])} ms, p99 {_fmt_le(wait['p99_le_s'])} ms "
                f"({wait['samples']} requests; {LOOKUP_WAIT_HISTOGRAM})"
            )
    lines.append("")
    for name, value in report["ratios"].items():
        lines.append(f"{name}: {'-' if value is None else f'{value:.2f}'}")
    for name, met in report["targets"].items():
        verdict = "not measured" if met is None else "met" if met else "NOT met"
        lines.append(f"target {name}: {verdict}")
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run(args: argparse.Namespace, work_dir: Path) -> dict[str, Any]:
    workload = QUICK if args.quick else FULL
    model_dir = build_tiny_model(args.model_dir or work_dir / "tiny-model")
    make = server_factory(model_dir, work_dir)
    messages = [
        user_turns(
            model_dir,
            workload.turns,
            first_words=workload.first_words,
            user_words=workload.user_words,
            seed=c,
        )
        for c in range(workload.conversations)
    ]
    report: dict[str, Any] = {
        "workload": asdict(workload),
        "recompute_threshold": RECOMPUTE_THRESHOLD,
        "nixl_num_threads": args.nixl_num_threads,
        "pinned": args.pin,
        "logs": str(work_dir),
        "systems": {},
    }

    logger.info("%s: computing the expected answers", SINGLE_SERVER)
    # The single server runs alone, on the whole machine; each server of a P/D pair gets half.
    with start_many([make(SINGLE_SERVER, env=WHOLE_MACHINE_ENV)]) as (single,):
        warm_up([single])
        stats, expected = run_conversations(
            single.base_url,
            single.base_url,
            None,
            messages,
            workload,
            conversation_prefix=None,
            expected=None,
            streamed=True,
        )
    report["systems"][SINGLE_SERVER] = {
        "turns": [asdict(t) for t in stats],
        "summary": summarize(stats, workload.conversations),
    }

    systems = [s for s in SYSTEMS if s not in args.skip]
    for system in systems:
        logger.info("%s: starting P and D", system)
        prefill, decode = pd_servers(system, make, work_dir, args.nixl_num_threads, args.cpus)
        try:
            with start_many([prefill, decode]):
                warm_up([prefill, decode])
                with ProxyThread([prefill.base_url], [decode.base_url]) as proxy:
                    streamed = system in STREAMED_SYSTEMS
                    warm_up_transfer_path(proxy.base_url, model_dir, streamed=streamed)
                    logger.info("%s: running %d conversations", system, workload.conversations)
                    stats, _ = run_conversations(
                        proxy.base_url,
                        prefill.base_url,
                        decode.base_url,
                        messages,
                        workload,
                        # The streaming mode sends no conversation id: the proxy routes by hash.
                        conversation_prefix=None if streamed else f"{system}-{time.time_ns()}",
                        expected=expected,
                        streamed=streamed,
                    )
        except (ServerError, httpx.HTTPError) as exc:
            # One system failing (e.g. a server stalled) must not lose the others' results.
            logger.error("%s failed: %s", system, exc)
            report["systems"][system] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        report["systems"][system] = {
            "turns": [asdict(t) for t in stats],
            "summary": summarize(stats, workload.conversations),
        }

    summaries = {
        name: result["summary"] for name, result in report["systems"].items() if "summary" in result
    }

    def ttft(name: str) -> float | None:
        return summaries[name]["mean_ttft_s_turns_2_plus"] if name in summaries else None

    def client_ttft(name: str) -> float | None:
        return summaries[name]["mean_client_ttft_s_turns_2_plus"] if name in summaries else None

    def computed(name: str) -> float | None:
        if name not in summaries:
            return None
        return summaries[name]["prefill_computed_tokens_turns_2_plus"]

    report["ratios"] = {
        "TTFT t>=2 bidirectional / single-server": _ratio(ttft(BIDIRECTIONAL), ttft(SINGLE_SERVER)),
        "TTFT t>=2 bidirectional-stream / single-server": _ratio(
            ttft(STREAM), ttft(SINGLE_SERVER)
        ),
        "client TTFT t>=2 bidirectional-stream / single-server": _ratio(
            client_ttft(STREAM), client_ttft(SINGLE_SERVER)
        ),
        "TTFT t>=2 bidirectional / nixl": _ratio(ttft(BIDIRECTIONAL), ttft(NIXL)),
        "TTFT t>=2 bidirectional-stream / nixl": _ratio(ttft(STREAM), ttft(NIXL)),
        "TTFT t>=2 bidirectional-stream / bidirectional": _ratio(
            ttft(STREAM), ttft(BIDIRECTIONAL)
        ),
        "TTFT t>=2 bidirectional / one-way": _ratio(ttft(BIDIRECTIONAL), ttft(ONE_WAY)),
        "P computed t>=2 bidirectional / nixl": _ratio(computed(BIDIRECTIONAL), computed(NIXL)),
        "P computed t>=2 bidirectional / one-way": _ratio(
            computed(BIDIRECTIONAL), computed(ONE_WAY)
        ),
        "P computed t>=2 bidirectional-stream / one-way": _ratio(
            computed(STREAM), computed(ONE_WAY)
        ),
    }
    bidirectional_ratio = report["ratios"]["TTFT t>=2 bidirectional / nixl"]
    # None: not measured (a system was skipped or failed).
    report["targets"] = {
        "bidirectional computes only new tokens on turns >= 2": (
            summaries[BIDIRECTIONAL]["computes_only_new_tokens"]
            if BIDIRECTIONAL in summaries
            else None
        ),
        "bidirectional-stream computes only new tokens on turns >= 2": (
            summaries[STREAM]["computes_only_new_tokens"] if STREAM in summaries else None
        ),
        "bidirectional TTFT t>=2 <= 0.5x nixl": (
            bidirectional_ratio <= 0.5 if bidirectional_ratio is not None else None
        ),
    }
    report["ok"] = all(
        name in summaries and summaries[name]["all_match"]
        for name in KVDUPLEX_SYSTEMS
        if name in systems
    )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK.conversations} conversations of {QUICK.turns} turns instead of "
        f"{FULL.conversations} of {FULL.turns}",
    )
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--model-dir", type=Path, help="tiny model directory (built if missing)")
    parser.add_argument("--work-dir", type=Path, help="server logs (default: a new temp dir)")
    parser.add_argument(
        "--skip", action="append", default=[], choices=SYSTEMS, help="leave a system out"
    )
    add_pin_argument(parser)
    parser.add_argument(
        "--nixl-num-threads",
        type=int,
        help="NixlConnector's `num_threads` (UCX backend threads; vLLM's default is 4, which "
        "busy-poll on a small CPU)",
    )
    args = parser.parse_args()
    args.cpus = pd_cpus(parser, args.pin)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="kvduplex-multiturn-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    report = run(args, work_dir)
    print(format_tables(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
