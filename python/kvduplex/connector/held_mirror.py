"""The scheduler's copy of what the decode nodes announced they hold, so that a prefill node's
scheduler can tell, in the step a request arrives, that a lookup by content could not gain
enough to be worth it and prefill at once instead of waiting a step for the answer
(`lookup.py`).

Decode nodes announce the fingerprints of the blocks their held turns offer to lookups; TP rank
0's transfer core keeps them (`rust/src/held_index.rs`) and reports what changed with every
step (`md.AnnouncedChanges`). The copy is trusted only while every decode node a lookup would
ask has announced all it holds, the whole set has arrived, and the last step's report came at
most `FRESH_S` ago (an idle engine reports nothing: its lookups ask, as before).

A decode node announces a turn a step and a thread's wake-up after it finished it, which may be
after its client sent the next turn. So a prompt that continues one this node handed to a
decode node is asked until that turn's blocks are announced (the handoff's guard, by its last
full block's fingerprint, or by its tokens when it has no full block), and such a lookup names
the handed prompt's end (`continued`): the decode node answers "not yet" while it computes that
turn (`expected_turns.py`); the transfer core asks the decode node it granted that prompt to
(and those whose announcements hold more of the prompt), or every one when it knows none. A
turn this node did not hand off (another prefill node's) has no guard: if its next turn arrives
here before the decode node's announcement has reached this scheduler, and no earlier turn of
the conversation is still announced, it is recomputed (never read wrongly).

An idle engine takes no step, so its copy would be stale whenever a conversation's next turn
arrives after its user's think time, and every such turn would be asked. While it looks
things up, an idle engine therefore steps a little before its copy goes stale
(`refresh_at`, the connector's push work, `idle_steps.IdleWaker`): TP rank 0 reports every
step, even with nothing changed, and that report renews the copy. It stops `IDLE_REFRESH_S` after its
last lookup (`lookup.py`).

Otherwise the copy says how many of the prompt's leading tokens any decode node may hold: by
the chained fingerprints, a held turn whose block k is announced holds the prompt's first k+1
blocks if it has that fingerprint, and a held turn's partial last block is announced by the
fingerprint of the tokens it holds, which the prompt's own fingerprint of as many tokens after
its matching blocks equals (`may_hold`). A decode node announces of each turn its first block,
every 16th, its prompt's last full block (the handoff's guard below) and its last two
(`rust/src/holds/feed.rs`): a prompt that continues a turn, or repeats its prompt, counts
exactly; one that leaves a turn in its middle (an edited history) may count up to 15 blocks
short, and is then ruled out where those blocks alone would have been worth the lookup.

Pure state: the caller passes the time (`time.monotonic()`).
"""

from __future__ import annotations

from collections import OrderedDict

from kvduplex.connector import metadata as md
from kvduplex.connector.token_fingerprint import PromptFingerprints

# How recent the last step's report must be for the copy to be trusted: a decode node's turn
# announced since is in no report yet. About a few steps of a busy engine.
FRESH_S = 0.25
# How long before the copy goes stale an idle engine steps to renew it (`refresh_at`).
REFRESH_LEAD_S = 0.05
# The most handoffs whose turn is not announced yet that are guarded; past it, the oldest guard
# goes (a guard whose turn is never announced, e.g. by a decode node keeping no turns, stays
# until then: it only costs the conversation's lookups their step, as before).
MAX_HANDOFFS = 1 << 16


class HeldMirror:
    def __init__(self) -> None:
        self._fresh_s = FRESH_S
        self._held: set[str] = set()
        self._synced = False
        self._complete = False
        """A whole set has arrived (and no report said the copy is incomplete since)."""
        self._fresh_until = 0.0
        # Handoffs whose turn is not announced, each with its prompt's end: by the last full
        # block's fingerprint (with the tokens after it), or (a prompt without one) its tokens.
        self._handoffs: OrderedDict[str, tuple[int, str]] = OrderedDict()
        self._short: OrderedDict[tuple[int, ...], str] = OrderedDict()
        self._short_lengths: dict[int, int] = {}

    def on_report(self, changes: md.AnnouncedChanges | None, now: float) -> None:
        """A step's report: TP rank 0's changes, or None when nothing changed (or the workers
        had nothing at all to report)."""
        if changes is not None:
            if changes.whole:
                self._held = set(changes.added)
                self._complete = changes.complete
            else:
                self._held.difference_update(changes.removed)
                self._held.update(changes.added)
            self._synced = changes.synced
            for fingerprint in changes.added:
                self._handoffs.pop(fingerprint, None)
        self._fresh_until = now + self._fresh_s if self._complete else 0.0

    def refresh_at(self) -> float | None:
        """When (`time.monotonic()`) a step's report should renew the copy before it goes
        stale; None while it is not trusted anyway (incomplete, or some decode node has not
        announced all it holds: a lookup then asks)."""
        if not (self._complete and self._synced):
            return None
        return self._fresh_until - REFRESH_LEAD_S

    def handed_off(self, prompt: PromptFingerprints) -> None:
        """A prompt went to a decode node, which may hold the turn it computes after it before
        it announces that."""
        full_blocks = prompt.full_blocks
        if full_blocks:
            tail = len(prompt.token_ids) - len(full_blocks) * prompt.block_size
            self._handoffs.pop(full_blocks[-1], None)
            self._handoffs[full_blocks[-1]] = (tail, prompt.end)
            if len(self._handoffs) > MAX_HANDOFFS:
                self._handoffs.popitem(last=False)
            return
        tokens = tuple(prompt.token_ids)
        if not tokens or tokens in self._short:
            return
        self._short[tokens] = prompt.end
        self._short_lengths[len(tokens)] = self._short_lengths.get(len(tokens), 0) + 1
        if len(self._short) > MAX_HANDOFFS:
            self._forget_short(next(iter(self._short)))

    def _forget_short(self, tokens: tuple[int, ...]) -> None:
        del self._short[tokens]
        self._short_lengths[len(tokens)] -= 1
        if not self._short_lengths[len(tokens)]:
            del self._short_lengths[len(tokens)]

    def continued(self, prompt: PromptFingerprints) -> str | None:
        """The end of a prompt handed to a decode node, whose turn is not announced yet, that
        `prompt` continues (all its tokens, the partial last block's included), or None. Its
        work is bounded by the prompt's length."""
        full_blocks = prompt.full_blocks
        for count in range(len(full_blocks), 0, -1):
            handoff = self._handoffs.get(full_blocks[count - 1])
            if handoff is None:
                continue
            tail, end = handoff
            if not tail:
                return end
            first = next(prompt.tails(count, tail), None)
            if first is not None and first[1] == end:
                return end
        tokens = prompt.token_ids
        for length in [n for n in self._short_lengths if n <= len(tokens)]:
            end = self._short.get(tuple(tokens[:length]))
            if end is not None:
                return end
        return None

    def may_hold(self, prompt: PromptFingerprints, tokens: int, now: float) -> bool | None:
        """Whether a decode node may hold the prompt's first `tokens` tokens, or None when the
        copy cannot tell (the lookup then asks). Its work is bounded by the prompt's length."""
        full = self._held_blocks(prompt, now)
        if full is None:
            return None
        least = tokens - full * prompt.block_size
        if least <= 0:
            return True
        if not full:
            return False  # a lookup matches full blocks first: a shorter turn is never found
        # A held turn's partial last block after the matching full blocks, with enough tokens.
        return any(fp in self._held for _, fp in prompt.tails(full, least))

    def _held_blocks(self, prompt: PromptFingerprints, now: float) -> int | None:
        """How many of a prompt's leading full blocks a decode node may hold, or None when the
        copy cannot tell."""
        if not self._synced or now > self._fresh_until:
            return None
        full_blocks, prompt_tokens = prompt.full_blocks, prompt.token_ids
        if any(fingerprint in self._handoffs for fingerprint in full_blocks):
            return None
        # A short prompt handed off: its turn's first full block holds its tokens and more, and
        # once that block is announced, the guard has done its work.
        for length in [n for n in self._short_lengths if n <= len(prompt_tokens)]:
            tokens = tuple(prompt_tokens[:length])
            if tokens not in self._short:
                continue
            if not full_blocks or full_blocks[0] not in self._held:
                return None
            self._forget_short(tokens)
        for count in range(len(full_blocks), 0, -1):
            if full_blocks[count - 1] in self._held:
                return count
        return 0
