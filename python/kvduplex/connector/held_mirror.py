"""The scheduler's copy of what the decode nodes announced they hold, so that a prefill node's
scheduler can tell, in the step a request arrives, that a lookup by content could gain nothing
and prefill at once instead of waiting a step for the answer (`lookup.py`).

Decode nodes announce the fingerprints of the blocks their held turns offer to lookups; TP rank
0's transfer core keeps them (`rust/src/held_index.rs`) and reports what changed with every
step (`md.AnnouncedChanges`). The copy is trusted only while it is recent, complete and every
decode node a lookup would ask has announced all it holds:

- **Recent:** the last step's report came at most `fresh_s` ago. An idle engine reports
  nothing, and a turn a decode node finished meanwhile is in no report yet: the lookup asks, as
  before (an idle engine's extra step is short).
- **Handed off:** a prompt this node handed to a decode node whose turn has not been announced
  yet (the decode node announces it a step and a thread's wake-up after it finished, possibly
  after the client sent the next turn) is asked, until that turn's first full blocks are
  announced or `handoff_ttl_s` passes.

Otherwise the copy says how many of the prompt's leading full blocks any decode node may hold:
by the chained fingerprints, a held turn that matches the prompt's block k announced block k.
A turn's partial last block is not announced, so a lookup may gain one block more.

Pure state: the caller passes the time (`time.monotonic()`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvduplex.connector import metadata as md

# How recent the last step's report must be for the copy to be trusted: a decode node's turn
# announced since is in no report, and a lookup then asks. About a few steps of a busy engine.
FRESH_S = 0.25
# The most prompts handed off and not yet announced that are remembered; past it, the oldest is
# forgotten (its next turn may then be ruled out while its announcement is late).
MAX_HANDOFFS = 1 << 16
# The most fingerprints the copy keeps; past it the copy is not trusted until the next whole set.
MAX_ANNOUNCED = 1 << 20


class HeldMirror:
    def __init__(self, handoff_ttl_s: float) -> None:
        self._fresh_s = FRESH_S
        self._handoff_ttl_s = handoff_ttl_s
        self._held: set[str] = set()
        self._synced = False
        self._complete = False
        """A whole set has arrived and the copy stayed within `MAX_ANNOUNCED` since."""
        self._fresh_until = 0.0
        # The last full block's fingerprint of each prompt handed off -> when it is forgotten.
        self._handoffs: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def on_report(self, changes: md.AnnouncedChanges | None, now: float) -> None:
        """A step's report: TP rank 0's changes, or None when nothing changed (or the workers
        had nothing at all to report)."""
        if changes is not None:
            if changes.whole:
                self._held = set(changes.added)
                self._complete = True
            else:
                self._held.difference_update(changes.removed)
                self._held.update(changes.added)
            if len(self._held) > MAX_ANNOUNCED:
                self._held.clear()
                self._complete = False
            self._synced = changes.synced
            for fingerprint in changes.added:
                self._handoffs.pop(fingerprint, None)
        if self._complete:
            self._fresh_until = now + self._fresh_s

    def handed_off(self, full_blocks: Sequence[str], now: float) -> None:
        """A prompt with these full blocks' fingerprints went to a decode node, which may hold
        the turn it computes after it."""
        if not full_blocks:
            return
        last = full_blocks[-1]
        self._handoffs.pop(last, None)
        self._handoffs[last] = now + self._handoff_ttl_s
        while len(self._handoffs) > MAX_HANDOFFS:
            self._handoffs.popitem(last=False)

    def held_blocks(self, full_blocks: Sequence[str], now: float) -> int | None:
        """How many of a prompt's leading full blocks (their fingerprints) a decode node may
        hold, or None when the copy cannot tell (the lookup then asks)."""
        while self._handoffs:
            fingerprint, until = next(iter(self._handoffs.items()))
            if until > now:
                break
            del self._handoffs[fingerprint]
        if not self._synced or now > self._fresh_until:
            return None
        if any(fingerprint in self._handoffs for fingerprint in full_blocks):
            return None
        for count in range(len(full_blocks), 0, -1):
            if full_blocks[count - 1] in self._held:
                return count
        return 0
