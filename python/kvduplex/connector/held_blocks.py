"""The scheduler's references on held blocks in vLLM's block pool, and what vLLM's cache reset
does to them.

A hold keeps a finished request's blocks allocated with a reference of our own
(`BlockPool.touch`), dropped when TP rank 0 reports the hold ended (read, expired, evicted) in
`DuplexWorkerMetadata.freed_holds`: `HeldBlocks.end`. Ending a hold also tells `Retention`
(its blocks are free), the KV events (the turn is no longer offered, `events.py`) and the
`held_blocks` gauge.

vLLM resets its prefix cache where the weights change in place (its sleep, its pause with
`clear_cache`, RL frameworks' weight updates, the dev endpoint `/reset_prefix_cache`): held KV
was computed with the old weights, and the reset fails while any block is in use, raising when
it preempted the running requests first. Its pool's reset runs before the connector hears of it
(`vllm_private.before_prefix_cache_reset`), so `HeldBlocks.drop_all` runs first: every hold's
references go at once (when that lets the reset succeed; a reset that fails anyway keeps them),
and the scheduler orders TP rank 0 to end every hold in its hold book at the next step
(`WorkerHolds.end_all`), which, before anything in that step writes KV, waits until no
reader reads an ended hold: a block freed here and handed to a new request is not written
while a peer still reads it. A reader granted a hold between the reset and that step reads
KV of the old weights (the known gap: the step is due at once). Rank 0's later reports of
those holds are expected, not errors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from vllm.logger import init_logger

from kvduplex.connector import vllm_private

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvduplex.connector.events import HeldTurnEvents
    from kvduplex.connector.retention import Retention
    from kvduplex.connector.stats import DuplexConnectorStats

# Under vLLM's logger tree, so vLLM's handler, format and level apply.
logger = init_logger(f"vllm.{__name__}")


class HeldBlocks:
    """Our references in vLLM's block pool, per hold, in the request's order."""

    def __init__(
        self, retention: Retention, events: HeldTurnEvents, stats: DuplexConnectorStats
    ) -> None:
        self._retention = retention
        self._events = events
        self._stats = stats
        self._pool: BlockPool | None = None
        self._held: dict[str, list[KVCacheBlock]] = {}
        # Dropped by a reset; TP rank 0 reports each once more when its hold book ends it.
        self._dropped: set[str] = set()

    def bind(self, block_pool: BlockPool, on_drop: Callable[[], None]) -> None:
        """`on_drop()` runs when a reset of the pool dropped holds, before vLLM's own."""
        self._pool = block_pool

        def before_reset() -> None:
            if self.drop_all(unless_reset_fails=True):
                on_drop()

        vllm_private.before_prefix_cache_reset(block_pool, before_reset)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def __bool__(self) -> bool:
        return bool(self._held)

    def keep(self, request_id: str, block_ids: list[int]) -> None:
        """A reference of our own: vLLM frees the request now, the blocks stay until the hold
        ends."""
        self._held[request_id] = vllm_private.take_block_refs(self._pool, block_ids)
        self._dropped.discard(request_id)

    def end(self, request_ids: list[str]) -> int:
        """TP rank 0 reports these holds ended, each once: the blocks go back. Returns how
        many."""
        freed = 0
        for request_id in request_ids:
            if request_id in self._dropped:
                self._dropped.discard(request_id)
                continue
            if request_id not in self._held:
                logger.warning("A worker ended a hold on request %s, which is not held", request_id)
                continue
            freed += self._free(request_id)
        if freed:
            self._stats.set_gauge("held_blocks", self._retention.held_blocks)
        return freed

    def drop_all(self, unless_reset_fails: bool = False) -> list[str]:
        """Every hold's references go (`unless_reset_fails`: only if that lets vLLM's reset of
        its prefix cache, about to run, succeed). Returns the holds dropped."""
        if not self._held or self._pool is None:
            return []
        references = [block for blocks in self._held.values() for block in blocks]
        if unless_reset_fails and not vllm_private.reset_frees_all(self._pool, references):
            logger.info(
                "vLLM's prefix-cache reset fails with or without the %d held block set(s) (blocks "
                "in use by requests): they stay held",
                len(self._held),
            )
            return []
        dropped = list(self._held)
        blocks = sum(self._free(request_id) for request_id in dropped)
        self._dropped.update(dropped)
        self._stats.set_gauge("held_blocks", self._retention.held_blocks)
        logger.info(
            "vLLM resets its caches (new weights): dropped %d held block set(s), %d "
            "blocks; TP rank 0 ends them at the next step",
            len(dropped),
            blocks,
        )
        return dropped

    def _free(self, request_id: str) -> int:
        blocks = self._held.pop(request_id)
        self._retention.freed(request_id)
        self._events.ended(request_id)
        vllm_private.free_block_refs(self._pool, blocks)
        return len(blocks)
