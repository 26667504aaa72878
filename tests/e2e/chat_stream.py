"""Pieces the chat e2e tests share: a streamed chat turn through the official `openai` SDK, as
a chat UI sends it (text in, text out, plus the token ids and logprobs the tests compare, from
vLLM's `return_token_ids`), and what a server logs and counts per KV-cache group.

`allowed_token_ids` keeps the random-weight chat models from sampling special tokens, which
would not survive detokenize -> retokenize (see `kvduplex_testing.tiny_model.build_tiny_chat_model`).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from conftest import E2E_LOOKUP_TIMEOUT_MS, E2E_PEER_HEARTBEAT_S
from kvduplex.demo import ProxyThread, duplex_kv_transfer_config, metric_samples, sample_sums
from kvduplex.demo.servers import complete
from kvduplex.demo.tiny_model import SERVED_MODEL_NAME, SERVER_ARGS
from kvduplex.protocol import METRIC_PREFIX
from kvduplex.proxy.config import CONVERSATION_HEADER
from kvduplex_testing.servers import VllmServer, prompt_tokens_by_source, start_many
from kvduplex_testing.tiny_model import (
    CHAT_ALLOWED_TOKEN_IDS,
    CHAT_EOS_TOKEN_ID,
    CHAT_RESPONSES_LOGIT_BIAS,
    sample_chat_text,
)

logger = logging.getLogger(__name__)


@dataclass
class Answer:
    prompt_ids: list[int]
    text: str
    token_ids: list[int]
    """Generated ids without a final eos."""
    logprobs: list[float]


def pulled(server: VllmServer, before: dict[str, float]) -> float:
    """Prompt tokens `server` pulled from a peer since its counts were `before`
    (`prompt_tokens_by_source`)."""
    return prompt_tokens_by_source(server.base_url).get("external_kv_transfer", 0) - before.get(
        "external_kv_transfer", 0
    )


def connector_counts(server: VllmServer) -> dict[str, float]:
    """`server`'s kvduplex counters (`vllm:kvduplex_*_total`), each summed over its labels."""
    counts: dict[str, float] = {}
    for sample in metric_samples(server.base_url):
        if sample.name.startswith(METRIC_PREFIX) and sample.name.endswith("_total"):
            key = sample.name.removeprefix(METRIC_PREFIX)
            counts[key] = counts.get(key, 0.0) + sample.value
    return counts


class PullWatch:
    """Around one turn: how many prompt tokens P pulled (`pulled`), and, for an assertion's
    message, every kvduplex counter that moved on P and each D (`report`): a turn that pulled
    nothing says whether its lookup missed, failed, was declined or never asked."""

    def __init__(self, prefill: VllmServer, decodes: Sequence[VllmServer]) -> None:
        self._prefill = prefill
        self._servers = [prefill, *decodes]
        self._before = prompt_tokens_by_source(prefill.base_url)
        self._counts = {server.name: connector_counts(server) for server in self._servers}

    def pulled(self) -> float:
        return pulled(self._prefill, self._before)

    def report(self) -> str:
        moved = {}
        for server in self._servers:
            after = connector_counts(server)
            before = self._counts[server.name]
            moved[server.name] = {
                name: value - before.get(name, 0.0)
                for name, value in after.items()
                if value != before.get(name, 0.0)
            }
        return f"counters moved: {moved}"


def stream_chat(
    base_url: str,
    messages: list[dict],
    max_tokens: int,
    kv_transfer_params: dict | None = None,
    min_tokens: int | None = None,
    stop: list[str] | None = None,
) -> Answer:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=300)
    extra: dict = {"allowed_token_ids": list(CHAT_ALLOWED_TOKEN_IDS), "return_token_ids": True}
    if kv_transfer_params is not None:
        extra["kv_transfer_params"] = kv_transfer_params
    if min_tokens is not None:
        extra["min_tokens"] = min_tokens
    stream = client.chat.completions.create(
        model=SERVED_MODEL_NAME,
        messages=messages,
        stream=True,
        max_tokens=max_tokens,
        stop=stop,
        temperature=0,
        seed=0,
        logprobs=True,
        extra_body=extra,
    )
    prompt_ids: list[int] = []
    text, token_ids, logprobs = "", [], []
    chunks = 0
    for chunk in stream:
        chunks += 1
        prompt_ids = (chunk.model_extra or {}).get("prompt_token_ids") or prompt_ids
        for choice in chunk.choices:
            text += choice.delta.content or ""
            token_ids += (choice.model_extra or {}).get("token_ids") or []
            if choice.logprobs is not None and choice.logprobs.content:
                logprobs += [entry.logprob for entry in choice.logprobs.content]
    # How many chunks carry the tokens is the server's choice: vLLM merges the deltas a slow
    # reader has not taken yet, so on a busy host a whole answer may come in one chunk.
    assert token_ids, f"{chunks} chunks carried no token"
    if token_ids[-1] == CHAT_EOS_TOKEN_ID:
        token_ids, logprobs = token_ids[:-1], logprobs[: len(token_ids) - 1]
    return Answer(prompt_ids, text, token_ids, logprobs[: len(token_ids)])


def respond(
    base_url: str,
    messages: list[dict],
    max_output_tokens: int,
    *,
    stream: bool,
    conversation_id: str | None = None,
) -> str:
    """One turn through `/v1/responses` with the official SDK: the conversation so far as
    `input` (the first system message as `instructions`), greedy; returns the answer's text.
    The final response must not carry D's `kv_transfer_params` (a proxy strips them)."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=300)
    headers = {CONVERSATION_HEADER: conversation_id} if conversation_id else None
    system, *rest = messages
    kwargs = dict(
        model=SERVED_MODEL_NAME,
        instructions=system["content"],
        input=rest,
        max_output_tokens=max_output_tokens,
        temperature=0,
        extra_headers=headers,
        # Only ids whose text round-trips (a skipped special token would leave the next
        # turn's prompt other than the held turn's tokens: nothing to pull).
        extra_body={"logit_bias": CHAT_RESPONSES_LOGIT_BIAS},
    )
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))
        completed = [e for e in events if e.type == "response.completed"]
        assert len(completed) == 1, [e.type for e in events]
        response = completed[0].response
        streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert streamed == response.output_text
    else:
        response = client.responses.create(**kwargs)
    assert (response.model_extra or {}).get("kv_transfer_params") is None
    return response.output_text


GROUPS_LINE = "kv cache group sizes"
HMA_OFF = "Turning off hybrid kv cache manager"


def kv_cache_groups_line(server: VllmServer) -> str:
    """The KV-cache groups vLLM logged at start (their block sizes)."""
    lines = [
        line
        for line in server.log_path.read_text(errors="replace").splitlines()
        if GROUPS_LINE in line
    ]
    assert lines, f"{server.name} logged no KV-cache groups"
    return lines[-1].split(GROUPS_LINE, 1)[1].strip()


def group_counters(server: VllmServer, name: str) -> dict[str, float]:
    """`vllm:kvduplex_<name>_total` per KV-cache group, from the server's /metrics."""
    return sample_sums(server.base_url, f"{METRIC_PREFIX}{name}_total", "kv_cache_group", 30.0)


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before.get(key, 0.0) for key in after}


def pulls_per_group(servers: Servers) -> dict[tuple[str, str], dict[str, float]]:
    """P's and D's `group_blocks` and `group_bytes` counters per KV-cache group
    (`group_counters`), by (server name, counter)."""
    return {
        (server.name, name): group_counters(server, name)
        for server in (servers.prefill, servers.decode)
        for name in ("group_blocks", "group_bytes")
    }


@dataclass
class Servers:
    reference: VllmServer
    """No connector: its answers are the expected ones."""
    prefill: VllmServer
    decode: VllmServer


@contextmanager
def reference_and_pair(
    model_dir: Path, prefix: str, log_dir: Path, server_args: Sequence[str] = SERVER_ARGS
) -> Iterator[Servers]:
    """A plain server and a bidirectional DuplexConnector P/D pair of `model_dir`."""

    def server(name: str, kv: bool) -> VllmServer:
        config = duplex_kv_transfer_config(bidirectional=True, recompute_threshold=16)
        config["kv_connector_extra_config"]["lookup_timeout_ms"] = E2E_LOOKUP_TIMEOUT_MS
        config["kv_connector_extra_config"]["peer_heartbeat_s"] = E2E_PEER_HEARTBEAT_S
        extra = [*server_args, "--kv-transfer-config", json.dumps(config)] if kv else server_args
        return VllmServer(model_dir, name=f"{prefix}-{name}", extra_args=extra, log_dir=log_dir)

    group = [server("reference", False), server("prefill", True), server("decode", True)]
    with start_many(group) as (reference, prefill, decode):
        yield Servers(reference, prefill, decode)


@dataclass
class ChatTurn:
    """One turn of `chat_through_proxy`: the single server's answer and the P/D pair's, with
    P's and D's prompt tokens by source (vLLM's counters) during the pair's turn."""

    number: int
    expected: Answer
    answer: Answer
    on_p: dict[str, float]
    on_d: dict[str, float]
    previous: Answer | None
    """The turn before's expected answer (None on the first turn)."""


def chat_through_proxy(
    servers: Servers,
    messages: list[dict],
    turns: int,
    max_tokens: int,
    seed: int,
    logprob_atol: float,
) -> Iterator[ChatTurn]:
    """A streamed chat through `kvduplex proxy` over the pair, the same messages also sent to
    the reference: each turn adds a 40-word user message (from `seed`), and the pair's answer
    as the assistant's. Checks that the history round-trips (the next prompt starts with the
    turn before's prompt and answer ids) and that every answer is the reference's (the same
    tokens, logprobs within `logprob_atol`)."""
    with ProxyThread([servers.prefill.base_url], [servers.decode.base_url]) as proxy:
        previous: Answer | None = None
        for number in range(1, turns + 1):
            messages.append({"role": "user", "content": sample_chat_text(40, seed=seed + number)})
            expected = stream_chat(servers.reference.base_url, messages, max_tokens)
            if previous is not None:
                history = previous.prompt_ids + previous.token_ids
                assert expected.prompt_ids[: len(history)] == history, f"turn {number}: no round trip"
            p_before = prompt_tokens_by_source(servers.prefill.base_url)
            d_before = prompt_tokens_by_source(servers.decode.base_url)
            answer = stream_chat(proxy.base_url, messages, max_tokens)
            on_p = delta(prompt_tokens_by_source(servers.prefill.base_url), p_before)
            on_d = delta(prompt_tokens_by_source(servers.decode.base_url), d_before)
            prompt = len(expected.prompt_ids)
            logger.info("turn %d: %d prompt tokens; P %s; D %s", number, prompt, on_p, on_d)
            assert answer.token_ids == expected.token_ids, f"turn {number}: tokens differ"
            assert answer.logprobs == pytest.approx(expected.logprobs, abs=logprob_atol)
            yield ChatTurn(number, expected, answer, on_p, on_d, previous)
            previous = expected
            messages.append({"role": "assistant", "content": answer.text})


@dataclass
class EditedTurn:
    first: Answer
    """The pair's 200-token answer to the first question."""
    expected: Answer
    answer: Answer
    on_p: dict[str, float]
    """P's prompt tokens by source on the edited turn."""


def edited_history_turn(servers: Servers, seed: int, max_tokens: int) -> EditedTurn:
    """Through the proxy: a 300-word system message and a 40-word question answered in 200
    tokens; then the next turn, whose history has that answer's last 3 words edited, sent to
    the reference and to the pair. Seeds `seed` and `10 * seed + 0..2`."""
    messages = [
        {"role": "system", "content": sample_chat_text(300, seed=seed)},
        {"role": "user", "content": sample_chat_text(40, seed=10 * seed)},
    ]
    with ProxyThread([servers.prefill.base_url], [servers.decode.base_url]) as proxy:
        # A long answer: D's turn holds whole blocks that P never computed.
        first = stream_chat(proxy.base_url, messages, 200, min_tokens=200)
        words = first.text.split()
        edited = " ".join(words[:-3] + sample_chat_text(3, seed=10 * seed + 1).split())
        messages += [
            {"role": "assistant", "content": edited},
            {"role": "user", "content": sample_chat_text(40, seed=10 * seed + 2)},
        ]
        expected = stream_chat(servers.reference.base_url, messages, max_tokens)
        before = prompt_tokens_by_source(servers.prefill.base_url)
        answer = stream_chat(proxy.base_url, messages, max_tokens)
        on_p = delta(prompt_tokens_by_source(servers.prefill.base_url), before)
    return EditedTurn(first, expected, answer, on_p)


def assert_hybrid_manager_kept(servers: Servers) -> None:
    """P and D kept vLLM's hybrid KV-cache manager with the connector: neither logged turning it
    off, and each has the KV-cache groups of the server without the connector."""
    for server in (servers.prefill, servers.decode):
        log = server.log_path.read_text(errors="replace")
        assert HMA_OFF not in log, f"{server.name}: vLLM turned the hybrid manager off"
        assert kv_cache_groups_line(server) == kv_cache_groups_line(servers.reference)


def token_prompt_through_proxy(
    servers: Servers, num_tokens: int, logprob_atol: float
) -> tuple[dict[str, float], dict[str, float]]:
    """A prompt of `num_tokens` random token ids (seeded by its length) answered in 4 tokens
    through the proxy over the pair as the reference answers it (the same tokens, logprobs
    within `logprob_atol`): P's and D's prompt tokens by source for it."""
    rng = random.Random(num_tokens)
    prompt = [1] + [rng.randrange(7, 1024) for _ in range(num_tokens - 1)]
    expected = complete(servers.reference.base_url, prompt, max_tokens=4)
    with ProxyThread([servers.prefill.base_url], [servers.decode.base_url]) as proxy:
        p_before = prompt_tokens_by_source(servers.prefill.base_url)
        d_before = prompt_tokens_by_source(servers.decode.base_url)
        got = complete(proxy.base_url, prompt, max_tokens=4)
        on_p = delta(prompt_tokens_by_source(servers.prefill.base_url), p_before)
        on_d = delta(prompt_tokens_by_source(servers.decode.base_url), d_before)
    assert got.token_ids == expected.token_ids
    assert got.logprobs == pytest.approx(expected.logprobs, abs=logprob_atol)
    return on_p, on_d


def first_tokens_by_source(proxy_url: str) -> dict[str, float]:
    """`kvduplex proxy`'s streamed answers by where their first token came from (prefill: sent
    as soon as P answered; decode: computed again by D), from its /metrics."""
    return sample_sums(proxy_url, "kvduplex_proxy_first_tokens_total", "source")
