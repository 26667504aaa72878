"""`kvduplex demo`: a multi-turn conversation through a prefill (P) and a decode (D) vLLM server
with DuplexConnector and the kvduplex proxy, checked turn by turn against a single plain server.

What it shows, per turn: how many prompt tokens P pulled back from D (the history D kept from the
previous turn), how many P computed itself, the time to first token, and whether the greedy tokens
and their logprobs equal the single server's.

How it is measured:
- Turns are non-streaming: vLLM 0.32 returns `kv_transfer_params` only in non-streaming
  responses, and the proxy needs D's params to let the next turn pull. So the client cannot see
  the first token arrive; time to first token is read from the servers instead: P's TTFT (P's
  whole one-token prefill, including its pull from D) plus D's TTFT (D's pull from P and its first
  decode step), from each server's `vllm:time_to_first_token_seconds` histogram.
- Token counts come from vLLM's `vllm:prompt_tokens_by_source` counters on P (local compute,
  local prefix-cache hit, external KV transfer), read before and after each turn.
- Prompts are token ids: the history is the previous prompt's ids plus the ids D generated,
  then the new user message. A random-weight model emits token sequences that re-tokenizing their
  text would not reproduce, and the connector (rightly) reuses D's KV only for identical tokens.

The pieces (`duplex_kv_transfer_config`, `user_turns`, and from the modules beside this one
`read_metrics`, `ProxyThread`) are shared with the benchmarks and the end-to-end tests; this
package re-exports those of `metrics` and `proxy_thread`. The test harness that builds on the demo
(CPU pinning, several servers as one, streamed completions) is `kvduplex_testing`, not installed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx

from ..connector.config import DEFAULT_RECOMPUTE_THRESHOLD, REQUIRED_LOAD_FAILURE_POLICY
from ..proxy.config import CONVERSATION_HEADER
from .metrics import (
    MetricsSnapshot,
    lookup_result,
    metric_samples,
    read_metrics,
    read_metrics_after,
    read_proxy_lookups,
    sample_sums,
)
from .proxy_thread import ProxyThread
from .servers import (
    WHOLE_MACHINE_ENV,
    Completion,
    ServerError,
    VllmServer,
    complete,
    describe_mismatch,
    wait_until_ready,
    with_nonce,
)
from .tiny_model import SERVER_ARGS, build_tiny_model, sample_text

__all__ = [
    "MetricsSnapshot",
    "ProxyThread",
    "duplex_kv_transfer_config",
    "lookup_result",
    "metric_samples",
    "read_metrics",
    "read_metrics_after",
    "read_proxy_lookups",
    "register_demo",
    "sample_sums",
    "user_turns",
]

logger = logging.getLogger(__name__)

DEFAULT_TURNS = 4
# Every turn's answer is this long. It is above the recompute threshold on purpose: on turn k,
# P's own prefix cache already holds turn k-1's prompt up to its last full block, so what P can
# gain from D is the rest of that block plus the answer, which must reach 64 tokens for a pull.
DEFAULT_MAX_TOKENS = 80
DEFAULT_FIRST_WORDS = 200
DEFAULT_USER_WORDS = 60
# Outputs of P/D and the single server run the same float32 model on the same tokens; KV that was
# pulled instead of computed only changes the summation order of a few kernels.
LOGPROB_ATOL = 1e-3


def default_model_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "kvduplex" / "tiny-model"


def duplex_kv_transfer_config(
    *, bidirectional: bool = True, recompute_threshold: int = DEFAULT_RECOMPUTE_THRESHOLD
) -> dict[str, Any]:
    """`--kv-transfer-config` of a DuplexConnector server (P and D use the same one)."""
    return {
        "kv_connector": "DuplexConnector",
        "kv_connector_module_path": "kvduplex.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": REQUIRED_LOAD_FAILURE_POLICY,
        "kv_connector_extra_config": {
            "bidirectional_kv_xfer": bidirectional,
            "kv_recompute_threshold": recompute_threshold,
        },
    }


# --- conversations --------------------------------------------------------------------------


def user_turns(
    model_dir: Path, num_turns: int, *, first_words: int, user_words: int, seed: int = 0
) -> list[list[int]]:
    """Token ids of each user message of one conversation, the first behind BOS and a nonce.

    The nonce keeps earlier runs' KV, still in a server's prefix cache, out of the measurement.
    """
    if num_turns < 1:
        raise ValueError(f"a conversation needs at least one turn, got {num_turns}")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    turns = []
    for turn in range(num_turns):
        words = first_words if turn == 0 else user_words
        message = f"user: {sample_text(words, seed=seed * 1000 + turn)}\nassistant:"
        if turn == 0:
            turns.append(tokenizer.encode(with_nonce(message), add_special_tokens=True).ids)
        else:
            turns.append(tokenizer.encode("\n" + message, add_special_tokens=False).ids)
    return turns


# --- the demo -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TurnResult:
    turn: int
    prompt_tokens: int
    # Tokens that were not in the previous turn's prompt and answer: the new user message.
    new_tokens: int
    prefill_cache_hit_tokens: int
    pulled_from_decode_tokens: int
    prefill_computed_tokens: int
    ttft_s: float | None
    prefill_ttft_s: float | None
    decode_ttft_s: float | None
    turn_s: float
    # The proxy's conversation-store lookup: hit (P was told where D keeps the history), miss...
    proxy_lookup: str
    reference_ttft_s: float | None
    matches_reference: bool
    mismatch: str | None
    max_logprob_diff: float | None
    connector: dict[str, float]


def _add(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def run_turn(
    proxy_url: str,
    prefill_url: str,
    decode_url: str,
    reference_url: str,
    conversation_id: str,
    turn: int,
    prompt: list[int],
    new_tokens: int,
    max_tokens: int,
) -> tuple[TurnResult, Completion]:
    """One turn through the proxy, then the same prompt on the reference server."""
    prefill_before, decode_before = read_metrics(prefill_url), read_metrics(decode_url)
    lookups_before = read_proxy_lookups(proxy_url)
    started = time.perf_counter()
    answer = complete(proxy_url, prompt, max_tokens, headers={CONVERSATION_HEADER: conversation_id})
    turn_s = time.perf_counter() - started
    prefill = read_metrics_after(prefill_url, prefill_before, 1).minus(prefill_before)
    decode = read_metrics_after(decode_url, decode_before, 1).minus(decode_before)
    lookup = lookup_result(lookups_before, read_proxy_lookups(proxy_url))

    reference_before = read_metrics(reference_url)
    expected = complete(reference_url, prompt, max_tokens)
    reference = read_metrics_after(reference_url, reference_before, 1).minus(reference_before)

    mismatch = describe_mismatch(expected, answer, logprob_atol=LOGPROB_ATOL)
    diffs = [abs(a - b) for a, b in zip(expected.logprobs, answer.logprobs, strict=False)]
    result = TurnResult(
        turn=turn,
        prompt_tokens=len(prompt),
        new_tokens=new_tokens,
        prefill_cache_hit_tokens=prefill.cache_hit_tokens,
        pulled_from_decode_tokens=prefill.transferred_tokens,
        prefill_computed_tokens=prefill.computed_tokens,
        ttft_s=_add(prefill.mean_ttft_s, decode.mean_ttft_s),
        prefill_ttft_s=prefill.mean_ttft_s,
        decode_ttft_s=decode.mean_ttft_s,
        turn_s=turn_s,
        proxy_lookup=lookup,
        reference_ttft_s=reference.mean_ttft_s,
        matches_reference=mismatch is None,
        mismatch=mismatch,
        max_logprob_diff=max(diffs, default=None),
        connector={k: v for k, v in prefill.connector.items() if v},
    )
    return result, answer


_COLUMNS = (
    ("turn", 4),
    ("prompt", 6),
    ("new", 5),
    ("P cache hit", 11),
    ("pulled from D", 13),
    ("P prefilled", 11),
    ("TTFT ms", 8),
    ("1-server TTFT ms", 16),
    ("same as 1 server", 16),
)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.0f}"


def format_header() -> str:
    return "  ".join(title.rjust(width) for title, width in _COLUMNS)


def format_row(result: TurnResult) -> str:
    same = "yes" if result.matches_reference else "NO"
    if result.max_logprob_diff is not None:
        same += f" (dlp {result.max_logprob_diff:.0e})"
    cells = (
        str(result.turn + 1),
        str(result.prompt_tokens),
        str(result.new_tokens),
        str(result.prefill_cache_hit_tokens),
        str(result.pulled_from_decode_tokens),
        str(result.prefill_computed_tokens),
        _ms(result.ttft_s),
        _ms(result.reference_ttft_s),
        same,
    )
    return "  ".join(cell.rjust(width) for cell, (_, width) in zip(cells, _COLUMNS, strict=True))


class _Progress:
    def __init__(self, out: TextIO) -> None:
        self._out = out

    def say(self, message: str) -> None:
        print(message, file=self._out, flush=True)


def warm_up(server_url: str, name: str, progress: _Progress) -> None:
    """A server's first request pays one-time costs (~10-20 s on a busy CPU); pay them here."""
    completion = complete(server_url, with_nonce("warm up"), max_tokens=2)
    progress.say(f"  {name} warmed up ({completion.elapsed_s:.1f} s)")


@contextlib.contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so everything started is stopped on the way out."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_demo(args: argparse.Namespace, out: TextIO = sys.stdout) -> dict[str, Any]:
    progress = _Progress(out)
    model_dir = Path(args.model_dir) if args.model_dir else default_model_dir()
    progress.say(f"tiny model: {model_dir}")
    model_dir = build_tiny_model(model_dir)
    if args.log_dir:
        log_dir = Path(args.log_dir)
    else:
        log_dir = Path(tempfile.mkdtemp(prefix="kvduplex-demo-"))
    kv_config = duplex_kv_transfer_config(
        bidirectional=True, recompute_threshold=args.recompute_threshold
    )

    def server(
        name: str, extra: Sequence[str] = (), env: dict[str, str] | None = None
    ) -> VllmServer:
        return VllmServer(
            model_dir, name=name, extra_args=[*SERVER_ARGS, *extra], env=env, log_dir=log_dir
        )

    prefill = server("prefill", ["--kv-transfer-config", json.dumps(kv_config)])
    decode = server("decode", ["--kv-transfer-config", json.dumps(kv_config)])
    # Turns run one system at a time: the reference computes alone, on the whole machine; each
    # server of the P/D pair on half of it (the servers' default).
    reference = server("reference", env=WHOLE_MACHINE_ENV)
    servers = [prefill, decode, reference]
    report: dict[str, Any] = {
        "model_dir": str(model_dir),
        "kv_transfer_config": kv_config,
        "max_tokens": args.max_tokens,
        "logprob_atol": LOGPROB_ATOL,
        "log_dir": str(log_dir),
        "turns": [],
    }
    with contextlib.ExitStack() as stack:
        for vllm_server in servers:
            stack.callback(vllm_server.stop)
        progress.say(
            "starting vLLM servers: prefill and decode with DuplexConnector, and a plain "
            f"reference server (about a minute on a CPU; logs in {log_dir})"
        )
        for vllm_server in servers:
            vllm_server.start()
        wait_until_ready(servers, progress.say)
        for vllm_server in servers:
            warm_up(vllm_server.base_url, vllm_server.name, progress)
        proxy = stack.enter_context(ProxyThread([prefill.base_url], [decode.base_url]))
        progress.say(f"  proxy listening on {proxy.base_url}")
        # The first P->D transfer also connects P's and D's transfer engines; keep that one-time
        # handshake out of turn 1.
        complete(proxy.base_url, with_nonce("warm up the transfer path"), max_tokens=2)
        progress.say("  transfer path warmed up")

        messages = user_turns(
            model_dir, args.turns, first_words=args.first_words, user_words=args.user_words
        )
        conversation_id = f"kvduplex-demo-{os.getpid()}-{time.time_ns()}"
        progress.say(
            f"\n{args.turns}-turn conversation, {args.max_tokens}-token answers, greedy; "
            "each turn is also sent to the reference server\n"
        )
        progress.say(format_header())
        history: list[int] = []
        for turn, message in enumerate(messages):
            prompt = history + message
            result, answer = run_turn(
                proxy.base_url,
                prefill.base_url,
                decode.base_url,
                reference.base_url,
                conversation_id,
                turn,
                prompt,
                len(message),
                args.max_tokens,
            )
            report["turns"].append(asdict(result))
            progress.say(format_row(result))
            history = prompt + answer.token_ids
    later = [t for t in report["turns"] if t["turn"] >= 1]
    report["all_match_reference"] = all(t["matches_reference"] for t in report["turns"])
    report["tokens_pulled_from_decode"] = sum(t["pulled_from_decode_tokens"] for t in later)
    report["tokens_prefilled_on_later_turns"] = sum(t["prefill_computed_tokens"] for t in later)
    report["new_tokens_on_later_turns"] = sum(t["new_tokens"] for t in later)
    return report


def _summary(report: dict[str, Any]) -> str:
    lines = [
        "",
        "prompt: tokens sent; new: the user message added this turn; P cache hit: found in P's "
        "own prefix cache;",
        "pulled from D: history KV read back from the decode server; P prefilled: computed by P;",
        "TTFT: P's time to first token + D's (server-side, from /metrics); 1-server: the "
        "reference server's.",
        f"same as 1 server: greedy tokens equal and logprobs within {LOGPROB_ATOL:g} "
        "(dlp: largest logprob difference).",
        "",
        f"turns 2+: {report['tokens_pulled_from_decode']} tokens pulled from D, "
        f"{report['tokens_prefilled_on_later_turns']} prefilled on P for "
        f"{report['new_tokens_on_later_turns']} new tokens.",
    ]
    if not report["all_match_reference"]:
        lines.append("OUTPUTS DIFFER from the single-server run; server logs: " + report["log_dir"])
    return "\n".join(lines)


def register_demo(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run a multi-turn conversation through local P/D servers with DuplexConnector",
        description=(
            "Builds a tiny random-weight model, starts a prefill and a decode vLLM server with "
            "DuplexConnector (bidirectional), the kvduplex proxy and a plain reference server, "
            "runs a multi-turn conversation and prints per turn the tokens pulled back from the "
            "decode server, the tokens prefilled, the time to first token and whether the "
            "output equals the single server's. Needs about 10 GB of memory; everything "
            "started is stopped on exit."
        ),
    )
    parser.add_argument("--turns", type=int, default=DEFAULT_TURNS, help="(default %(default)s)")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="answer length of every turn (default %(default)s)",
    )
    parser.add_argument(
        "--first-words",
        type=int,
        default=DEFAULT_FIRST_WORDS,
        help="words in the first user message, ~2 tokens each (default %(default)s)",
    )
    parser.add_argument(
        "--user-words",
        type=int,
        default=DEFAULT_USER_WORDS,
        help="words in each later user message (default %(default)s)",
    )
    parser.add_argument(
        "--recompute-threshold",
        type=int,
        default=DEFAULT_RECOMPUTE_THRESHOLD,
        help="DuplexConnector's kv_recompute_threshold (default %(default)s)",
    )
    parser.add_argument(
        "--model-dir",
        help=f"tiny model directory, built if missing (default: {default_model_dir()})",
    )
    parser.add_argument(
        "--log-dir", help="server logs (default: a new temporary directory, removed on success)"
    )
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
    parser.set_defaults(run=run_demo_command, parser=parser)


def run_demo_command(args: argparse.Namespace) -> int:
    for name in ("turns", "max_tokens", "first_words", "user_words"):
        if getattr(args, name) < 1:
            args.parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.recompute_threshold < 0:
        args.parser.error("--recompute-threshold must be >= 0")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        with _terminate_as_exit():
            report = run_demo(args)
    except KeyboardInterrupt:
        print("\ninterrupted; all servers stopped", file=sys.stderr)
        return 130
    except (ServerError, httpx.HTTPError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    print(_summary(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    if not args.log_dir and report["all_match_reference"]:
        shutil.rmtree(report["log_dir"], ignore_errors=True)
    return 0 if report["all_match_reference"] else 1
