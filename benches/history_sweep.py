"""Turn-N TTFT as the history grows, on a realistic-shape model.

For each history length L (tokens; default 1024, 2048 and 4096) and each of several
conversations: turn 1 is a prompt of L tokens (a nonce first), answered in `--answer` tokens;
turn 2 is turn 1's prompt and answer plus `--new` tokens. What is measured is turn 2's time to
first token, streamed and seen by the client, for
- `ideal`: one plain server, on the CPUs P gets (below), that has turn 1 in its prefix cache
  (no transfer at all: what P/D must approach);
- `kvduplex-bidirectional`: a P and a D behind the kvduplex proxy, turns
  streamed with no conversation id. Before turn 2, P's prefix cache is reset — P no longer has
  the history, as when another prefill node served turn 1 or P evicted it under load, which is
  when D->P reuse matters: P finds the history on D by the prompt and pulls it;
- `kvduplex-layerwise`: the same with `layerwise_load`: P's pull runs inside the forward pass
  of the new tokens, each layer waiting only for its own blocks;
- `kvduplex-one-way`: the same with `bidirectional_kv_xfer` off: P recomputes the history;
- `nixl-bidirectional`: vLLM's NixlConnector with `bidirectional_kv_xfer` (its settings of
  benches/multiturn.py) behind the same proxy. Its D->P path needs D's `kv_transfer_params`
  on P's request: turn 1 is sent non-streaming with a conversation id (vLLM returns the params
  only there) and the proxy gives them to P on turn 2, streamed; P's prefix cache is reset in
  between as for kvduplex.

By default (`--pin`) P and D are nodes of their own, as on a real P/D pair, whose nodes each
have an accelerator like the single server's: each is pinned (with its engine and worker
processes) to its own half of the CPUs and computes on that half's threads, P on the first
half, D on the second, and the ideal runs on P's half. Then P's prefill is exactly the
ideal's compute, and no server's spin-wait or OpenMP barrier runs on another's core; the
proxy and the client run anywhere. vLLM's NixlConnector re-pins its CPU worker to the last
CPU of each NUMA node, whatever it inherited, so its P and D both compute there.

With `--no-pin` the servers share every CPU: P computes on as many threads as the ideal (the
whole machine) and D on half of them. P and D take turns (conversations run one at a time),
so P's prefill of the new tokens is still the ideal's compute, but D's first step (one token)
runs while P's vLLM worker still spin-waits on the other core (vLLM's shm queue readers
busy-wait with sched_yield for 1 s after each message; D on every core would wait for the
spinner's core at each OpenMP barrier), and that scatters P/D's TTFT (measured: 1.45-2.00x
the ideal unpinned, 0.70-0.98x pinned, on 2 cores).

Between a conversation's turn 1 and turn 2 every system waits `--think` seconds, as a user
reads an answer before writing the next turn. It also lets that spin-wait end: otherwise D's
worker, spinning after turn 1's last token, takes a core from P's prefill.

Every system replays the ideal server's turn-1 answers, so all see the same prompts, and each
turn-2 answer is compared with the ideal's (tokens; logprobs within 1e-2, as servers on
different thread counts round differently). A system whose servers fail is reported with the
conversations it finished (`errors` in the JSON); the others still run. Per point: the median
over the conversations, the turn-2 prompt tokens P (or the ideal) computed and P pulled (the
ideal's prefix cache holds whole blocks only, so it computes the tail of turn 1 past its last
full block again; P pulls D's partial last block too), and kvduplex's breakdown from the
servers' metrics: P's TTFT (lookup + D->P pull + prefill of the new tokens), of which lookup
and pull, and D's TTFT (P->D pull + first step), of which the pull; the rest of the client's
TTFT is HTTP, the proxy and tokenization.

Model: `kvduplex_testing.tiny_model.build_realistic_chat_model` (SmolLM2-360M's shape, random weights;
built on first use, ~1.5 GB). Usage (repository root):
    PYTHONPATH=python .venv/bin/python benches/history_sweep.py --out DIR [--lengths 1024 2048]
writes DIR/history_sweep.json and DIR/history_sweep.png. Exit status 1 if an answer differs or a
kvduplex system fails. `--replot JSON --out DIR` prints a kept run's table and redraws its plot
in DIR (no servers).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvduplex.demo import (
    MetricsSnapshot,
    ProxyThread,
    duplex_kv_transfer_config,
    read_metrics,
    read_metrics_after,
)
from kvduplex.demo.servers import WHOLE_MACHINE_ENV, Completion, ServerError, complete
from kvduplex.demo.tiny_model import VOCAB_SIZE
from kvduplex.proxy.config import CONVERSATION_HEADER
from kvduplex_testing.servers import VllmServer, complete_streamed, start_many
from kvduplex_testing.tiny_model import (
    CHAT_FIRST_WORD_ID,
    REALISTIC_MODEL_CONFIG,
    REALISTIC_SERVED_MODEL_NAME,
    build_realistic_chat_model,
)
from multiturn import NIXL, THINK_S, PdCpus, add_pin_argument, nixl_config, pd_cpus
from nixl_pd_baseline import nixl_pd_envs

logger = logging.getLogger("history_sweep")

IDEAL = "ideal"
BIDIRECTIONAL = "kvduplex-bidirectional"
LAYERWISE = "kvduplex-layerwise"
ONE_WAY = "kvduplex-one-way"
SYSTEMS = (IDEAL, BIDIRECTIONAL, LAYERWISE, ONE_WAY, NIXL)
LOGPROB_ATOL = 1e-2
RECOMPUTE_THRESHOLD = 64
MAX_MODEL_LEN = 8192
# GiB of KV cache per server: a 4k-token history of this model is 320 MiB (80 KiB a token).
KV_CACHE_GIB = "3"


def server_args() -> list[str]:
    return [
        "--dtype", "float32",
        "--enforce-eager",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--seed", "0",
        "--served-model-name", REALISTIC_SERVED_MODEL_NAME,
    ]


def prompt(length: int, seed: int) -> list[int]:
    """`length` word ids of the round-trip tokenizer; its start is unique to `seed`."""
    rng = random.Random(f"history-sweep-{seed}")
    return [rng.randrange(CHAT_FIRST_WORD_ID, VOCAB_SIZE) for _ in range(length)]


Conversation = tuple[int, int]
"""(history length, index): one conversation of the sweep."""


def turn2(turn1: list[int], answer: Completion, key: Conversation, new: int) -> list[int]:
    return turn1 + answer.token_ids + prompt(new, seed=key[0] * 1000 + key[1] + 7)


def reset_prefix_cache(server: VllmServer) -> None:
    """Empty P's prefix cache. Blocks it still holds for a reader that has released them are
    freed at its next engine step, so a one-token request makes it step first."""
    for _ in range(20):
        complete(server.base_url, prompt(4, seed=int(time.time_ns() % 10**9)), 1)
        answer = httpx.post(f"{server.base_url}/reset_prefix_cache", timeout=60).json()
        if answer.get("success"):
            return
        time.sleep(0.5)
    raise ServerError(f"{server.name} did not reset its prefix cache")


def matches(expected: Completion, answer: Completion) -> bool:
    return answer.token_ids == expected.token_ids and all(
        abs(a - b) <= LOGPROB_ATOL for a, b in zip(answer.logprobs, expected.logprobs, strict=True)
    )


def placement(cpus: PdCpus, decode: bool = False) -> tuple[dict[str, str], frozenset[int] | None]:
    """(environment, CPUs) of P (and the ideal, which gets P's) or D (module doc)."""
    if cpus is not None:
        return {}, cpus[1 if decode else 0]  # on as many threads as CPUs (VllmServer)
    return ({} if decode else WHOLE_MACHINE_ENV), None


def run_ideal(make, turns1: dict[Conversation, list[int]], args,
              answers: dict[Conversation, Completion], results: dict) -> None:
    """Turn 1, then turn 2 streamed, on one plain server; its turn-1 answers go into `answers`
    (every system's turn 2 carries them)."""
    with start_many([make(IDEAL, None, *placement(args.cpus))]) as (server,):
        complete(server.base_url, prompt(8, seed=-1), 2)  # first-request costs
        for key, turn1 in turns1.items():
            answers[key] = complete(server.base_url, turn1, args.answer, timeout_s=900)
            ids = turn2(turn1, answers[key], key, args.new)
            time.sleep(args.think)
            before = read_metrics(server.base_url)
            second = complete_streamed(server.base_url, ids, args.answer, timeout_s=900)
            # Its prefix cache holds whole blocks only: the tail of turn 1 past the last full
            # block is computed again (P pulls D's partial last block too).
            computed = read_metrics_after(server.base_url, before, 1).minus(before).computed_tokens
            results[key] = {"ttft_s": second.ttft_s, "answer": second, "computed_tokens": computed}
            logger.info("%s: %d-token prompt, %d computed, turn-2 TTFT %.0f ms",
                        IDEAL, len(ids), computed, second.ttft_s * 1e3)


def pd_servers(system: str, make, cpus: PdCpus) -> list[VllmServer]:
    # /reset_prefix_cache on P; P computes on the ideal's threads (module doc).
    p_env, p_cpus = placement(cpus)
    d_env, d_cpus = placement(cpus, decode=True)
    prefill_env = {"VLLM_SERVER_DEV_MODE": "1", **p_env}
    if system == NIXL:
        nixl_p_env, nixl_d_env = nixl_pd_envs(Path(tempfile.mkdtemp(prefix="history-sweep-nixl-")))
        return [
            make(f"{system}-prefill", nixl_config(None), {**nixl_p_env, **prefill_env}, p_cpus),
            make(f"{system}-decode", nixl_config(None), {**nixl_d_env, **d_env}, d_cpus),
        ]
    bidirectional = system in (BIDIRECTIONAL, LAYERWISE)
    config = duplex_kv_transfer_config(bidirectional=bidirectional, recompute_threshold=RECOMPUTE_THRESHOLD)
    config["kv_connector_extra_config"]["layerwise_load"] = system == LAYERWISE
    return [
        make(f"{system}-prefill", config, prefill_env, p_cpus),
        make(f"{system}-decode", config, d_env, d_cpus),
    ]


def run_pd(system: str, make, turns1, answers, expected, args, results: dict) -> None:
    """Fills `results` conversation by conversation (what was measured survives a failure)."""
    with start_many(pd_servers(system, make, args.cpus)) as (p, d):
        with ProxyThread([p.base_url], [d.base_url]) as proxy:
            complete_streamed(proxy.base_url, prompt(8, seed=-2), 2, timeout_s=900)
            for key, turn1 in turns1.items():
                if system == NIXL:
                    # NIXL's D->P needs D's params on P's request: the proxy keeps them for
                    # the conversation id, from a non-streaming answer.
                    headers = {CONVERSATION_HEADER: f"sweep-{key[0]}-{key[1]}"}
                    complete(proxy.base_url, turn1, args.answer, timeout_s=900, headers=headers)
                else:
                    headers = None
                    complete_streamed(proxy.base_url, turn1, args.answer, timeout_s=900)
                reset_prefix_cache(p)
                ids = turn2(turn1, answers[key], key, args.new)
                time.sleep(args.think)
                p_before, d_before = read_metrics(p.base_url), read_metrics(d.base_url)
                second = complete_streamed(
                    proxy.base_url, ids, args.answer, timeout_s=900, headers=headers
                )
                on_p = read_metrics_after(p.base_url, p_before, 1).minus(p_before)
                on_d = read_metrics_after(d.base_url, d_before, 1).minus(d_before)
                row = breakdown(second, on_p, on_d)
                row["matches_ideal"] = matches(expected[key]["answer"], second)
                results[key] = row
                logger.info("%s: %d-token prompt: %s", system, len(ids), json.dumps(row))


def breakdown(answer: Completion, on_p: MetricsSnapshot, on_d: MetricsSnapshot) -> dict:
    return {
        "ttft_s": answer.ttft_s,
        "p_ttft_s": on_p.mean_ttft_s,
        "lookup_s": on_p.mean_of("lookup_seconds"),
        "d_to_p_transfer_s": on_p.mean_of("transfer_seconds"),
        "d_ttft_s": on_d.mean_ttft_s,
        "p_to_d_transfer_s": on_d.mean_of("transfer_seconds"),
        "computed_tokens": on_p.computed_tokens,
        "p_cache_hit_tokens": on_p.cache_hit_tokens,
        "p_pulled_tokens": on_p.transferred_tokens,
    }


def summarize(results: dict[str, dict], lengths: list[int]) -> dict:
    table: dict[str, dict[int, dict]] = {}
    for system, by_key in results.items():
        table[system] = {}
        for length in lengths:
            rows = [row for key, row in by_key.items() if key[0] == length]
            point: dict[str, Any] = {"conversations": len(rows)}
            for field in ("ttft_s", "p_ttft_s", "lookup_s", "d_to_p_transfer_s", "d_ttft_s",
                          "p_to_d_transfer_s", "computed_tokens", "p_pulled_tokens"):
                values = [r[field] for r in rows if r.get(field) is not None]
                point[field] = statistics.median(values) if values else None
            point["all_match"] = all(r.get("matches_ideal", True) for r in rows)
            table[system][length] = point
    return table


def plot(table: dict, lengths: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system, points in table.items():
        xs = [n for n in lengths if points[n]["ttft_s"] is not None]
        ax.plot(xs, [points[n]["ttft_s"] * 1e3 for n in xs], marker="o", label=system)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")  # recomputation is 10-20x the others: keep their gap visible
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("history before turn 2 (tokens)")
    ax.set_ylabel("turn-2 TTFT, median (ms)")
    shape = REALISTIC_MODEL_CONFIG
    ax.set_title(
        f"Turn-2 TTFT vs history ({shape['num_hidden_layers']}L x {shape['hidden_size']}, "
        "random weights, CPU)"
    )
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def format_table(table: dict, lengths: list[int]) -> str:
    lines = [f"{'system':<24}{'history':>8}{'TTFT ms':>9}{'P ms':>8}{'lookup':>8}{'pull':>7}"
             f"{'D ms':>7}{'D pull':>7}{'comp':>8}{'pulled':>8}  match"]
    for system, points in table.items():
        for n in lengths:
            pt = points[n]

            def ms(key: str) -> str:
                return f"{pt[key] * 1e3:.0f}" if pt.get(key) is not None else "-"

            def count(key: str) -> str:
                return f"{pt[key]:.0f}" if pt.get(key) is not None else "-"

            lines.append(
                f"{system:<24}{n:>8}{ms('ttft_s'):>9}{ms('p_ttft_s'):>8}{ms('lookup_s'):>8}"
                f"{ms('d_to_p_transfer_s'):>7}{ms('d_ttft_s'):>7}{ms('p_to_d_transfer_s'):>7}"
                f"{count('computed_tokens'):>8}"
                f"{count('p_pulled_tokens'):>8}  "
                f"{'-' if not pt['conversations'] else 'yes' if pt['all_match'] else 'NO'}"
            )
    lines.append("")
    for n in lengths:
        ideal = table[IDEAL][n]["ttft_s"]
        bi = table.get(BIDIRECTIONAL, {}).get(n, {}).get("ttft_s")
        layerwise = table.get(LAYERWISE, {}).get(n, {}).get("ttft_s")
        one = table.get(ONE_WAY, {}).get(n, {}).get("ttft_s")
        nixl = table.get(NIXL, {}).get(n, {}).get("ttft_s")
        parts = [f"history {n}:"]
        if ideal and bi:
            parts.append(f"bidirectional / ideal {bi / ideal:.2f}")
        if ideal and layerwise:
            parts.append(f"layerwise / ideal {layerwise / ideal:.2f}")
        if bi and layerwise:
            parts.append(f"layerwise / bidirectional {layerwise / bi:.2f}")
        if one and bi:
            parts.append(f"one-way / bidirectional {one / bi:.2f}")
        if nixl and bi:
            parts.append(f"bidirectional / nixl {bi / nixl:.2f}")
        lines.append(" ".join(parts))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the JSON and PNG")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--conversations", type=int, default=2, help="per history length")
    parser.add_argument("--answer", type=int, default=32, help="tokens per answer")
    parser.add_argument("--new", type=int, default=64, help="new tokens on turn 2")
    parser.add_argument("--think", type=float, default=THINK_S,
                        help="seconds between turn 1's answer and turn 2 (a user reading)")
    add_pin_argument(parser)
    parser.add_argument("--skip", action="append", default=[], choices=SYSTEMS[1:])
    parser.add_argument("--model-dir", type=Path, help="realistic model directory (built if missing)")
    parser.add_argument("--replot", type=Path, metavar="JSON",
                        help="no run: a kept history_sweep.json's table, and its plot in --out")
    args = parser.parse_args()
    if args.replot:
        report = json.loads(args.replot.read_text())
        table = {s: {int(n): pt for n, pt in pts.items()} for s, pts in report["table"].items()}
        args.out.mkdir(parents=True, exist_ok=True)
        plot(table, report["lengths"], args.out / "history_sweep.png")
        print(format_table(table, report["lengths"]))
        return 0
    args.cpus = pd_cpus(parser, args.pin)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if max(args.lengths) + args.answer + args.new > MAX_MODEL_LEN:
        parser.error(f"history + answer + new tokens must fit in {MAX_MODEL_LEN}")
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="history-sweep-", dir=args.out))
    model_dir = build_realistic_chat_model(args.model_dir or args.out / "realistic-model")

    def make(name: str, kv_config: dict | None, env: dict | None = None,
             cpus: frozenset[int] | None = None) -> VllmServer:
        extra = server_args()
        if kv_config is not None:
            extra += ["--kv-transfer-config", json.dumps(kv_config)]
        env = {"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB, **(env or {})}
        return VllmServer(model_dir, name=name, extra_args=extra, env=env, log_dir=log_dir,
                          startup_timeout_s=600, cpus=cpus)

    turns1 = {
        (length, c): prompt(length, seed=length * 100 + c)
        for length in args.lengths
        for c in range(args.conversations)
    }
    answers: dict[Conversation, Completion] = {}
    ideal: dict[Conversation, dict] = {}
    run_ideal(make, turns1, args, answers, ideal)
    results: dict[str, dict] = {IDEAL: ideal}
    errors: dict[str, str] = {}
    for system in SYSTEMS[1:]:
        if system in args.skip:
            continue
        results[system] = {}
        try:
            run_pd(system, make, turns1, answers, ideal, args, results[system])
        except (ServerError, httpx.HTTPError) as exc:
            # Recorded with what it measured before; the other systems still run.
            errors[system] = f"{type(exc).__name__}: {exc}"
            logger.error("%s failed after %d conversations: %s", system, len(results[system]), exc)
    table = summarize(results, args.lengths)
    report = {
        "model": REALISTIC_MODEL_CONFIG,
        "lengths": args.lengths,
        "conversations": args.conversations,
        "answer_tokens": args.answer,
        "new_tokens": args.new,
        "think_s": args.think,
        "pinned": args.pin,
        "logs": str(log_dir),
        "errors": errors,
        "table": {s: {str(n): pt for n, pt in pts.items()} for s, pts in table.items()},
    }
    (args.out / "history_sweep.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(table, args.lengths, args.out / "history_sweep.png")
    print(format_table(table, args.lengths))
    for system, error in errors.items():
        print(f"{system} failed: {error}")
    print(f"wrote {args.out / 'history_sweep.json'} and {args.out / 'history_sweep.png'}")
    ok = all(pt["all_match"] for pts in table.values() for pt in pts.values())
    # A baseline that fails (NixlConnector stalls or dies on this CPU) is reported, not fatal.
    return 0 if ok and errors.keys() <= {NIXL} else 1


if __name__ == "__main__":
    sys.exit(main())
