"""Multi-turn P/D benchmark: the same conversations through three systems, one after another.

Systems (each: one prefill server P, one decode server D, the kvduplex proxy in front):
- `kvduplex-bidirectional`: DuplexConnector with `bidirectional_kv_xfer: true`; on each later
  turn P pulls the history's KV back from the D that decoded the previous turn.
- `kvduplex-one-way`: DuplexConnector, P->D only; P recomputes whatever its own prefix cache
  lacks.
- `nixl-bidirectional`: vLLM's NixlConnector with `bidirectional_kv_xfer: true` and the same
  threshold. The kvduplex proxy replays D's `kv_transfer_params` to P on the next turn, as
  vLLM's multi-turn P/D proxy recipe does; it speaks the same keys.
A plain single server (`single-server`) runs the conversations first: its answers are the
expected outputs, its prompts (history = earlier prompts and its answers) are replayed verbatim
through every system, and its TTFT is shown for context.

Turns are lockstep: turn k of all conversations is sent at once, then turn k+1. Per turn and
system: mean time to first token (P's TTFT + D's TTFT from their `/metrics` histograms; turns are
non-streaming because vLLM 0.32 returns `kv_transfer_params` only there), prompt tokens P
computed, took from its prefix cache and pulled from D (`vllm:prompt_tokens_by_source`), wall
time, and how many answers equal the single server's (tokens, logprobs within 1e-3).

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
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from kvduplex.demo import (
    CONVERSATION_HEADER,
    LOGPROB_ATOL,
    MetricsSnapshot,
    ProxyThread,
    duplex_kv_transfer_config,
    read_metrics,
    read_metrics_after,
    user_turns,
)
from kvduplex.servers import (
    Completion,
    ServerError,
    VllmServer,
    complete,
    describe_mismatch,
    ports_outside_ephemeral_range,
    start_many,
    with_nonce,
)
from kvduplex.tiny_model import SERVER_ARGS, build_tiny_model
from nixl_pd_baseline import NIXL_ENV, nixl_pythonpath

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
ONE_WAY = "kvduplex-one-way"
NIXL = "nixl-bidirectional"
SYSTEMS = (BIDIRECTIONAL, ONE_WAY, NIXL)


@dataclass(frozen=True)
class Workload:
    conversations: int
    turns: int
    first_words: int
    user_words: int
    max_tokens: int


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


def _sum_or_none(first: float | None, second: float | None) -> float | None:
    return None if first is None or second is None else first + second


def run_turn(
    url: str,
    prompts: Sequence[list[int]],
    max_tokens: int,
    conversation_ids: Sequence[str] | None,
) -> tuple[list[Completion], float]:
    """Send one turn of every conversation at once; return the answers and the wall time."""

    def send(index: int) -> Completion:
        headers = (
            {CONVERSATION_HEADER: conversation_ids[index]} if conversation_ids is not None else None
        )
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
) -> tuple[list[TurnStats], list[list[Completion]]]:
    """Run all conversations turn by turn through `url`.

    With `expected` (the single server's answers), every prompt is the single server's history,
    so all systems see identical conversations; without, the history grows from the answers.
    `prefill_url` / `decode_url` are the servers whose /metrics count the turn (for a single
    server, `prefill_url` is that server and `decode_url` is None).
    """
    n = workload.conversations
    conversation_ids = (
        [f"{conversation_prefix}-{c}" for c in range(n)] if conversation_prefix else None
    )
    histories: list[list[int]] = [[] for _ in range(n)]
    answers_by_turn: list[list[Completion]] = []
    stats = []
    for turn in range(workload.turns):
        prompts = [histories[c] + messages[c][turn] for c in range(n)]
        prefill_before = read_metrics(prefill_url)
        decode_before = read_metrics(decode_url) if decode_url else None
        answers, wall_s = run_turn(url, prompts, workload.max_tokens, conversation_ids)
        prefill = read_metrics_after(prefill_url, prefill_before, n).minus(prefill_before)
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


def warm_up_transfer_path(proxy_url: str, model_dir: Path) -> None:
    """A two-turn conversation through the proxy: connects P->D and, where the second turn pulls,
    D->P, so no system's first measured turn includes a transfer-engine handshake."""
    messages = user_turns(model_dir, 2, first_words=100, user_words=20, seed=999)
    history: list[int] = []
    for message in messages:
        prompt = history + message
        answer = complete(
            proxy_url, prompt, 80, headers={CONVERSATION_HEADER: f"warm-up-{time.time_ns()}"}
        )
        history = prompt + answer.token_ids


def server_factory(model_dir: Path, log_dir: Path) -> Callable[..., VllmServer]:
    def make(
        name: str,
        kv_transfer_config: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
    ) -> VllmServer:
        extra = list(SERVER_ARGS)
        if kv_transfer_config is not None:
            extra += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        return VllmServer(model_dir, name=name, extra_args=extra, env=env, log_dir=log_dir)

    return make


def nixl_config(num_threads: int | None) -> dict[str, Any]:
    """NixlConnector's config; `num_threads` sets its UCX backend threads (vLLM's default: 4)."""
    config = json.loads(json.dumps(NIXL_BIDIRECTIONAL_CONFIG))
    if num_threads is not None:
        config["kv_connector_extra_config"]["num_threads"] = num_threads
    return config


def pd_servers(
    system: str, make: Callable[..., VllmServer], work_dir: Path, nixl_num_threads: int | None
) -> tuple[VllmServer, VllmServer]:
    if system in (BIDIRECTIONAL, ONE_WAY):
        config = duplex_kv_transfer_config(
            bidirectional=system == BIDIRECTIONAL, recompute_threshold=RECOMPUTE_THRESHOLD
        )
        return make(f"{system}-prefill", config), make(f"{system}-decode", config)
    inherited = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    pythonpath = os.pathsep.join([*nixl_pythonpath(work_dir), *inherited])
    prefill_side, decode_side = ports_outside_ephemeral_range(2)

    def env(side_channel_port: int) -> dict[str, str]:
        return {
            **NIXL_ENV,
            "PYTHONPATH": pythonpath,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
        }

    return (
        make(f"{system}-prefill", nixl_config(nixl_num_threads), env(prefill_side)),
        make(f"{system}-decode", nixl_config(nixl_num_threads), env(decode_side)),
    )


def summarize(stats: list[TurnStats], conversations: int) -> dict[str, Any]:
    later = [t for t in stats if t.turn >= 1]
    ttfts = [t.mean_ttft_s for t in later if t.mean_ttft_s is not None]
    return {
        "mean_ttft_s_turns_2_plus": statistics.fmean(ttfts) if ttfts else None,
        "prefill_computed_tokens_turns_2_plus": sum(t.prefill_computed_tokens for t in later),
        "new_tokens_turns_2_plus": sum(t.new_tokens for t in later),
        "pulled_from_decode_tokens_turns_2_plus": sum(t.pulled_from_decode_tokens for t in later),
        # The new user message plus, per conversation, the previous answer's last token.
        "computes_only_new_tokens": all(
            t.prefill_computed_tokens <= t.new_tokens + conversations for t in later
        ),
        "total_s": sum(t.wall_s for t in stats),
        "all_match": all(not t.mismatches for t in stats),
    }


def _fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.0f}"


def format_tables(report: dict[str, Any]) -> str:
    lines = []
    header = (
        f"{'system':<24}{'turn':>5}{'new':>7}{'P computed':>12}{'P cache':>9}"
        f"{'pulled':>8}{'TTFT ms':>9}{'P ms':>7}{'D ms':>7}{'wall s':>8}{'match':>7}"
    )
    lines.append(header)
    for system, result in report["systems"].items():
        if "error" in result:
            lines.append(f"{system:<24}failed: {result['error']}")
            continue
        for t in result["turns"]:
            lines.append(
                f"{system:<24}{t['turn'] + 1:>5}{t['new_tokens']:>7}"
                f"{t['prefill_computed_tokens']:>12}{t['prefill_cache_hit_tokens']:>9}"
                f"{t['pulled_from_decode_tokens']:>8}{_fmt_ms(t['mean_ttft_s']):>9}"
                f"{_fmt_ms(t['mean_prefill_ttft_s']):>7}{_fmt_ms(t['mean_decode_ttft_s']):>7}"
                f"{t['wall_s']:>8.1f}{t['matches']:>4}/{report['workload']['conversations']}"
            )
    lines.append("")
    lines.append(
        f"{'system':<24}{'TTFT ms t>=2':>13}{'P computed t>=2':>16}{'new t>=2':>10}"
        f"{'pulled t>=2':>12}{'total s':>9}{'outputs':>9}"
    )
    for system, result in report["systems"].items():
        if "error" in result:
            continue
        s = result["summary"]
        outputs = "equal" if s["all_match"] else "DIFFER"
        lines.append(
            f"{system:<24}{_fmt_ms(s['mean_ttft_s_turns_2_plus']):>13}"
            f"{s['prefill_computed_tokens_turns_2_plus']:>16}{s['new_tokens_turns_2_plus']:>10}"
            f"{s['pulled_from_decode_tokens_turns_2_plus']:>12}{s['total_s']:>9.1f}{outputs:>9}"
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
        "logs": str(work_dir),
        "systems": {},
    }

    logger.info("%s: computing the expected answers", SINGLE_SERVER)
    with start_many([make(SINGLE_SERVER)]) as (single,):
        warm_up([single])
        stats, expected = run_conversations(
            single.base_url,
            single.base_url,
            None,
            messages,
            workload,
            conversation_prefix=None,
            expected=None,
        )
    report["systems"][SINGLE_SERVER] = {
        "turns": [asdict(t) for t in stats],
        "summary": summarize(stats, workload.conversations),
    }

    systems = [s for s in SYSTEMS if s not in args.skip]
    for system in systems:
        logger.info("%s: starting P and D", system)
        prefill, decode = pd_servers(system, make, work_dir, args.nixl_num_threads)
        try:
            with start_many([prefill, decode]):
                warm_up([prefill, decode])
                with ProxyThread([prefill.base_url], [decode.base_url]) as proxy:
                    warm_up_transfer_path(proxy.base_url, model_dir)
                    logger.info("%s: running %d conversations", system, workload.conversations)
                    stats, _ = run_conversations(
                        proxy.base_url,
                        prefill.base_url,
                        decode.base_url,
                        messages,
                        workload,
                        conversation_prefix=f"{system}-{time.time_ns()}",
                        expected=expected,
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

    def computed(name: str) -> float | None:
        if name not in summaries:
            return None
        return summaries[name]["prefill_computed_tokens_turns_2_plus"]

    report["ratios"] = {
        "TTFT t>=2 bidirectional / nixl": _ratio(ttft(BIDIRECTIONAL), ttft(NIXL)),
        "TTFT t>=2 bidirectional / one-way": _ratio(ttft(BIDIRECTIONAL), ttft(ONE_WAY)),
        "P computed t>=2 bidirectional / nixl": _ratio(computed(BIDIRECTIONAL), computed(NIXL)),
        "P computed t>=2 bidirectional / one-way": _ratio(
            computed(BIDIRECTIONAL), computed(ONE_WAY)
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
        "bidirectional TTFT t>=2 <= 0.5x nixl": (
            bidirectional_ratio <= 0.5 if bidirectional_ratio is not None else None
        ),
    }
    report["ok"] = all(
        name in summaries and summaries[name]["all_match"]
        for name in (BIDIRECTIONAL, ONE_WAY)
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
    parser.add_argument(
        "--nixl-num-threads",
        type=int,
        help="NixlConnector's `num_threads` (UCX backend threads; vLLM's default is 4, which "
        "busy-poll on a small CPU)",
    )
    args = parser.parse_args()
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
