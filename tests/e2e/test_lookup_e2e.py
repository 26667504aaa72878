"""P finds a finished turn's KV on D by the prompt itself: streaming, no conversation id, and a
router that relays only vLLM's standard P/D params.

The router here is the smallest one a vLLM P/D deployment has: P gets `do_remote_decode` and
`max_tokens=1`, D gets P's params and the client's request, and the client's stream is passed
through; D's final params are never seen (vLLM 0.32 sends none when streaming). On turn 2, P
has only its own prefix cache and whatever its lookup finds on D. Prompts are token ids, so the
history is exactly turn 1's prompt and answer; outputs are compared with a single server.

Shares the P/D pair of test_connector_e2e.py (same config: lookups are on by default with
bidirectional transfer).
"""

from __future__ import annotations

import logging

import openai
import pytest

from kvduplex.demo.servers import Completion, complete, describe_mismatch
from kvduplex.demo.tiny_model import SERVED_MODEL_NAME
from kvduplex.protocol import prefill_request_params
from kvduplex_testing.servers import ServerPair, prompt_tokens_by_source
from test_connector_e2e import BLOCK, KV_TRANSFER_CONFIG, counter, token_prompt, tokenizer  # noqa: F401

logger = logging.getLogger(__name__)

TURN1_TOKENS = 2 * BLOCK + 100
TURN1_ANSWER = 100
NEW_TOKENS = 60


@pytest.fixture(scope="module")
def pair(pd_pair) -> ServerPair:
    return pd_pair(KV_TRANSFER_CONFIG)


def stream_completion(
    base_url: str, prompt: list[int], max_tokens: int, kv_transfer_params: dict | None = None
) -> Completion:
    """`prompt` answered in `max_tokens` tokens (greedy, eos ignored, top-5 logprobs), streamed
    from `base_url` with the openai SDK; token ids from the logprob tokens."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=300)
    extra: dict = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    if kv_transfer_params is not None:
        extra["kv_transfer_params"] = kv_transfer_params
    stream = client.completions.create(
        model=SERVED_MODEL_NAME,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        seed=0,
        logprobs=5,
        stream=True,
        extra_body=extra,
    )
    token_ids: list[int] = []
    logprobs: list[float] = []
    top: list[dict[int, float]] = []
    chunks = 0
    for chunk in stream:
        chunks += 1
        for choice in chunk.choices:
            if choice.logprobs is None:
                continue
            for token, lp, alternatives in zip(
                choice.logprobs.tokens, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs
            ):
                token_ids.append(int(token.partition(":")[2]))
                logprobs.append(float(lp))
                top.append({int(t.partition(":")[2]): float(v) for t, v in alternatives.items()})
    # How many chunks carry the tokens is the server's choice: vLLM merges the deltas a slow
    # reader has not taken yet, so a short answer on a busy host may come in one chunk.
    assert len(token_ids) == max_tokens, f"{chunks} chunks carried {len(token_ids)} tokens"
    return Completion(
        text="",
        token_ids=token_ids,
        prompt_token_ids=list(prompt),
        logprobs=logprobs,
        top_logprobs=top,
        finish_reason="length",
        kv_transfer_params=None,
        elapsed_s=0.0,
    )


def relay_streamed(pair: ServerPair, prompt: list[int], max_tokens: int) -> tuple[Completion, dict]:
    """One turn through a standard-params router, D's answer streamed with the openai SDK.
    Returns the completion and P's prompt-token counts by source for this turn."""
    before = prompt_tokens_by_source(pair.prefill.base_url)
    prefill = complete(
        pair.prefill.base_url, prompt, max_tokens=1, kv_transfer_params=prefill_request_params()
    )
    after = prompt_tokens_by_source(pair.prefill.base_url)
    on_p = {key: after.get(key, 0) - before.get(key, 0) for key in after}
    completion = stream_completion(
        pair.decode.base_url, prompt, max_tokens, prefill.kv_transfer_params
    )
    return completion, on_p


@pytest.mark.e2e
def test_streamed_turns_without_conversation_id_pull_the_history_back_from_decode(
    pair, reference_server, tokenizer  # noqa: F811
):
    hits_before = counter(pair.prefill.base_url, "vllm:kvduplex_lookups_hit_total")
    turn1 = token_prompt(tokenizer, TURN1_TOKENS, seed=21)
    first, _ = relay_streamed(pair, turn1, TURN1_ANSWER)
    expected1 = complete(reference_server.base_url, turn1, TURN1_ANSWER)
    assert describe_mismatch(expected1, first) is None

    history = turn1 + first.token_ids
    turn2 = history + token_prompt(tokenizer, NEW_TOKENS, seed=22)
    second, on_p = relay_streamed(pair, turn2, 8)
    expected2 = complete(reference_server.base_url, turn2, 8)
    assert describe_mismatch(expected2, second) is None
    # D holds turn 1's prompt and answer but the last answer token (455 tokens); P's own cache
    # has 2 blocks of turn 1's prompt. P pulls the rest of the history and computes only the
    # new tokens (and the answer's last token, which D never computed).
    d_held = TURN1_TOKENS + TURN1_ANSWER - 1
    logger.info("turn 2 (%d tokens) on P: %s", len(turn2), on_p)
    assert on_p.get("external_kv_transfer", 0) == d_held - 2 * BLOCK
    assert on_p.get("local_compute", 0) == len(turn2) - d_held
    assert counter(pair.prefill.base_url, "vllm:kvduplex_lookups_hit_total") - hits_before >= 1

    # A caller with another cache_salt finds nothing: P computes the whole prompt.
    before = prompt_tokens_by_source(pair.prefill.base_url)
    complete(
        pair.prefill.base_url, turn2, max_tokens=1,
        kv_transfer_params=prefill_request_params(), cache_salt="another tenant",
    )
    after = prompt_tokens_by_source(pair.prefill.base_url)
    assert after.get("external_kv_transfer", 0) == before.get("external_kv_transfer", 0)
    assert after.get("local_compute", 0) - before.get("local_compute", 0) == len(turn2)
