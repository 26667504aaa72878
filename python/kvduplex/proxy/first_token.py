"""A streamed answer's first token from P: the caller gets it as soon as P's prefill answered,
and D continues after it.

P's one-token prefill already samples the answer's first token, from the whole prompt and the
caller's sampling parameters. The proxy streams that token to the caller at once and sends D the
prompt's token ids followed by it (chat: vLLM's `kv_transfer_params["prompt_token_ids"]`, which
skips D's template rendering and tokenization; completions: a token-id prompt), with one token
less to generate. D pulls the prompt's KV from P as before and computes the first token's KV
itself, so the answer is the one D alone would have continued: P/D time to first token is P's
prefill, not P's prefill and D's first step.

Only where this cannot change an answer: a single streamed choice of chat or completions without
stop strings (one could span the first token and the next), structured output or tools (their
state would start after the first token), echo, prompt logprobs, or seeded sampling (a seed
reproduces one server's draws only when one engine draws them all), and at least two tokens to
generate. At P's answer it must also hold that P computed the whole prompt (a model with a
state-space group stops one token short, `DuplexConnector._stop_prefill_short`) and that the
first token did not end the answer; otherwise D gets the caller's request unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..protocol import REMOTE_NUM_TOKENS
from .routes import CHAT_ROUTE, COMPLETIONS_ROUTE, MAX_TOKENS_FIELDS

_STRUCTURED_FIELDS = (
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
)


def ineligible_reason(route: str, body: dict[str, Any]) -> str | None:
    """Why a request's first token must come from D (None: P's may be streamed first)."""
    if body.get("stream") is not True:
        return "not_streamed"
    if route not in (CHAT_ROUTE, COMPLETIONS_ROUTE):
        return "route"
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return "several_choices"
    if body.get("stop"):
        return "stop_strings"
    if body.get("echo") or body.get("prompt_logprobs"):
        return "echo"
    if body.get("tools") and body.get("tool_choice") != "none":
        return "tools"
    response_format = body.get("response_format")
    if any(body.get(field) is not None for field in _STRUCTURED_FIELDS) or (
        isinstance(response_format, dict) and response_format.get("type") not in (None, "text")
    ):
        return "structured_output"
    if body.get("seed") is not None and body.get("temperature") != 0:
        return "seeded_sampling"
    limits = [body.get(field) for field in MAX_TOKENS_FIELDS[route]]
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 2 for v in limits if v is not None):
        return "one_token"
    if route == COMPLETIONS_ROUTE and not _single_prompt(body.get("prompt")):
        return "several_prompts"
    return None


def _single_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    if isinstance(prompt, list) and len(prompt) == 1:
        return isinstance(prompt[0], str) or _token_ids(prompt[0]) is not None
    return _token_ids(prompt) is not None


def _token_ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and value and all(type(x) is int and x >= 0 for x in value):
        return value
    return None


def prefill_fields(body: dict[str, Any]) -> dict[str, Any]:
    """What P's one-token request adds for an eligible request: the token ids of its prompt and
    answer, and the caller's `min_tokens` as far as the first token (an end-of-sequence token
    must not be sampled where the caller forbade it)."""
    fields: dict[str, Any] = {"return_token_ids": True}
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and not isinstance(min_tokens, bool) and min_tokens > 0:
        fields["min_tokens"] = 1
    return fields


@dataclasses.dataclass(frozen=True)
class FirstToken:
    """P's first token of the answer and what the caller's stream needs of P's answer."""

    route: str
    token_id: int
    prompt_token_ids: list[int]
    response_id: str
    created: int
    model: str
    text: str
    logprobs: Any


def first_token(
    route: str, answer: Any, params: dict[str, Any] | None
) -> tuple[FirstToken | None, str | None]:
    """P's sampled token if the stream may start with it, else (None, why not). `answer` is P's
    parsed JSON response, `params` its `kv_transfer_params`."""
    if not isinstance(params, dict):
        return None, "no_params"
    if not isinstance(answer, dict):
        return None, "malformed"
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None, "malformed"
    choice = choices[0]
    if choice.get("finish_reason") != "length":
        return None, "answer_ended"
    token_ids = _token_ids(choice.get("token_ids"))
    prompt_ids = _token_ids(
        answer.get("prompt_token_ids") if route == CHAT_ROUTE else choice.get("prompt_token_ids")
    )
    if token_ids is None or len(token_ids) != 1 or prompt_ids is None:
        return None, "no_token_ids"
    if params.get(REMOTE_NUM_TOKENS) != len(prompt_ids):
        # P computed less than the prompt (a state-space group stops one token short): its
        # token is not the answer's.
        return None, "prompt_not_computed"
    if route == CHAT_ROUTE:
        message = choice.get("message")
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            return None, "not_plain_content"
        if message.get("tool_calls") or any(
            message.get(field) for field in ("reasoning", "reasoning_content")
        ):
            return None, "not_plain_content"
        text = message["content"]
    else:
        text = choice.get("text")
        if not isinstance(text, str):
            return None, "malformed"
    response_id, created, model = answer.get("id"), answer.get("created"), answer.get("model")
    if (
        not isinstance(response_id, str)
        or not isinstance(created, int)
        or not isinstance(model, str)
    ):
        return None, "malformed"
    found = FirstToken(
        route, token_ids[0], prompt_ids, response_id, created, model, text, choice.get("logprobs")
    )
    return found, None


def decode_body(
    body: dict[str, Any], first: FirstToken, params: dict[str, Any], params_field: str
) -> dict[str, Any]:
    """The caller's request as D continues it after `first`: the prompt's token ids and the
    first token as D's prompt, one token less to generate."""
    decode = dict(body)
    for field in MAX_TOKENS_FIELDS[first.route]:
        if decode.get(field) is not None:
            decode[field] -= 1
    if isinstance(decode.get("min_tokens"), int) and decode["min_tokens"] > 0:
        decode["min_tokens"] -= 1
    ids = [*first.prompt_token_ids, first.token_id]
    params = dict(params)
    if first.route == CHAT_ROUTE:
        params["prompt_token_ids"] = ids
    else:
        decode["prompt"] = ids
    decode[params_field] = params
    return decode


def first_chunk(first: FirstToken, body: dict[str, Any]) -> dict[str, Any]:
    """The stream's first event, in the shape D's server would have sent for this token."""
    wants_ids = body.get("return_token_ids") is True
    choice: dict[str, Any] = {"index": 0, "logprobs": first.logprobs, "finish_reason": None}
    event: dict[str, Any] = {"id": first.response_id, "created": first.created}
    if first.route == CHAT_ROUTE:
        event["object"] = "chat.completion.chunk"
        choice["delta"] = {"role": "assistant", "content": first.text}
        if wants_ids:
            event["prompt_token_ids"] = first.prompt_token_ids
    else:
        event["object"] = "text_completion"
        choice["text"] = first.text
        choice["stop_reason"] = None
        if wants_ids:
            choice["prompt_token_ids"] = first.prompt_token_ids
    if wants_ids:
        choice["token_ids"] = [first.token_id]
    event["model"] = first.model
    event["choices"] = [choice]
    options = body.get("stream_options")
    if (
        isinstance(options, dict)
        and options.get("include_usage")
        and options.get("continuous_usage_stats")
    ):
        prompt = len(first.prompt_token_ids)
        event["usage"] = {
            "prompt_tokens": prompt,
            "completion_tokens": 1,
            "total_tokens": prompt + 1,
        }
    return event


class ContinuationRewriter:
    """Rewrites D's stream events into the continuation of the first event: one response id,
    no second role or prompt (already sent), usage counted as the caller's request (D's prompt
    holds the first token; the caller's answer does), completions' text offsets after the
    first token's text. Returns None for an event left with nothing to say."""

    def __init__(self, first: FirstToken):
        self._first = first
        self._offset = len(first.text)

    def __call__(self, event: dict[str, Any]) -> dict[str, Any] | None:
        if "id" in event:
            event["id"] = self._first.response_id
        event.pop("prompt_token_ids", None)
        event.pop("prompt_text", None)
        usage = event.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("prompt_tokens"), int):
                usage["prompt_tokens"] -= 1
            if isinstance(usage.get("completion_tokens"), int):
                usage["completion_tokens"] += 1
        choices = event.get("choices")
        if not isinstance(choices, list):
            return event
        kept = []
        for choice in choices:
            if not isinstance(choice, dict) or not self._rewrite_choice(choice):
                kept.append(choice)
        if choices and not kept and usage is None:
            return None
        event["choices"] = kept
        return event

    def _rewrite_choice(self, choice: dict[str, Any]) -> bool:
        """Rewrites one choice in place; True when it says nothing and is dropped."""
        choice.pop("prompt_token_ids", None)
        delta = choice.get("delta")
        if isinstance(delta, dict):
            delta.pop("role", None)
            empty = not any(delta.values())
        else:
            empty = not choice.get("text")
            logprobs = choice.get("logprobs")
            offsets = logprobs.get("text_offset") if isinstance(logprobs, dict) else None
            if isinstance(offsets, list):
                logprobs["text_offset"] = [
                    o + self._offset if isinstance(o, int) else o for o in offsets
                ]
        return (
            empty
            and not choice.get("token_ids")
            and choice.get("logprobs") is None
            and choice.get("finish_reason") is None
        )
