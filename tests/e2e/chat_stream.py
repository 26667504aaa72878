"""A streamed chat turn through the official `openai` SDK, as a chat UI sends it: text in,
text out, plus the token ids and logprobs the tests compare (vLLM's `return_token_ids`).

`allowed_token_ids` keeps the random-weight chat models from sampling special tokens, which
would not survive detokenize -> retokenize (see `kvduplex.tiny_model.build_tiny_chat_model`).
"""

from __future__ import annotations

from dataclasses import dataclass

import openai

from kvduplex.tiny_model import CHAT_ALLOWED_TOKEN_IDS, CHAT_EOS_TOKEN_ID, SERVED_MODEL_NAME


@dataclass
class Answer:
    prompt_ids: list[int]
    text: str
    token_ids: list[int]
    """Generated ids without a final eos."""
    logprobs: list[float]


def stream_chat(
    base_url: str,
    messages: list[dict],
    max_tokens: int,
    kv_transfer_params: dict | None = None,
    min_tokens: int | None = None,
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
