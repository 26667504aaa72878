"""Which D serves a request when no conversation entry names one: a stable routing key per
conversation and rendezvous (highest-random-weight) hashing over the decode servers.

The key is a hash of who asks (the caller's digest), the `model` and the start of the
conversation, which every later turn repeats unchanged. So all turns of a conversation land on
the same D, whose own prefix cache then holds the history P sends it, and whose held turns P
finds by their token fingerprints. Nothing is shared between proxy replicas: every replica with
the same decode servers computes the same key and the same choice. Rendezvous hashing needs no
ring or table, ignores the order the servers are listed in, and when a D leaves only the
conversations it had move (each to its own second choice); the others stay where they are.

Hashes are blake2b: Python's `hash()` is salted per process and would differ between replicas.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

# Of a /v1/completions prompt only the start is hashed. The prompt is the whole rendered
# history, and later turns only append to it, so any prefix of the first turn's prompt is also
# the start of every later one. The prefix must be long enough to get past what many
# conversations share (a chat template header, an application's fixed preamble), or they would
# all hash alike and land on one D; and short enough that a first turn usually has that much
# already: while a prompt is shorter than this its key changes with every turn, so such a
# conversation may move once, after its first turn, and then stays. 512 characters are about
# 100 to 150 tokens. Prompts given as token ids use the same budget in ids.
COMPLETION_PREFIX_CHARS = 512
COMPLETION_PREFIX_TOKENS = 128
# Roles whose first message opens a chat conversation alongside the first user message.
_SYSTEM_ROLES = ("system", "developer")
_KEY_VERSION = 1


def _prompt_start(prompt: Any) -> Any:
    """The start of a completions prompt: text, token ids, or the first of a batch of either."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt[:COMPLETION_PREFIX_CHARS]
    if isinstance(prompt, list):
        return prompt[:COMPLETION_PREFIX_TOKENS]
    return None


def _chat_start(messages: Any) -> dict[str, Any]:
    """The first system (or developer) message, if any, and the first user message."""
    start: dict[str, Any] = {"system": None, "user": None}
    if not isinstance(messages, list):
        return start
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        if role in _SYSTEM_ROLES and start["system"] is None:
            start["system"] = message
        elif role == "user" and start["user"] is None:
            start["user"] = message
        if start["user"] is not None:
            # A system message after the first user message is part of the history, not of
            # how the conversation began.
            break
    return start


def conversation_key(caller: str, body: dict[str, Any]) -> bytes:
    """The routing key of the conversation `body` (a completions, chat or responses request)
    belongs to."""
    if "messages" in body:
        start: Any = {"chat": _chat_start(body.get("messages"))}
    elif "input" in body:
        # /v1/responses: `instructions` play the system message's part; `input` is a text
        # (whose start is hashed as a prompt's) or a list of items, messages among them.
        given = body.get("input")
        opening = _chat_start(given) if isinstance(given, list) else _prompt_start(given)
        start = {"responses": {"instructions": body.get("instructions"), "input": opening}}
    else:
        start = {"prompt": _prompt_start(body.get("prompt"))}
    canonical = json.dumps(
        {"v": _KEY_VERSION, "caller": caller, "model": body.get("model"), "start": start},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.blake2b(canonical.encode(), digest_size=16).digest()


def rendezvous_score(key: bytes, address: str) -> int:
    """The weight of server `address` for `key`; the server with the highest weight wins."""
    digest = hashlib.blake2b(address.encode(), digest_size=8, key=key).digest()
    return int.from_bytes(digest, "big")
