"""P/D under load with long histories: the chat rate each system sustains within a TTFT
objective, kvduplex against vLLM's own NixlConnector, all in one run (issue 37, items 1-3).

Systems, one after another, each on fresh servers (P pinned to the first half of the CPUs, D to
the second, as in benches/load.py; the proxy and the client run anywhere):
- `pd-oracle`: a DuplexConnector P/D pair, P->D only, whose P cache holds every live history
  (`kv_plan`'s oracle_p_blocks), so a turn >= 2 is a local prefix-cache hit on P: what P/D can
  reach at best. It runs first: its TTFT sets the objective.
- `reference`: one plain server on both CPUs with both nodes' blocks; its answers are the
  expected ones, so it runs every rate (the others stop at the first rate that misses the
  objective).
- `kvduplex-bidirectional`: DuplexConnector with `bidirectional_kv_xfer` behind the kvduplex
  proxy, streamed, no conversation id: P finds the history held on D by the prompt and pulls it.
- `kvduplex-one-way`: the same P->D only; P recomputes what its own prefix cache lost.
- `nixl-bidirectional`: vLLM's NixlConnector with `bidirectional_kv_xfer` (UCX_TLS=tcp,self,sm,
  `kv_buffer_device` cpu, benches/multiturn.py's settings). Its P pulls a history back only when
  its request carries D's `kv_transfer_params` of the turn before (do_remote_decode,
  remote_block_ids, remote_engine_id/request_id/host/port, remote_num_tokens), which vLLM 0.32
  returns only in a non-streamed answer. So its turns are sent non-streamed with a conversation
  id, and the kvduplex proxy keeps D's params and hands them to P on the next turn (what vLLM's
  multi-turn proxy for it does). Its TTFT cannot be seen by the client: it is estimated as the
  turn's end-to-end time minus (answer tokens - 1) x D's mean inter-token time over the point
  (`vllm:inter_token_latency_seconds`), marked `ttft_estimated`.
- `nixl-one-way`: NixlConnector without it, streamed.
`--connector-config KEY=JSON` sets a DuplexConnector option on the kvduplex systems' servers
(e.g. `decode_kv_hold_max_fraction=1.0`), the oracle's included; `--blocks SYSTEM=P,D` gives a
P/D system its own split of KV blocks (e.g. the same total, more of it on D for bidirectional).
NixlConnector has stalled on CPU before (RESULTS: a 135 s turn); every turn has a timeout
(`REQUEST_TIMEOUT_S`) and every point a deadline (`POINT_DEADLINE_S`); what did not finish is
counted as errors, never dropped.

Workload (`LONG`): `conversations` chats per rate, each `turns` turns whose user messages are
`user_words` long per turn (1,500 words, then a 3,000-word tool output, a 300-word follow-up,
another 3,000-word tool output: one word is one token of the round-trip tokenizer), every answer
`answer_tokens` long (streamed back and fed back as the next turn's history), so a history grows
from ~1.6k to 8.3k tokens (the last prompt 8.2k). Chats start as a Poisson process; between an
answer and the next turn an exponential think time. Each rate has chats of its own words (so
no point finds the one before in a cache), the same for every system; each turn is compared with
the reference's at the same rate (token ids and logprobs within `LOGPROB_ATOL`), as in
benches/load.py (after a chat's first difference its later turns are `diverged`).

Model: `kvduplex_testing.tiny_model.build_realistic_slice_chat_model`, one layer of the realistic
shape (SmolLM2-360M's layer: hidden 960, 15 query / 5 KV heads of 64, MLP 2560, float32). What a
pull saves against recompute is decided by per-token ratios that are all per-layer: prefill FLOPs
(linear and attention) per KV byte moved, the attention share of a long prefill, a prefill
token's cost against a decode step's. A slice keeps every one of them; only the absolute cost is
32x lower (measured on this machine's cores: an 8k-token prefill of the 2-layer slice took 31 s,
the 32-layer model would take minutes). The default sweep is meant to fit in about 25
minutes on an idle 2-core machine; with other work on the cores, cut it down with
`--conversations`, `--rates` and `--point-deadline`.

KV caches (`kv_plan`): each P/D node holds CACHE_SHARE of the chats' histories (averaged over
turns), at least one and a half longest requests; the oracle's P every chat's longest history; the
reference both nodes' blocks. D's blocks held for readers (`vllm:kvduplex_held_blocks`) and in
use (`vllm:kv_cache_usage_perc` x D's blocks) are sampled every second during a point.

Per system and rate: TTFT p50/p99 on turns >= 2 (client), TPOT p50, goodput (answer tokens/s of
answered turns over the point), preemptions, prompt tokens P computed, D->P pulled tokens, D's
blocks held and used (max, mean), errors, answers equal. The objective: p99 TTFT on turns >= 2 at
most OBJECTIVE_FACTOR x the oracle's p99 at the lowest rate (why p99, not p50: turns differ in
size by design; `_load_long_report`). A system's sustainable rate is the highest rate it met the
objective at, with every lower rate. Once a system misses it, its higher rates are not run
(they are recorded as skipped).

Usage (repository root; `make load-long`):
    PYTHONPATH=python .venv/bin/python benches/load_long.py --json OUT.json --png OUT.png
Exit status 1 when a system failed, a turn failed or an answer differs.
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
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from _load_long_report import (
    BIDIRECTIONAL,
    NIXL_BIDIRECTIONAL,
    NIXL_ONE_WAY,
    ORACLE,
    REFERENCE,
    SYSTEMS,
    format_report,
    objective_s,
    plot,
    verdicts,
    within,
)
from kvduplex.demo import (
    LOGPROB_ATOL,
    ProxyThread,
    duplex_kv_transfer_config,
    metric_samples,
    read_metrics,
)
from kvduplex.demo.servers import ServerError
from kvduplex.proxy.config import CONVERSATION_HEADER
from kvduplex_testing.servers import VllmServer, start_many
from kvduplex_testing.tiny_model import (
    REALISTIC_SERVED_MODEL_NAME,
    build_realistic_slice_chat_model,
    sample_chat_text,
)
from load import (
    TurnRecord,
    chat_body,
    compare,
    connector_options,
    percentile,
    server_counts,
    stream_answer,
)
from multiturn import RECOMPUTE_THRESHOLD, add_pin_argument, nixl_config, pd_cpus
from nixl_pd_baseline import nixl_pd_envs

logger = logging.getLogger("load_long")

BLOCK_TOKENS = 128
FIRST_TURN_TEMPLATE_TOKENS = 3
LATER_TURN_TEMPLATE_TOKENS = 2
CACHE_SHARE = 0.5
REQUEST_TIMEOUT_S = 120.0
POINT_DEADLINE_S = 240.0
PAUSE_BETWEEN_POINTS_S = 3.0
METRICS_SAMPLE_S = 1.0
# The warm-up chat's messages (words) and answers (tokens, past the recompute threshold).
WARM_UP_WORDS = 600
WARM_UP_ANSWER = RECOMPUTE_THRESHOLD + 32


@dataclass(frozen=True)
class Workload:
    conversations: int
    user_words: tuple[int, ...]  # per turn
    answer_tokens: int
    think_s: float
    rates: tuple[float, ...]  # chat arrivals per second

    @property
    def turns(self) -> int:
        return len(self.user_words)


LONG = Workload(conversations=4, user_words=(1500, 3000, 300, 3000), answer_tokens=128,
                think_s=1.5, rates=(4 / 60, 8 / 60, 16 / 60))
QUICK = Workload(conversations=2, user_words=(400, 600, 100), answer_tokens=32, think_s=0.5,
                 rates=(6 / 60, 30 / 60))


def history_tokens(workload: Workload, turn: int) -> int:
    """Tokens of a chat's prompt and answer after turn `turn` (0-based)."""
    prompt = sum(workload.user_words[: turn + 1]) + FIRST_TURN_TEMPLATE_TOKENS + turn * (
        workload.answer_tokens + LATER_TURN_TEMPLATE_TOKENS
    )
    return prompt + workload.answer_tokens


def kv_plan(workload: Workload) -> dict[str, Any]:
    histories = [history_tokens(workload, t) for t in range(workload.turns)]
    longest_blocks = math.ceil(histories[-1] / BLOCK_TOKENS)
    live = workload.conversations * statistics.fmean(histories) / BLOCK_TOKENS
    # At least one longest request and half of another running (vLLM needs one to start).
    node = max(math.ceil(live * CACHE_SHARE), longest_blocks * 3 // 2 + 2)
    return {
        "block_tokens": BLOCK_TOKENS,
        "first_history_tokens": histories[0],
        "longest_request_tokens": histories[-1],
        "node_blocks": node,
        "oracle_p_blocks": workload.conversations * (longest_blocks + 1) + node,
        "reference_blocks": 2 * node,
        "max_model_len": BLOCK_TOKENS * max(longest_blocks, math.ceil(
            (2 * (WARM_UP_WORDS + WARM_UP_ANSWER) + 8) / BLOCK_TOKENS)),
    }


# --- the client (runs in a process of its own) -----------------------------------------------


@dataclass(frozen=True)
class PointPlan:
    rate: float
    answer_tokens: int
    starts_s: list[float]
    messages: list[list[str]]
    thinks_s: list[list[float]]
    # "stream": streamed, no conversation id; "conversation": non-streamed with an id.
    mode: str
    conversation_prefix: str


def point_plan(workload: Workload, index: int, mode: str, prefix: str) -> PointPlan:
    """The chats of the sweep's `index`-th rate: words, starts and think times of their own (a
    point must not find the histories of the point before in any cache), the same for every
    system."""
    rate = workload.rates[index]
    rng = random.Random(f"load-long-{index}-{rate}")
    starts, clock = [], 0.0
    for _ in range(workload.conversations):
        starts.append(clock)
        clock += rng.expovariate(rate)
    messages = [[sample_chat_text(words, seed=(index * 100 + c) * 100 + turn)
                 for turn, words in enumerate(workload.user_words)]
                for c in range(workload.conversations)]
    thinks = [[rng.expovariate(1 / workload.think_s) for _ in range(workload.turns - 1)]
              for _ in range(workload.conversations)]
    return PointPlan(rate, workload.answer_tokens, starts, messages, thinks, mode, prefix)


async def chat_turn(client: httpx.AsyncClient, url: str, messages: list[dict[str, str]],
                    record: TurnRecord, plan: PointPlan, origin: float) -> None:
    """One turn into `record`; a failure is its `error`. Non-streamed turns leave `ttft_s`
    None (estimated later from D's metrics)."""
    started = time.perf_counter()
    record.sent_s = started - origin
    stream = plan.mode == "stream"
    body = chat_body(messages, plan.answer_tokens, REALISTIC_SERVED_MODEL_NAME, stream)
    headers = ({CONVERSATION_HEADER: f"{plan.conversation_prefix}-{record.conversation}"}
               if not stream else None)
    endpoint = f"{url}/v1/chat/completions"
    text: list[str] = []
    ids: list[int] = []
    logprobs: list[float] = []
    try:
        if stream:
            await stream_answer(client, endpoint, body, record, started, (text, ids, logprobs))
        else:
            response = await client.post(endpoint, json=body, headers=headers)
            if response.status_code != 200:
                raise ServerError(f"answered {response.status_code}: {response.text[:300]}")
            answer = response.json()
            record.prompt_token_ids = list(answer.get("prompt_token_ids") or [])
            choice = answer["choices"][0]
            text.append(choice["message"]["content"] or "")
            ids.extend(choice.get("token_ids") or [])
            entries = (choice.get("logprobs") or {}).get("content") or []
            logprobs.extend(float(e["logprob"]) for e in entries)
        if len(ids) != plan.answer_tokens:
            raise ServerError(f"{len(ids)} tokens instead of {plan.answer_tokens}")
    except (httpx.HTTPError, ServerError, ValueError, KeyError, IndexError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:400]
    record.done_s = time.perf_counter() - origin
    record.text = "".join(text)
    record.token_ids, record.logprobs = ids, logprobs


async def _conversation(client: httpx.AsyncClient, url: str, plan: PointPlan, c: int,
                        origin: float, records: list[TurnRecord]) -> None:
    await asyncio.sleep(max(0.0, origin + plan.starts_s[c] - time.perf_counter()))
    messages: list[dict[str, str]] = []
    for turn, message in enumerate(plan.messages[c]):
        messages.append({"role": "user", "content": message})
        record = TurnRecord(c, turn, 0.0)
        records.append(record)
        await chat_turn(client, url, messages, record, plan, origin)
        if record.error is not None:
            return
        messages.append({"role": "assistant", "content": record.text})
        if turn < len(plan.thinks_s[c]):
            await asyncio.sleep(plan.thinks_s[c][turn])


async def _run_point(url: str, plan: PointPlan, deadline_s: float) -> list[TurnRecord]:
    records: list[TurnRecord] = []
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None),
                                 timeout=timeout) as client:
        origin = time.perf_counter()
        chats = [asyncio.ensure_future(_conversation(client, url, plan, c, origin, records))
                 for c in range(len(plan.starts_s))]
        _, late = await asyncio.wait(chats, timeout=deadline_s)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
    for record in records:
        if record.done_s is None:
            record.error = f"point deadline ({deadline_s:g} s) passed"
            record.done_s = time.perf_counter() - origin
    return sorted(records, key=lambda r: (r.conversation, r.turn))


def run_point(url: str, plan: PointPlan, deadline_s: float) -> list[TurnRecord]:
    return asyncio.run(_run_point(url, plan, deadline_s))


# --- servers and metrics ---------------------------------------------------------------------


def server_args(plan: dict[str, Any], blocks: int) -> list[str]:
    return ["--dtype", "float32", "--enforce-eager", "--seed", "0",
            "--served-model-name", REALISTIC_SERVED_MODEL_NAME,
            "--max-model-len", str(plan["max_model_len"]),
            "--num-gpu-blocks-override", str(blocks), "--enable-prefix-caching"]


def make_servers(system: str, args: argparse.Namespace, plan: dict[str, Any]
                 ) -> dict[str, VllmServer]:
    p_cpus, d_cpus = args.cpus or (None, None)
    common = {"log_dir": args.work_dir}
    if system == REFERENCE:
        both = p_cpus | d_cpus if args.cpus else None
        return {"server": VllmServer(args.model_dir, name=system, cpus=both,
                                     extra_args=server_args(plan, plan["reference_blocks"]),
                                     **common)}
    envs: tuple[dict[str, str] | None, dict[str, str] | None] = (None, None)
    if system in (NIXL_BIDIRECTIONAL, NIXL_ONE_WAY):
        config = nixl_config(None)
        if system == NIXL_ONE_WAY:
            del config["kv_connector_extra_config"]["bidirectional_kv_xfer"]
        envs = nixl_pd_envs(args.work_dir)
    else:
        config = duplex_kv_transfer_config(bidirectional=system == BIDIRECTIONAL,
                                           recompute_threshold=RECOMPUTE_THRESHOLD)
        config["kv_connector_extra_config"].update(args.connector_config)
    p_blocks, d_blocks = pd_blocks(system, args, plan)
    transfer = ["--kv-transfer-config", json.dumps(config)]
    return {
        role: VllmServer(args.model_dir, name=f"{system}-{role}", cpus=cpus, env=env,
                         extra_args=[*server_args(plan, blocks), *transfer], **common)
        for role, cpus, env, blocks in (("P", p_cpus, envs[0], p_blocks),
                                        ("D", d_cpus, envs[1], d_blocks))
    }


def pd_blocks(system: str, args: argparse.Namespace, plan: dict[str, Any]) -> tuple[int, int]:
    """A P/D system's KV blocks on P and on D: the plan's node blocks each (the oracle's P
    more), unless `--blocks` gives the system its own."""
    if system in args.blocks:
        return args.blocks[system]
    p_blocks = plan["oracle_p_blocks"] if system == ORACLE else plan["node_blocks"]
    return p_blocks, plan["node_blocks"]


class DecodeSampler(threading.Thread):
    """D's blocks held for readers and in use, read every METRICS_SAMPLE_S while a point runs,
    and its inter-token latency sum and count."""

    def __init__(self, url: str, blocks: int):
        super().__init__(daemon=True)
        self.url, self.blocks = url, blocks
        self.held: list[float] = []
        self.used: list[float] = []
        self.stop = threading.Event()

    def read(self) -> dict[str, float]:
        values: dict[str, float] = {}
        for s in metric_samples(self.url):
            if s.name in ("vllm:kvduplex_held_blocks", "vllm:kv_cache_usage_perc",
                          "vllm:inter_token_latency_seconds_sum",
                          "vllm:inter_token_latency_seconds_count"):
                values[s.name] = values.get(s.name, 0.0) + s.value
        return values

    def run(self) -> None:
        while not self.stop.wait(METRICS_SAMPLE_S):
            try:
                values = self.read()
            except (httpx.HTTPError, ValueError):
                continue
            if "vllm:kvduplex_held_blocks" in values:
                self.held.append(values["vllm:kvduplex_held_blocks"])
            self.used.append(values.get("vllm:kv_cache_usage_perc", 0.0) * self.blocks)


def _tpot(r: TurnRecord, answer_tokens: int) -> float | None:
    if r.error is not None or r.ttft_s is None or answer_tokens < 2:
        return None
    return (r.done_s - r.sent_s - r.ttft_s) / (answer_tokens - 1)


def summarize(records: list[TurnRecord], plan: PointPlan, turns: int,
              itl_s: float | None) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    estimated = plan.mode != "stream"
    if estimated and itl_s is not None:  # module doc: e2e minus D's decode
        for r in ok:
            r.ttft_s = max(0.0, r.done_s - r.sent_s - (plan.answer_tokens - 1) * itl_s)
    later = [r.ttft_s for r in ok if r.turn >= 1 and r.ttft_s is not None]
    tpots = ([itl_s] if estimated and itl_s is not None else
             [t for r in ok if (t := _tpot(r, plan.answer_tokens)) is not None])
    span = (max(r.done_s for r in records) - min(r.sent_s for r in records)) if records else 0.0
    errors = sorted({r.error for r in records if r.error})
    return {
        "rate": plan.rate, "requests": len(records), "completed": len(ok),
        "errors": len(records) - len(ok), "error_samples": errors[:5],
        "not_sent": len(plan.starts_s) * turns - len(records),
        "span_s": round(span, 2),
        "goodput_tokens_per_s": round(sum(len(r.token_ids or ()) for r in ok) / span, 1)
        if span else None,
        "ttft_p50_s_turns_2_plus": percentile(later, 0.5),
        "ttft_p99_s_turns_2_plus": percentile(later, 0.99),
        "ttft_p50_s_turn_1": percentile([r.ttft_s for r in ok if r.turn == 0
                                         and r.ttft_s is not None], 0.5),
        "ttft_estimated": estimated,
        "tpot_p50_s": percentile(tpots, 0.5),
        "turns_2_plus_ttft_s": [round(t, 3) for t in later],
    }


def warm_up(direct: list[str], proxy_url: str | None, mode: str, index: int) -> None:
    """A two-turn chat of its own words through the proxy, or on a server without one (answers
    past the recompute threshold, so a bidirectional P pulls turn 1 back): first-request costs
    (kernel set-up for long prompts, the transfer handshakes) stay out of the points."""
    # Through the proxy both servers warm up; a single server is warmed directly.
    chats = [(proxy_url, mode, 2)] if proxy_url else [(url, "stream", 2) for url in direct]
    for n, (url, how, turns) in enumerate(chats):
        seed = -100 * index - 10 * n
        plan = PointPlan(1.0, WARM_UP_ANSWER, [0.0],
                         [[sample_chat_text(WARM_UP_WORDS, seed=seed - t) for t in range(turns)]],
                         [[0.2] * (turns - 1)], how, f"warm-{index}-{n}-{time.time_ns()}")
        for record in run_point(url, plan, 600.0):
            if record.error is not None:
                raise ServerError(f"warm-up chat on {url} failed: {record.error}")


def run_system(system: str, index: int, args: argparse.Namespace, plan: dict[str, Any],
               client: concurrent.futures.Executor, objective: float | None
               ) -> tuple[dict[str, Any], dict[float, list[TurnRecord]]]:
    """Every rate of the sweep on fresh servers, up to the first that misses `objective`."""
    workload: Workload = args.workload
    rates = workload.rates
    mode = "conversation" if system == NIXL_BIDIRECTIONAL else "stream"
    servers = make_servers(system, args, plan)
    result: dict[str, Any] = {"points": []}
    records_by_rate: dict[float, list[TurnRecord]] = {}
    with start_many(list(servers.values())):
        pd = "P" in servers
        proxy = ProxyThread([servers["P"].base_url], [servers["D"].base_url]) if pd else None
        with proxy or contextlib.nullcontext():
            url = proxy.base_url if proxy else servers["server"].base_url
            client.submit(warm_up, [s.base_url for s in servers.values()],
                          proxy.base_url if proxy else None, mode, index).result()
            decode = servers["D" if pd else "server"]
            d_blocks = pd_blocks(system, args, plan)[1] if pd else plan["reference_blocks"]
            for i, rate in enumerate(rates):
                time.sleep(PAUSE_BETWEEN_POINTS_S)
                point = point_plan(workload, i, mode, f"{system}-{rate}-{time.time_ns()}")
                before = {role: read_metrics(s.base_url) for role, s in servers.items()}
                sampler = DecodeSampler(decode.base_url, d_blocks)
                itl_before = sampler.read()
                sampler.start()
                records = client.submit(run_point, url, point, args.point_deadline).result()
                sampler.stop.set()
                sampler.join()
                time.sleep(1.0)  # the last step's stats (benches/load.py: read_metrics_after)
                itl_after = sampler.read()
                deltas = {role: read_metrics(s.base_url).minus(before[role])
                          for role, s in servers.items()}
                count = (itl_after.get("vllm:inter_token_latency_seconds_count", 0.0)
                         - itl_before.get("vllm:inter_token_latency_seconds_count", 0.0))
                itl = ((itl_after.get("vllm:inter_token_latency_seconds_sum", 0.0)
                        - itl_before.get("vllm:inter_token_latency_seconds_sum", 0.0)) / count
                       if count else None)
                summary = {**summarize(records, point, workload.turns, itl),
                           **server_counts(deltas)}
                summary["d_inter_token_mean_s"] = itl
                summary["d_held_blocks_max"] = max(sampler.held, default=None)
                summary["d_held_blocks_mean"] = (round(statistics.fmean(sampler.held), 1)
                                                 if sampler.held else None)
                summary["d_used_blocks_max"] = round(max(sampler.used, default=0.0), 1)
                summary["d_used_blocks_mean"] = (round(statistics.fmean(sampler.used), 1)
                                                 if sampler.used else None)
                logger.info("%s at %.3g chats/min: %s", system, 60 * rate, json.dumps(summary))
                result["points"].append(summary)
                records_by_rate[rate] = records
                # The reference's answers are the expected ones at every rate: it runs them all.
                if system != REFERENCE and objective is not None and not within(summary, objective):
                    result["skipped_rates"] = list(rates[i + 1:])
                    result["skip_reason"] = (f"missed the objective at {60 * rate:g} chats/min")
                    break
    return result, records_by_rate


def run(args: argparse.Namespace) -> dict[str, Any]:
    workload: Workload = args.workload
    plan = kv_plan(workload)
    logger.info("KV cache plan: %s", json.dumps(plan))
    report: dict[str, Any] = {
        "workload": {**asdict(workload), "turns": workload.turns},
        "kv_plan": plan, "model": "realistic slice (1 layer of SmolLM2-360M's shape)",
        "recompute_threshold": RECOMPUTE_THRESHOLD, "connector_config": args.connector_config,
        "blocks": args.blocks,
        "logprob_atol": LOGPROB_ATOL,
        "pinned": args.pin, "point_deadline_s": args.point_deadline, "logs": str(args.work_dir),
        "systems": {},
    }
    records: dict[str, dict[float, list[TurnRecord]]] = {}
    objective = None
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context("spawn")
    ) as client:
        for index, system in enumerate(SYSTEMS):
            if system in args.skip:
                continue
            logger.info("%s: starting", system)
            started = time.monotonic()
            try:
                result, records[system] = run_system(system, index, args, plan, client,
                                                     objective)
            except (ServerError, httpx.HTTPError, TimeoutError) as exc:
                logger.error("%s failed: %s", system, exc)
                report["systems"][system] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
                continue
            result["wall_s"] = round(time.monotonic() - started, 1)
            report["systems"][system] = result
            if system == ORACLE:
                objective = objective_s(result["points"])
    reference = records.get(REFERENCE, {})
    for system, by_rate in records.items():
        for point in report["systems"][system]["points"]:
            expected = {(r.conversation, r.turn): r for r in reference.get(point["rate"], [])}
            point["answers"] = compare(by_rate[point["rate"]], expected)
    report["verdicts"] = verdicts(report)
    report["ok"] = all(
        "error" not in r and all(p["errors"] == 0 and p["answers"]["mismatched"] == 0
                                 and p["answers"]["no_reference"] == 0 for p in r["points"])
        for r in report["systems"].values()
    )
    return report


def _rates(text: str) -> tuple[float, ...]:
    rates = tuple(float(x) / 60 for x in text.split(","))
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be positive, got {text}")
    return tuple(sorted(rates))


def _blocks(parser: argparse.ArgumentParser, items: list[str]) -> dict[str, tuple[int, int]]:
    blocks = {}
    for item in items:
        system, _, sizes = item.partition("=")
        p, _, d = sizes.partition(",")
        if system not in SYSTEMS[2:] or not (p.isdigit() and d.isdigit()) or 0 in (int(p), int(d)):
            parser.error(f"--blocks takes SYSTEM=P,D (a P/D system, two positive counts): {item}")
        blocks[system] = (int(p), int(d))
    return blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK}")
    parser.add_argument("--rates", type=_rates, help="chat arrivals per MINUTE, e.g. 3,6,12")
    parser.add_argument("--conversations", type=int, help="chats per rate")
    parser.add_argument("--think", type=float, help="mean think time between turns (s)")
    parser.add_argument("--point-deadline", type=float, default=POINT_DEADLINE_S,
                        help="seconds a rate may run; turns not done by then are errors")
    parser.add_argument("--skip", action="append", default=[], choices=SYSTEMS[2:],
                        help="leave a system out (not the oracle or the reference)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--png", type=Path, help="TTFT against offered load")
    parser.add_argument("--model-dir", type=Path, help="model directory (built if missing)")
    parser.add_argument("--work-dir", type=Path, help="server logs (default: a new temp dir)")
    parser.add_argument("--connector-config", action="append", default=[], metavar="KEY=JSON",
                        help="a DuplexConnector option for the kvduplex systems' servers, e.g. "
                        "decode_kv_hold_max_fraction=1.0 (repeatable)")
    parser.add_argument("--blocks", action="append", default=[], metavar="SYSTEM=P,D",
                        help="a P/D system's KV blocks on P and on D instead of the plan's, "
                        "e.g. kvduplex-bidirectional=117,234 (repeatable)")
    add_pin_argument(parser)
    args = parser.parse_args()
    args.connector_config = connector_options(parser, args.connector_config)
    args.blocks = _blocks(parser, args.blocks)
    workload = QUICK if args.quick else LONG
    overrides = {"rates": args.rates, "conversations": args.conversations,
                 "think_s": args.think}
    args.workload = replace(workload, **{k: v for k, v in overrides.items() if v is not None})
    args.cpus = pd_cpus(parser, args.pin)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args.work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="kvduplex-load-long-"))
    args.work_dir.mkdir(parents=True, exist_ok=True)
    args.model_dir = build_realistic_slice_chat_model(
        args.model_dir or args.work_dir / "realistic-slice-model")
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
