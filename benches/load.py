"""P/D under sustained multi-turn load: many streamed chats at once, a KV cache too small for
every history, the same conversations through three systems side by side.

Systems, one after another in one run (each started fresh):
- `ideal`: one plain vLLM server with prefix caching on the CPUs of both P/D nodes and a KV cache
  of both nodes' blocks (the same total compute and memory as the pair); the client talks to it
  directly. Its answers are the expected ones. One engine may not use twice the CPUs as well
  as two engines do (measured on 2 shared cores with the tiny model: it saturated at half the
  pair's goodput), so `--ideal-servers 2` makes it two such servers instead, one on each P/D
  node's CPUs with that node's blocks, each chat staying on one (chat c on server c % 2).
- `kvduplex-bidirectional`: a prefill (P) and a decode (D) server with DuplexConnector
  (`bidirectional_kv_xfer: true`) behind the kvduplex proxy: P finds a conversation's history
  held on D by the prompt itself and pulls it back.
- `kvduplex-one-way`: the same with P->D only; P recomputes what its own prefix cache lacks.
  Its D keeps no turns, so its proxy sends every turn through P.
With `--vllm-router POLICY` the two P/D systems are 2 P x 2 D each behind vLLM's own router
(`vllm-router --vllm-pd-disaggregation --policy POLICY`) instead of the proxy, one-way first,
whose answers are then the expected ones (no ideal runs; `_load_router.py`).

Workload (`Workload`): `conversations` chats (N, up to 64) per point of a sweep over arrival
rates. Chats start as a Poisson process at `rate` per second; each runs `turns` turns, with an
exponential think time (mean `think_s`) between an answer and the next turn. Every turn is a
streamed `/v1/chat/completions` request (temperature 0, `min_tokens` = `max_tokens`, so every
answer is exactly `answer_tokens` long) whose messages are the user messages so far and the
answers as the system streamed them back: real generated answers fed back, tokenized again by
the server (the tiny chat model's word-level tokenizer round-trips, see
`kvduplex_testing.tiny_model.build_tiny_chat_model`). No conversation id: the proxy routes each chat to
a D by hashing its start, as a chat UI would be served. Start times, think times and messages
come from fixed seeds, so every system gets the same conversations at the same moments.

KV cache: `--num-gpu-blocks-override` on every server, computed from the workload (`kv_plan`):
P's and D's caches each hold about a third of the histories of N live chats (a history
averaged over its turns); the ideal gets both (two thirds). The plan is printed and written
to the JSON. At low rates fewer chats are live at once, so the pressure grows with the load.

Placement (`--pin`, the default, as in benches/multiturn.py): P on the first half of the CPUs,
D on the second, the ideal on both; the proxy and the client run anywhere. The client is a
process of its own (asyncio, httpx streaming), the proxy a thread of this process, which
waits while a point runs.

Per system and rate: goodput (answer tokens of completed requests per second of the point,
from its first request to its last answer), client-side time to first token p50/p90/p99 on
turns >= 2 (and p50 on turn 1), preemptions (`vllm:num_preemptions`, all servers), finished
turns held for lookups (`vllm:kvduplex_turns_offered`) and evicted (`vllm:kvduplex_evictions*`;
every DuplexConnector counter that moved is in the JSON), D->P lookup hits and pulled tokens (P's
`vllm:kvduplex_lookups_hit` and prompt tokens from `external_kv_transfer`), P->D pulled tokens,
how long requests waited in P's scheduler for their lookup answers (p50/p99, bucket upper
bounds of `vllm:kvduplex_lookup_wait_seconds`), connector faults (failed transfers, fallbacks,
refused grants, failed lookups), the CPU seconds each server's processes used, client errors,
and answers that differ from the ideal's. Answers are compared per turn when the prompt's token
ids equal the ideal's (tokens equal and logprobs within `LOGPROB_ATOL`, as the other benches
do); after a conversation's first difference its later turns have other prompts and are
counted as `diverged`, not compared. Greedy answers of a random-weight model can change with
the batch they were computed in (other summation order), so a difference under load is
reported, not hidden; its position and size are in the JSON.

`--connector-config KEY=JSON` (repeatable) sets a DuplexConnector option on the P/D servers
(e.g. `layerwise_load=true`, `decode_kv_hold_max_fraction=0.5`), to measure a setting side by
side with the ideal.

Output: a table per system and rate, `--json OUT` (everything), `--png OUT` (TTFT p50/p99 on
turns >= 2 and goodput against offered load; needs matplotlib: `pip install matplotlib`).
Usage (repository root):
    PYTHONPATH=python .venv/bin/python benches/load.py --quick --json OUT --png OUT
`--quick` finishes in about 6 minutes, the default workload in about 15, on 2 cores.
`--replot JSON [--png OUT]` prints a kept report's table and redraws its plot (no servers).
Exit status 1 when a system failed, a client request failed or an answer differs.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import logging
import math
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from _load_report import BIDIRECTIONAL, IDEAL, SYSTEMS, format_report, plot, ratios
from _load_router import (
    FLEET_PAIRS,
    ROUTER_POLICIES,
    ROUTER_SYSTEMS,
    per_server,
    read_fleet_after,
)
from kvduplex.demo import (
    LOGPROB_ATOL,
    MetricsSnapshot,
    ProxyThread,
    duplex_kv_transfer_config,
    read_metrics,
    read_metrics_after,
)
from kvduplex.demo.servers import WHOLE_MACHINE_ENV, Completion, ServerError, describe_mismatch
from kvduplex.demo.tiny_model import SERVED_MODEL_NAME, SERVER_ARGS
from kvduplex_testing.router import VllmRouter
from kvduplex_testing.servers import VllmServer, async_sse_events, server_cpu_seconds, start_many
from kvduplex_testing.tiny_model import (
    CHAT_ALLOWED_TOKEN_IDS,
    build_tiny_chat_model,
    sample_chat_text,
)
from multiturn import (
    LOOKUP_WAIT,
    RECOMPUTE_THRESHOLD,
    PdCpus,
    add_pin_argument,
    bucket_quantile,
    pd_cpus,
)

logger = logging.getLogger("load")

MAX_CONVERSATIONS = 64
# vLLM's KV block on the CPU backend (tokens).
BLOCK_TOKENS = 128
# Tokens the chat template adds: "<s>" and "user:" before the first message, "assistant:" after
# every user message, "user:" before every later one (the role markers are single words).
FIRST_TURN_TEMPLATE_TOKENS = 3
LATER_TURN_TEMPLATE_TOKENS = 2
REQUEST_TIMEOUT_S = 300.0
# Fraction of N live chats' histories one P/D server's cache holds (issue 20).
CACHE_SHARE = 1 / 3
PAUSE_BETWEEN_POINTS_S = 3.0


@dataclass(frozen=True)
class Workload:
    conversations: int
    turns: int
    first_words: int
    user_words: int
    answer_tokens: int
    # Mean think time between an answer and the next turn (exponential).
    think_s: float
    # Chat arrival rates of the sweep (chats per second).
    rates: tuple[float, ...]


# Histories of 4 to 7 blocks: a node's cache holds a turn several times over, so a decode node
# can keep some finished turns next to its running requests. Sized for 2 shared cores, where
# one server decodes about 100 tokens/s: the lowest rate offers about a third of that, the
# highest about 2.5 times.
FULL = Workload(
    conversations=24, turns=4, first_words=400, user_words=80, answer_tokens=32, think_s=2.0,
    rates=(0.25, 0.5, 1.0, 2.0),
)
# The two-turn chat that warms every server and the transfer path up (`warm_up_chat`); its
# answers are longer than the recompute threshold, so its second turn pulls through the proxy.
WARM_UP = Workload(
    conversations=1, turns=2, first_words=60, user_words=10,
    answer_tokens=RECOMPUTE_THRESHOLD + 16, think_s=0.5, rates=(1.0,),
)
QUICK = Workload(
    conversations=16, turns=3, first_words=200, user_words=40, answer_tokens=32, think_s=1.0,
    rates=(2.0, 8.0),
)


# --- the KV cache plan ---------------------------------------------------------------------


def history_tokens(workload: Workload, turn: int) -> int:
    """Tokens of a chat's prompt and answer after turn `turn` (0-based)."""
    prompt = workload.first_words + FIRST_TURN_TEMPLATE_TOKENS + turn * (
        workload.answer_tokens + workload.user_words + LATER_TURN_TEMPLATE_TOKENS
    )
    return prompt + workload.answer_tokens


def kv_plan(workload: Workload, ideal_servers: int = 1) -> dict[str, Any]:
    """Blocks of each P/D server (a third of N live chats' mean history), of each ideal server
    (the pair's blocks shared among `ideal_servers`), and the max model length every server
    gets (the longest request, rounded up to a block)."""
    histories = [history_tokens(workload, t) for t in range(workload.turns)]
    mean_history = statistics.fmean(histories)
    live_blocks = workload.conversations * mean_history / BLOCK_TOKENS
    longest = max(histories[-1], history_tokens(WARM_UP, WARM_UP.turns - 1))
    max_model_len = math.ceil(longest / BLOCK_TOKENS) * BLOCK_TOKENS
    # vLLM refuses to start unless one request of max_model_len fits (and keeps a null block).
    node_blocks = max(math.ceil(live_blocks * CACHE_SHARE), max_model_len // BLOCK_TOKENS + 2)
    return {
        "block_tokens": BLOCK_TOKENS,
        "mean_history_tokens": round(mean_history, 1),
        "longest_request_tokens": histories[-1],
        "live_history_blocks": round(live_blocks, 1),
        "node_blocks": node_blocks,
        "ideal_servers": ideal_servers,
        "ideal_blocks": 2 * node_blocks // ideal_servers,
        "node_share_of_live_histories": round(node_blocks / live_blocks, 3),
        "max_model_len": max_model_len,
    }


# --- conversations and the client ----------------------------------------------------------


@dataclass(frozen=True)
class PointPlan:
    """Who says what when, at one rate: the same for every system."""

    rate: float
    answer_tokens: int
    starts_s: list[float]
    # Per chat: its user messages, and the think time after each answer but the last.
    messages: list[list[str]]
    thinks_s: list[list[float]]


def point_plan(workload: Workload, rate: float, index: int) -> PointPlan:
    rng = random.Random(f"load-{index}-{rate}")
    starts, clock = [], 0.0
    for _ in range(workload.conversations):
        starts.append(clock)
        clock += rng.expovariate(rate)
    messages = [
        [
            sample_chat_text(
                workload.first_words if turn == 0 else workload.user_words,
                seed=(index * MAX_CONVERSATIONS + c) * 100 + turn,
            )
            for turn in range(workload.turns)
        ]
        for c in range(workload.conversations)
    ]
    thinks = [
        [rng.expovariate(1 / workload.think_s) for _ in range(workload.turns - 1)]
        for _ in range(workload.conversations)
    ]
    return PointPlan(rate, workload.answer_tokens, starts, messages, thinks)


@dataclass
class TurnRecord:
    conversation: int
    turn: int
    sent_s: float  # since the point's start
    ttft_s: float | None = None
    done_s: float | None = None
    text: str = ""
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    error: str | None = None


def chat_body(messages: list[dict[str, str]], answer_tokens: int, model: str = SERVED_MODEL_NAME,
              stream: bool = True) -> dict[str, Any]:
    """A greedy chat turn with the tiny chat models' allowed ids (`tiny_model`), token ids and
    logprobs; `min_tokens` keeps eos out, so every answer is `answer_tokens` long."""
    return {
        "model": model,
        "messages": messages,
        "stream": stream,
        "max_tokens": answer_tokens,
        "min_tokens": answer_tokens,
        "temperature": 0,
        "seed": 0,
        "logprobs": True,
        "allowed_token_ids": list(CHAT_ALLOWED_TOKEN_IDS),
        "return_token_ids": True,
    }


async def stream_answer(
    client: httpx.AsyncClient, endpoint: str, body: dict[str, Any], record: TurnRecord,
    started: float, into: tuple[list[str], list[int], list[float]],
) -> None:
    """Streams the answer to `body` into `into` (text pieces, token ids, logprobs), and the
    prompt's ids and the client-side TTFT (from `started`) into `record`."""
    text, token_ids, logprobs = into
    async with client.stream("POST", endpoint, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise ServerError(f"answered {response.status_code}: {response.text[:300]}")
        async for event in async_sse_events(response.aiter_lines(), endpoint):
            if event.get("prompt_token_ids"):
                record.prompt_token_ids = list(event["prompt_token_ids"])
            for choice in event.get("choices") or []:
                ids = choice.get("token_ids") or []
                content = (choice.get("delta") or {}).get("content") or ""
                if record.ttft_s is None and (ids or content):
                    record.ttft_s = time.perf_counter() - started
                text.append(content)
                token_ids.extend(ids)
                entries = (choice.get("logprobs") or {}).get("content") or []
                logprobs.extend(float(entry["logprob"]) for entry in entries)


async def chat_turn(
    client: httpx.AsyncClient, url: str, messages: list[dict[str, str]], record: TurnRecord,
    answer_tokens: int, origin: float,
) -> None:
    """Stream one turn into `record` (its time to first token on the client, text, ids and
    logprobs); a failure is recorded as its `error`."""
    text: list[str] = []
    token_ids: list[int] = []
    logprobs: list[float] = []
    started = time.perf_counter()
    record.sent_s = started - origin
    try:
        await stream_answer(client, f"{url}/v1/chat/completions", chat_body(messages, answer_tokens),
                            record, started, (text, token_ids, logprobs))
        if len(token_ids) != answer_tokens:
            raise ServerError(f"{len(token_ids)} tokens instead of {answer_tokens}")
    except (httpx.HTTPError, ServerError, ValueError, KeyError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:400]
    record.done_s = time.perf_counter() - origin
    record.text = "".join(text)
    record.token_ids, record.logprobs = token_ids, logprobs


async def _conversation(
    client: httpx.AsyncClient, url: str, plan: PointPlan, c: int, origin: float,
    records: list[TurnRecord],
) -> None:
    """Chat `c` of `plan`, turn by turn, against `url`."""
    await asyncio.sleep(max(0.0, origin + plan.starts_s[c] - time.perf_counter()))
    messages: list[dict[str, str]] = []
    for turn, message in enumerate(plan.messages[c]):
        messages.append({"role": "user", "content": message})
        record = TurnRecord(c, turn, 0.0)
        records.append(record)
        await chat_turn(client, url, messages, record, plan.answer_tokens, origin)
        if record.error is not None:
            return  # the chat cannot go on without its answer
        messages.append({"role": "assistant", "content": record.text})
        if turn < len(plan.thinks_s[c]):
            await asyncio.sleep(plan.thinks_s[c][turn])


async def _run_point(urls: list[str], plan: PointPlan) -> list[TurnRecord]:
    records: list[TurnRecord] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=MAX_CONVERSATIONS)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        origin = time.perf_counter()
        await asyncio.gather(
            *(_conversation(client, urls[c % len(urls)], plan, c, origin, records)
              for c in range(len(plan.starts_s)))
        )
    return sorted(records, key=lambda r: (r.conversation, r.turn))


def run_point(urls: list[str], plan: PointPlan) -> list[TurnRecord]:
    """Every chat of `plan`, chat c against `urls[c % len(urls)]` (runs in the client
    process)."""
    return asyncio.run(_run_point(urls, plan))


def warm_up_chat(url: str, seed: int) -> None:
    """A two-turn chat of its own (`seed`): a fresh server's first requests pay one-time costs,
    and through the proxy it connects P->D and D->P (P's second turn finds turn 1 on D and
    pulls its answer, longer than the recompute threshold)."""
    plan = PointPlan(
        rate=1.0, answer_tokens=WARM_UP.answer_tokens, starts_s=[0.0],
        messages=[[sample_chat_text(WARM_UP.first_words, seed=-2 * seed),
                   sample_chat_text(WARM_UP.user_words, seed=-2 * seed - 1)]],
        thinks_s=[[WARM_UP.think_s]],
    )
    for record in run_point([url], plan):
        if record.error is not None:
            raise ServerError(f"warm-up chat on {url} failed: {record.error}")


# --- servers and metrics -------------------------------------------------------------------


def server_args(plan: dict[str, Any], blocks: int) -> list[str]:
    return [
        *SERVER_ARGS,
        "--max-model-len", str(plan["max_model_len"]),
        "--num-gpu-blocks-override", str(blocks),
        "--enable-prefix-caching",
    ]


def make_servers(
    system: str, model_dir: Path, plan: dict[str, Any], cpus: PdCpus, log_dir: Path,
    connector_config: dict[str, Any], fleet: bool = False,
) -> dict[str, VllmServer]:
    """The system's servers by role ("server", "server0" and "server1", or "P" and "D"; with
    `fleet`, "P0", "P1", "D0" and "D1", the P's on P's CPUs and the D's on D's);
    `connector_config` goes into the P/D servers' `kv_connector_extra_config`."""
    p_cpus, d_cpus = cpus or (None, None)
    if system == IDEAL:
        args = server_args(plan, plan["ideal_blocks"])
        if plan["ideal_servers"] == 2:  # one on each P/D node's CPUs
            return {
                f"server{i}": VllmServer(model_dir, name=f"{system}{i}", extra_args=args,
                                         log_dir=log_dir, cpus=node)
                for i, node in enumerate((p_cpus, d_cpus))
            }
        both = p_cpus | d_cpus if cpus else None
        env = None if cpus else WHOLE_MACHINE_ENV  # unpinned: servers default to half
        return {"server": VllmServer(model_dir, name=system, extra_args=args, env=env,
                                     log_dir=log_dir, cpus=both)}
    config = duplex_kv_transfer_config(
        bidirectional=system == BIDIRECTIONAL, recompute_threshold=RECOMPUTE_THRESHOLD
    )
    config["kv_connector_extra_config"].update(connector_config)
    args = [*server_args(plan, plan["node_blocks"]), "--kv-transfer-config", json.dumps(config)]
    suffixes = [str(i) for i in range(FLEET_PAIRS)] if fleet else [""]
    return {
        f"{role}{suffix}": VllmServer(model_dir, name=f"{system}-{name}{suffix}", extra_args=args,
                                      log_dir=log_dir, cpus=node)
        for role, name, node in (("P", "prefill", p_cpus), ("D", "decode", d_cpus))
        for suffix in suffixes
    }


def read_all(servers: dict[str, VllmServer]) -> dict[str, MetricsSnapshot]:
    return {role: read_metrics(s.base_url) for role, s in servers.items()}


def read_all_after(
    servers: dict[str, VllmServer], before: dict[str, MetricsSnapshot], finished: dict[str, int]
) -> dict[str, MetricsSnapshot]:
    """Readings once every server counted its `finished` requests of the point, minus
    `before`."""
    return {
        role: read_metrics_after(s.base_url, before[role], finished[role]).minus(before[role])
        for role, s in servers.items()
    }


FAULTS = ("failed_transfers", "fallbacks", "grants_refused", "lookup_failures")


def _bound(reading: MetricsSnapshot | None, q: float) -> float | None:
    le = bucket_quantile(reading.buckets_of(LOOKUP_WAIT), q) if reading is not None else None
    return None if le is None else float(le)


def server_counts(deltas: dict[str, MetricsSnapshot]) -> dict[str, Any]:
    def connector(key_start: str) -> int:
        return int(sum(v for r in deltas.values() for k, v in r.connector.items()
                       if k.startswith(key_start)))

    p = deltas.get("P")
    d = deltas.get("D")
    computing = [r for role, r in deltas.items() if role != "D"]
    return {
        "preemptions": int(sum(r.preemptions for r in deltas.values())),
        "evictions": connector("evictions") if p else None,
        "d_to_p_hits": int(p.connector.get("lookups_hit", 0)) if p else None,
        "d_to_p_tokens": p.transferred_tokens if p else None,
        "p_to_d_tokens": d.transferred_tokens if d else None,
        # Mean time to first token inside the engines that prefill (P, the ideal's servers):
        # arrival in the engine to first token, every turn; the client's TTFT adds the front
        # ends (and the proxy).
        "engine_ttft_mean_s": (
            sum(m.ttft_sum_s for m in computing) / count
            if (count := sum(m.ttft_count for m in computing)) else None
        ),
        "lookup_wait_mean_s": p.mean_of(LOOKUP_WAIT) if p else None,
        "prefill_computed_tokens": sum(m.computed_tokens for m in computing),
        "prefill_cache_hit_tokens": sum(m.cache_hit_tokens for m in computing),
        "connector_faults": {k: connector(k) for k in FAULTS} if p else None,
        "turns_held": connector("turns_offered") if p else None,
        # Bucket upper bounds of P's `vllm:kvduplex_lookup_wait_seconds` over the point.
        "lookup_wait_p50_s": _bound(p, 0.5),
        "lookup_wait_p99_s": _bound(p, 0.99),
        # Every DuplexConnector counter that moved, by server role.
        "connector": {
            role: {k: int(v) for k, v in r.connector.items() if v}
            for role, r in deltas.items() if r.connector
        },
    }


# --- one system ----------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None without values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summarize_point(records: list[TurnRecord], plan: PointPlan, turns: int) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    later = [r.ttft_s for r in ok if r.turn >= 1 and r.ttft_s is not None]
    first = [r.ttft_s for r in ok if r.turn == 0 and r.ttft_s is not None]
    span = (max((r.done_s or 0.0) for r in records) - min(r.sent_s for r in records)
            if records else 0.0)
    tokens = sum(len(r.token_ids or ()) for r in ok)
    return {
        "rate": plan.rate,
        "offered_requests_per_s": plan.rate * turns,
        "requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "error_samples": sorted({r.error for r in records if r.error})[:5],
        "not_sent": len(plan.starts_s) * turns - len(records),
        "span_s": round(span, 3),
        "goodput_tokens_per_s": round(tokens / span, 1) if span else None,
        "ttft_p50_s_turns_2_plus": percentile(later, 0.5),
        "ttft_p90_s_turns_2_plus": percentile(later, 0.9),
        "ttft_p99_s_turns_2_plus": percentile(later, 0.99),
        "ttft_mean_s_turns_2_plus": statistics.fmean(later) if later else None,
        "ttft_p50_s_turn_1": percentile(first, 0.5),
    }


def compare(records: list[TurnRecord], expected: dict[tuple[int, int], TurnRecord]) -> dict:
    """Each answer against the ideal's for the same chat and turn (module doc)."""
    matched, diverged, no_reference, mismatches = 0, 0, 0, []
    broken: set[int] = set()

    def completion(r: TurnRecord) -> Completion:
        return Completion(r.text, r.token_ids or [], r.prompt_token_ids or [], r.logprobs or [],
                          [], None, None, 0.0)

    for r in records:
        if r.error is not None:
            continue
        want = expected.get((r.conversation, r.turn))
        if r.conversation in broken:
            diverged += 1
        elif want is None or want.error is not None:
            no_reference += 1
        elif (problem := describe_mismatch(completion(want), completion(r), LOGPROB_ATOL)) is None:
            matched += 1
        else:
            broken.add(r.conversation)
            mismatches.append(f"chat {r.conversation} turn {r.turn + 1}: {problem}")
    return {"matched": matched, "mismatched": len(mismatches), "diverged": diverged,
            "no_reference": no_reference, "mismatches": mismatches[:20]}


def run_system(
    system: str, args: argparse.Namespace, plans: list[PointPlan], plan: dict[str, Any],
    client: concurrent.futures.Executor, expected: dict[float, dict] | None,
) -> tuple[list[dict[str, Any]], dict[float, dict]]:
    """All points on one fresh set of servers. Returns each point's summary and its records
    by rate and (chat, turn)."""
    fleet = args.vllm_router is not None and system != IDEAL
    servers = make_servers(
        system, args.model_dir, plan, args.cpus, args.work_dir, args.connector_config, fleet
    )
    points, answers = [], {}
    with start_many(list(servers.values())):
        for seed, server in enumerate(servers.values(), start=1):
            client.submit(warm_up_chat, server.base_url, seed).result()
        prefills = [s.base_url for role, s in servers.items() if role.startswith("P")]
        decodes = [s.base_url for role, s in servers.items() if role.startswith("D")]
        if fleet:
            proxy: ProxyThread | VllmRouter | None = VllmRouter(
                prefills, decodes, args.vllm_router, args.work_dir, name=f"{system}-router"
            )
        elif prefills:
            proxy = ProxyThread(prefills, decodes)
        else:
            proxy = None
        with proxy or contextlib.nullcontext():
            # Through the proxy or router, or chat c straight to ideal server c % (ideal servers).
            urls = [proxy.base_url] if proxy else [s.base_url for s in servers.values()]
            if proxy:
                # Through a router, a warm-up chat per pair (seeds no server's warm-up uses):
                # round_robin sends the second turn of each to the other P and D.
                for seed in (0, len(servers) + 1)[: FLEET_PAIRS if fleet else 1]:
                    client.submit(warm_up_chat, proxy.base_url, seed).result()
            for point in plans:
                time.sleep(PAUSE_BETWEEN_POINTS_S)  # let the servers' spin-waits end
                before = read_all(servers)
                cpu_before = {role: server_cpu_seconds(s.pid) for role, s in servers.items()}
                cpu_since = time.monotonic()
                records = client.submit(run_point, urls, point).result()
                completed = [r.conversation % len(urls) for r in records if r.error is None]
                if fleet:  # the router chose each turn's P and D
                    deltas, each = read_fleet_after(servers, before, len(completed))
                else:
                    finished = {
                        role: completed.count(i) if not proxy else len(completed)
                        for i, role in enumerate(servers)
                    }
                    deltas = read_all_after(servers, before, finished)
                summary = {**summarize_point(records, point, args.workload.turns),
                           **server_counts(deltas)}
                if fleet:
                    summary["servers"] = per_server(each)
                # CPU seconds each server's processes used from the point's start until its
                # metrics were read (`server_cpu_window_s`).
                summary["server_cpu_s"] = {
                    role: round(server_cpu_seconds(s.pid) - cpu_before[role], 2)
                    for role, s in servers.items()
                }
                summary["server_cpu_window_s"] = round(time.monotonic() - cpu_since, 2)
                if expected is not None:
                    summary["answers"] = compare(records, expected[point.rate])
                answers[point.rate] = {(r.conversation, r.turn): r for r in records}
                logger.info("%s at %.2f chats/s: %s", system, point.rate, json.dumps(summary))
                points.append(summary)
    return points, answers


# --- main ----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    workload: Workload = args.workload
    plan = kv_plan(workload, args.ideal_servers)
    logger.info("KV cache plan: %s", json.dumps(plan))
    print(
        f"KV cache: {plan['node_blocks']} blocks of {BLOCK_TOKENS} tokens per P/D server "
        f"({plan['node_share_of_live_histories']:.2f} of {workload.conversations} live chats' "
        f"histories of {plan['mean_history_tokens']:.0f} tokens on average), "
        f"{plan['ideal_blocks']} for each of {plan['ideal_servers']} ideal server(s); "
        f"--max-model-len {plan['max_model_len']}",
        flush=True,
    )
    plans = [point_plan(workload, rate, i) for i, rate in enumerate(workload.rates)]
    systems = ROUTER_SYSTEMS if args.vllm_router else SYSTEMS
    report: dict[str, Any] = {
        "front": (
            f"vllm-router --policy {args.vllm_router}, {FLEET_PAIRS} P x {FLEET_PAIRS} D"
            if args.vllm_router else "kvduplex proxy, 1 P x 1 D"
        ),
        "workload": asdict(workload),
        "kv_plan": plan,
        "recompute_threshold": RECOMPUTE_THRESHOLD,
        "logprob_atol": LOGPROB_ATOL,
        "pinned": args.pin,
        "connector_config": args.connector_config,
        "logs": str(args.work_dir),
        "systems": {},
    }
    expected: dict[float, dict] | None = None
    # The client runs in a process of its own; spawned, since this one has threads.
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context("spawn")
    ) as client:
        for system in systems:
            if system in args.skip:
                continue
            logger.info("%s: starting", system)
            started = time.monotonic()
            try:
                points, answers = run_system(system, args, plans, plan, client, expected)
            except (ServerError, httpx.HTTPError) as exc:
                logger.error("%s failed: %s", system, exc)
                report["systems"][system] = {"error": f"{type(exc).__name__}: {exc}"}
                if system == systems[0]:
                    break  # nothing to compare with
                continue
            report["systems"][system] = {
                "points": points, "wall_s": round(time.monotonic() - started, 1)
            }
            if system == systems[0]:  # the ideal's answers, or one-way's behind a router
                expected = answers
    report["ratios"] = ratios(report["systems"])
    report["ok"] = all(
        "error" not in result
        and all(p["errors"] == 0 and p.get("answers", {}).get("mismatched", 0) == 0
                for p in result["points"])
        for result in report["systems"].values()
    )
    return report


def _rates(text: str) -> tuple[float, ...]:
    rates = tuple(float(x) for x in text.split(","))
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be positive, got {text}")
    return rates


def connector_options(parser: argparse.ArgumentParser, items: list[str]) -> dict[str, Any]:
    """`--connector-config KEY=JSON` items as DuplexConnector options (load.py, load_long.py)."""
    try:
        return {key: json.loads(value) for key, _, value in (i.partition("=") for i in items)}
    except ValueError as exc:
        parser.error(f"--connector-config takes KEY=JSON: {exc}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"the quick workload ({QUICK}) instead of {FULL}")
    parser.add_argument("--conversations", type=int,
                        help=f"chats per point (N, 1..{MAX_CONVERSATIONS})")
    parser.add_argument("--rates", type=_rates, help="chat arrival rates per second, e.g. 1,2,4")
    parser.add_argument("--turns", type=int, help="turns per chat")
    parser.add_argument("--think", type=float, help="mean think time between turns (s)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--png", type=Path, help="TTFT and goodput against offered load")
    parser.add_argument("--replot", type=Path, metavar="JSON",
                        help="no run: print a kept report's table, and plot it with --png")
    parser.add_argument("--model-dir", type=Path, help="tiny chat model directory (built if missing)")
    parser.add_argument("--work-dir", type=Path, help="server logs (default: a new temp dir)")
    parser.add_argument("--skip", action="append", default=[], choices=SYSTEMS[1:],
                        help="leave a P/D system out")
    parser.add_argument(
        "--ideal-servers", type=int, choices=(1, 2), default=1,
        help="1: the ideal is one server on both nodes' CPUs with both nodes' blocks; 2: two "
        "servers, one on each node's CPUs with its blocks, chat c on server c %% 2 (module doc)",
    )
    parser.add_argument(
        "--vllm-router", choices=ROUTER_POLICIES, metavar="POLICY",
        help="the P/D systems as 2 P x 2 D behind vllm-router with this policy "
        f"({', '.join(ROUTER_POLICIES)}), one-way first as the reference, no ideal (module doc)",
    )
    parser.add_argument(
        "--connector-config", action="append", default=[], metavar="KEY=JSON",
        help="a DuplexConnector option for the P/D servers, e.g. layerwise_load=true "
        "(repeatable)",
    )
    add_pin_argument(parser)
    args = parser.parse_args()
    if args.replot:
        report = json.loads(args.replot.read_text())
        print(format_report(report))
        if args.png:
            plot(report, args.png)
        return
    args.connector_config = connector_options(parser, args.connector_config)
    workload = QUICK if args.quick else FULL
    overrides = {"conversations": args.conversations, "rates": args.rates, "turns": args.turns,
                 "think_s": args.think}
    workload = replace(workload, **{k: v for k, v in overrides.items() if v is not None})
    if not 1 <= workload.conversations <= MAX_CONVERSATIONS:
        parser.error(f"--conversations must be 1..{MAX_CONVERSATIONS}")
    if workload.turns < 2 or workload.think_s <= 0:
        parser.error("a chat needs at least 2 turns and a positive think time")
    if args.vllm_router and args.skip:
        parser.error("--vllm-router runs both P/D systems")
    args.workload = workload
    args.cpus = pd_cpus(parser, args.pin)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args.work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="kvduplex-load-"))
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_dir or args.work_dir / "tiny-chat-model"
    args.model_dir = build_tiny_chat_model(model_dir)
    report = run(args)
    print(format_report(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.png:
        plot(report, args.png)
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
