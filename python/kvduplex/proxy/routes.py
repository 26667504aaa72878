"""The generation routes the proxy serves, and the request fields of each that bound the tokens
it generates (P's leg sets each to one; a stream continued after P's first token asks D for
one less)."""

from __future__ import annotations

COMPLETIONS_ROUTE = "/v1/completions"
CHAT_ROUTE = "/v1/chat/completions"
RESPONSES_ROUTE = "/v1/responses"

MAX_TOKENS_FIELDS = {
    COMPLETIONS_ROUTE: ("max_tokens",),
    CHAT_ROUTE: ("max_tokens", "max_completion_tokens"),
    RESPONSES_ROUTE: ("max_output_tokens",),
}
