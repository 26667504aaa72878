"""The generation routes the proxy serves, the request fields of each that bound the tokens it
generates (P's leg sets each to one; a stream continued after P's first token asks D for one
less), the field that carries `kv_transfer_params` both ways, and P's leg of a request."""

from __future__ import annotations

from typing import Any

from ..protocol import DO_REMOTE_DECODE, DO_REMOTE_PREFILL, prefill_request_params

# The request and response field of vLLM's OpenAI server that carries kv_transfer_params.
PARAMS_FIELD = "kv_transfer_params"

COMPLETIONS_ROUTE = "/v1/completions"
CHAT_ROUTE = "/v1/chat/completions"
RESPONSES_ROUTE = "/v1/responses"

MAX_TOKENS_FIELDS = {
    COMPLETIONS_ROUTE: ("max_tokens",),
    CHAT_ROUTE: ("max_tokens", "max_completion_tokens"),
    RESPONSES_ROUTE: ("max_output_tokens",),
}

# Request fields that make no sense for the one-token prefill step (vLLM rejects stream_options
# without stream and min_tokens above max_tokens; extra choices would only waste P's compute;
# a first token streamed from P brings back what it needs, `first_token.prefill_fields`).
_PREFILL_DROPPED_FIELDS = ("stream_options", "min_tokens", "n", "best_of")


def prefill_body(
    route: str, body: dict[str, Any], pull_params: dict[str, Any] | None
) -> dict[str, Any]:
    """P computes the prompt's KV and keeps it for D. With D's params from the previous turn it
    first pulls the history's KV from D (the connector checks the blocks' token fingerprints)."""
    prefill = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED_FIELDS}
    first, *others = MAX_TOKENS_FIELDS[route]
    prefill[first] = 1
    for field in others:
        if field in prefill:
            prefill[field] = 1
    prefill["stream"] = False
    if route == RESPONSES_ROUTE:
        # P's one-token answer is not the conversation's: nothing of it is stored.
        prefill["store"] = False
    if pull_params is None:
        params = prefill_request_params()
    else:
        params = dict(pull_params)
        params[DO_REMOTE_DECODE] = True
        params[DO_REMOTE_PREFILL] = False
    prefill[PARAMS_FIELD] = params
    return prefill
