"""The scheduler's held turns: one record per hold this engine keeps for readers (a prefill
node's prompt for its decode node, a decode node's finished turn for the next turn), from the
moment `request_finished` keeps its blocks until TP rank 0 reports the hold ended. The rest of
the scheduler reads it: `Offers` adds holds, `Retention` sizes its eviction orders from the
counts, the idle waker asks when to step (`wake_at`).

Two books, each the truth for its own part (vLLM's architecture puts them in two processes):
- **This record** (EngineCore's process) is the truth for *what a hold pins*: its block
  references in vLLM's block pool (`BlockPool.touch`: vLLM frees the request at once, the blocks
  stay allocated until the hold ends), their count (held blocks, turns under their cap), the
  lease end it was given, and when it was shipped to the workers. Only this process may touch
  the block pool.
- **TP rank 0's hold book** (`rust/src/holds.rs`, in the worker process beside the KV cache and
  the transfer core) is the truth for *who may read it and when it ends*: grants, claims,
  renewed leases, last use, which holds an eviction picks (unclaimed only). Peers claim and
  release on its side channel between steps; the scheduler never sees claims.

A hold's end goes one way: the book decides it (read, expired, evicted, or every hold after a
reset) and reports it once in `DuplexWorkerMetadata.freed_holds`; `end` drops the references.
The scheduler ends nothing itself, with one exception: vLLM's prefix-cache reset (new weights)
fails while any block is in use, and runs before the connector hears of it
(`vllm_private.before_prefix_cache_reset`), so `drop_all` drops every hold's references first
(when that lets the reset succeed; a reset that fails anyway keeps them), and the scheduler
orders the book to end every hold at the next step (`WorkerHolds.end_all`), which, before
anything in that step writes KV, waits until no reader reads an ended hold: a block freed here
and handed to a new request is not written while a peer still reads it. A reader granted a hold
between the reset and that step reads KV of the old weights (the known gap: the step is due at
once). The book's later reports of those holds are expected (`_dropped`), not errors.

Why a message every step, then: the book is in another process, and the only channel between
the scheduler and the workers is the step's metadata and its report. A hold reaches the book
with the step after `request_finished` (`md.HoldSpec`: its fingerprints and offer), an eviction
order with the step it was made in (`retention.py`), and the book's ends come back with that
step's report. No copy is kept equal: the book holds no block references and this record no
claims. vLLM hands back one report per step built, in the order built, and TP rank 0 reports
every step (`lookup.py` counts on the same), so an order is settled by its own step's report
(`Retention.reported`), with no acknowledgement count and no timeout.

Idle engines: vLLM's EngineCore steps only while its scheduler has requests (or a connector has
"push work"); an idle one blocks on its input queue, so a hold that ends while it is idle would
keep its blocks until the next request. `wake_at` is when the engine should step: when a hold's
lease has passed since the last step, or once a second while any hold lasts (a reader's release,
a claim's end or a renewed lease end a hold at the book's time); the idle waker
(`idle_steps.py`) wakes the engine then, so it takes one step, in which TP rank 0 ends the holds
and `end` frees their blocks.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.logger import init_logger

from kvduplex.connector import vllm_private

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvduplex.connector.stats import DuplexConnectorStats

# Under vLLM's logger tree, so vLLM's handler, format and level apply.
logger = init_logger(f"vllm.{__name__}")

# An idle engine with holds steps this often, to free holds whose reader released them.
IDLE_CHECK_S = 1.0


@dataclass
class _Hold:
    blocks: list[KVCacheBlock]
    """Our references in vLLM's block pool, in the request's order."""
    turn: bool
    """A decode node's finished turn (else a prefill node's prompt for its decode node)."""
    expires_at: float
    """The lease end it was given (`time.time()`); the book may renew a prompt's."""
    shipped_at: float | None = None
    """When it went to the workers (`time.time()`; None: not yet)."""


class Holds:
    """The one record of this engine's holds on the scheduler side (`DuplexScheduler` owns
    it). Thread-safe where the idle waker's thread reads it (`wake_at`)."""

    def __init__(self, stats: DuplexConnectorStats) -> None:
        self._stats = stats
        self._pool: BlockPool | None = None
        self._holds: dict[str, _Hold] = {}
        self.held_blocks = 0
        self.turn_blocks = 0
        # Dropped by a reset; TP rank 0 reports each once more when its hold book ends it.
        self._dropped: set[str] = set()
        self._last_step = -math.inf
        self._lock = threading.Lock()

    def bind(self, block_pool: BlockPool, on_drop: Callable[[], None]) -> None:
        """`on_drop()` runs when a reset of the pool dropped holds, before vLLM's own."""
        self._pool = block_pool

        def before_reset() -> None:
            if self.drop_all(unless_reset_fails=True):
                on_drop()

        vllm_private.before_prefix_cache_reset(block_pool, before_reset)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._holds

    def __bool__(self) -> bool:
        return bool(self._holds)

    def keep(self, request_id: str, block_ids: list[int], turn: bool, expires_at: float) -> None:
        """A hold: a reference of our own on the blocks (vLLM frees the request now, the blocks
        stay until the book ends the hold)."""
        blocks = vllm_private.take_block_refs(self._pool, block_ids)
        with self._lock:
            self._holds[request_id] = _Hold(blocks, turn, expires_at)
            self._dropped.discard(request_id)
            self.held_blocks += len(blocks)
            if turn:
                self.turn_blocks += len(blocks)
        self._stats.set_gauge("held_blocks", self.held_blocks)

    def shipped(self, request_ids: list[str], now: float) -> None:
        """These holds went to the workers with the step built at `now`."""
        with self._lock:
            for request_id in request_ids:
                hold = self._holds.get(request_id)
                if hold is not None and hold.shipped_at is None:
                    hold.shipped_at = now

    def end(self, request_ids: list[str]) -> int:
        """TP rank 0 reports these holds ended, each once: the blocks go back. Returns how
        many."""
        freed = 0
        for request_id in request_ids:
            if request_id in self._dropped:
                self._dropped.discard(request_id)
                continue
            if request_id not in self._holds:
                logger.warning("A worker ended a hold on request %s, which is not held", request_id)
                continue
            freed += self._free(request_id)
        if freed:
            self._stats.set_gauge("held_blocks", self.held_blocks)
        return freed

    def drop_all(self, unless_reset_fails: bool = False) -> list[str]:
        """Every hold's references go (`unless_reset_fails`: only if that lets vLLM's reset of
        its prefix cache, about to run, succeed). Returns the holds dropped."""
        if not self._holds or self._pool is None:
            return []
        references = [block for hold in self._holds.values() for block in hold.blocks]
        if unless_reset_fails and not vllm_private.reset_frees_all(self._pool, references):
            logger.info(
                "vLLM's prefix-cache reset fails with or without the %d held block set(s) (blocks "
                "in use by requests): they stay held",
                len(self._holds),
            )
            return []
        dropped = list(self._holds)
        blocks = sum(self._free(request_id) for request_id in dropped)
        self._dropped.update(dropped)
        self._stats.set_gauge("held_blocks", self.held_blocks)
        logger.info(
            "vLLM resets its caches (new weights): dropped %d held block set(s), %d "
            "blocks; TP rank 0 ends them at the next step",
            len(dropped),
            blocks,
        )
        return dropped

    def unread_prompt_blocks(self, older_than_s: float, now: float) -> int:
        """Blocks of prompts held for decode nodes shipped to the workers at least
        `older_than_s` before `now` (their book counts no claim on them since, unless a reader
        asked: `retention.UNREAD_PROMPT_S`)."""
        return sum(
            len(hold.blocks)
            for hold in self._holds.values()
            if not hold.turn
            and hold.shipped_at is not None
            and hold.shipped_at + older_than_s <= now
        )

    def stepped(self, now: float) -> None:
        """The engine took a step at `now`: TP rank 0 ends what has expired by then."""
        with self._lock:
            self._last_step = now

    def wake_at(self) -> float | None:
        """When the engine should next step to free holds (None: no holds). Called by the
        idle waker's thread too."""
        with self._lock:
            if not self._holds:
                return None
            expiries = (
                hold.expires_at for hold in self._holds.values() if hold.expires_at > self._last_step
            )
            return min(self._last_step + IDLE_CHECK_S, min(expiries, default=math.inf))

    def _free(self, request_id: str) -> int:
        with self._lock:
            hold = self._holds.pop(request_id)
            self.held_blocks -= len(hold.blocks)
            if hold.turn:
                self.turn_blocks -= len(hold.blocks)
        vllm_private.free_block_refs(self._pool, hold.blocks)
        return len(hold.blocks)
