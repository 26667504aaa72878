"""Local continuations: a chat's next turn is computed on the decode server that served the
turn before it, prefill and all, when that server still holds the history and what the turn
adds to it is short.

A decode server with `bidirectional_kv_xfer` keeps each finished turn (its prompt and the
answer its client saw) for the conversation's next turn. That turn's prompt repeats the
history and appends a few messages. Prefilling it on P means a lookup, a pull of the answer's
blocks back from D, P's prefill of the new messages and D's pull of them again; computing it on
the D that holds the history means D's prefix cache finds the history, and D prefills the new
messages alone in its next step, beside the answers it is decoding. For a short addition that
is the cheaper path, and it spreads the prefill work over P and D. A long addition (a pasted
document) still goes to P, which keeps long prefills off the decoding server, and pulls the
history back from D.

The proxy knows which D served which history without any tokenizer: for every chat turn a D
answered whole it records a digest of the conversation so far (the caller, the fields that
shape the rendered prompt, and each message in order; `TurnLedger.served`); a non-streamed
answer must also offer the held turn. A new request is a continuation of such a turn when a
prefix of its messages, ending before an assistant message, has a recorded digest, the rest of
its messages (the answer D computed included, roles and other fields counted) carry no more
than `max_chars` characters, and that D is in rotation and has not been taken out since. What
D then computes is bounded by that rest while it still holds the turn; if it gave the turn up
early (memory pressure), its prefix cache still has whatever blocks were not reused, and the
rest is recomputed there, as a single server would. A recorded turn expires after the proxy's
conversation TTL, which stays below D's hold lease.

Only chat completions with text messages are continued locally; completions, responses and
multimodal messages take the P/D path. The request to D carries `KEEP_TURN`, so D keeps the
turn it computes for the turn after it.

When a continuation goes to D is the proxy's `local_continuation_when` (`why_not_local`): `always`,
or `prefill_busy`, only while every P in rotation has a prefill in flight (the turn would queue
behind it) and that D computes no other turn alone (a streamed one whose first chunk has not come
back, a non-streamed one whose answer has not): an idle P prefills the turn, a busy one passes
it to a D whose core is free of prefills.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
from collections.abc import Callable
from typing import Any

from ..protocol import KEEP_TURN, PROTOCOL_KEY, PROTOCOL_VERSION
from .config import LOCAL_ALWAYS
from .routes import CHAT_ROUTE

# Request fields besides the messages that change the prompt a chat is rendered into: a turn
# whose fields differ from the recorded one is not its continuation (D's cache would not hold
# what it renders to).
PROMPT_FIELDS = (
    "model",
    "tools",
    "tool_choice",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
    "reasoning_effort",
    "truncate_prompt_tokens",
    "mm_processor_kwargs",
    # A different salt is a different cache: never the history another salt's turn left.
    "cache_salt",
)
# A chat with more messages than this is not continued locally (its digests cost more than a
# prefill on P saves).
MAX_MESSAGES = 4096
_DIGEST_BYTES = 16
_KEY_VERSION = 1
# ASCII output: a lone surrogate in a message is escaped, not an encoding error.
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"))


def _canonical(value: Any) -> bytes:
    return _ENCODER.encode(value).encode()


def _text_chars(message: Any) -> int | None:
    """Characters of a message's text, or None when it is not a text message (an image, audio,
    anything but a dict whose content is a string or a list of text parts)."""
    if not isinstance(message, dict):
        return None
    content = message.get("content")
    if content is None or isinstance(content, str):
        chars = len(content or "")
    elif isinstance(content, list):
        chars = 0
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                return None
            text = part.get("text")
            if not isinstance(text, str):
                return None
            chars += len(text)
    else:
        return None
    # The role, tool calls and other fields are rendered too: count them as text.
    rest = {k: v for k, v in message.items() if k != "content"}
    return chars + len(_canonical(rest))


@dataclasses.dataclass(frozen=True)
class Turn:
    """A chat request as the ledger sees it: the digest of its messages' every prefix (index k
    covers messages[:k]; index 0 the caller and prompt fields alone), each message's role and
    text size."""

    digests: tuple[bytes, ...]
    roles: tuple[Any, ...]
    chars: tuple[int, ...]

    @property
    def whole(self) -> bytes:
        return self.digests[-1]


def chat_turn(caller: str, route: str, body: dict[str, Any]) -> Turn | None:
    """The ledger's view of a request, or None when it cannot be continued locally (not a chat,
    several choices, or a message that is not text). Hashes the messages once, in order."""
    if route != CHAT_ROUTE:
        return None
    messages = body.get("messages")
    if not isinstance(messages, list) or not 0 < len(messages) <= MAX_MESSAGES:
        return None
    if body.get("n", 1) != 1:
        return None
    chars = []
    for message in messages:
        size = _text_chars(message)
        if size is None:
            return None
        chars.append(size)
    head = {"v": _KEY_VERSION, "caller": caller, **{f: body.get(f) for f in PROMPT_FIELDS}}
    digest = hashlib.blake2b(_canonical(head), digest_size=_DIGEST_BYTES).digest()
    digests = [digest]
    for message in messages:
        digest = hashlib.blake2b(digest + _canonical(message), digest_size=_DIGEST_BYTES).digest()
        digests.append(digest)
    return Turn(tuple(digests), tuple(m.get("role") for m in messages), tuple(chars))


@dataclasses.dataclass(frozen=True)
class Continuation:
    """Where a turn continues: the D that served its history (and that D's `epoch` then: a D
    taken out of rotation since may have lost it), and the characters the turn adds."""

    decode: str
    epoch: int
    added_chars: int


@dataclasses.dataclass
class _Served:
    decode: str
    epoch: int
    expires_at: float


class TurnLedger:
    """Which D served which chat history, for `ttl_s`, at most `max_entries` (least recently
    recorded first out). Not thread-safe: used from the proxy's event loop only. Time comes
    from `clock`, so it is tested without sockets."""

    def __init__(
        self, *, max_chars: int, ttl_s: float, max_entries: int, clock: Callable[[], float]
    ):
        self.max_chars = max_chars
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.clock = clock
        self._served: collections.OrderedDict[bytes, _Served] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._served)

    def served(self, turn: Turn, decode: str, epoch: int) -> None:
        """D answered the request `turn` was made of, whole: it holds that history and its
        answer (`epoch`: how often that D had been taken out of rotation then)."""
        self._served.pop(turn.whole, None)
        self._served[turn.whole] = _Served(decode, epoch, self.clock() + self.ttl_s)
        while len(self._served) > self.max_entries:
            self._served.popitem(last=False)

    def continuation(self, turn: Turn) -> Continuation | None:
        """The served history this request continues, when what it adds is short enough: the
        longest recorded prefix of its messages that an assistant message follows. Looks no
        further back than `max_chars` characters of messages."""
        now = self.clock()
        added = 0
        # messages[k:] are what the turn adds to a history of messages[:k].
        for k in range(len(turn.roles) - 1, 0, -1):
            added += turn.chars[k]
            if added > self.max_chars:
                return None
            if turn.roles[k] != "assistant":
                continue
            entry = self._served.get(turn.digests[k])
            if entry is None:
                continue
            if entry.expires_at <= now:
                del self._served[turn.digests[k]]
                continue
            return Continuation(entry.decode, entry.epoch, added)
        return None


def why_not_local(
    when: str, prefill_in_flight: int | None, decode_computing_alone: int
) -> str | None:
    """Why a continuation is not computed on its D now (None: it is). `prefill_in_flight` is
    the least number of requests in flight on a P the proxy could pick (None: none, so D it
    is), `decode_computing_alone` the continuations that D computes that have not answered
    (a streamed one: its first chunk)."""
    if when == LOCAL_ALWAYS or prefill_in_flight is None:
        return None
    if prefill_in_flight == 0:
        return "prefill_idle"
    if decode_computing_alone > 0:
        return "decode_busy"
    return None


def keep_turn_params() -> dict[str, Any]:
    """The `kv_transfer_params` of a request computed on D alone: keep the turn when done."""
    return {KEEP_TURN: True, PROTOCOL_KEY: PROTOCOL_VERSION}
