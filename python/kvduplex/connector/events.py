"""vLLM KV events for the turns a decode node holds for readers.

With `--kv-events-config` vLLM publishes `BlockStored`/`BlockRemoved` events for its prefix
cache, and KV-aware routers (llm-d's precise prefix-cache scorer, Dynamo's KV router) index them
by block hash to learn which engine has which prefix. A decode node's held turn is more than a
cache entry: another engine can pull it (by lookup or params) until the hold ends. So D publishes
one `BlockStored` per held turn, `medium` = `kvduplex.protocol.HELD_TURN_MEDIUM`, with the turn's
full blocks, and a `BlockRemoved` of the same hashes when the hold ends (read, expired, evicted).

The hashes are vLLM's own block hashes of the turn's tokens (`Request.block_hashes`, converted
as vLLM converts its own events' hashes): the same values vLLM publishes for those blocks in
its own events, computed from the tokens, the cache salt, LoRA and multimodal inputs with the
engine's hash function (`--prefix-caching-hash-algo`), so a router that indexes vLLM's events
matches them without computing anything new. A router that chose D for a conversation hands
P the lookup hint (`kvduplex.protocol.LOOKUP_HINT`): P then asks that D alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvduplex.protocol import HELD_TURN_MEDIUM

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request


class HeldTurnEvents:
    """Queues the events of held turns until vLLM's scheduler takes them (once a step); queues
    nothing unless vLLM publishes KV events."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        events_config = vllm_config.kv_events_config
        self.enabled = bool(events_config and events_config.enable_kv_cache_events)
        self._queue: list[KVCacheEvent] = []
        self._hashes: dict[str, list] = {}

    def held(self, request: Request, num_tokens: int, hash_block_size: int) -> None:
        """`request`'s first `num_tokens` tokens are held: their full blocks (of vLLM's
        `hash_block_size` tokens) are announced."""
        if not self.enabled:
            return
        num_blocks = min(num_tokens // hash_block_size, len(request.block_hashes))
        if num_blocks == 0:
            return
        hashes = [maybe_convert_block_hash(h) for h in request.block_hashes[:num_blocks]]
        lora = request.lora_request
        self._queue.append(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=None,
                token_ids=request.all_token_ids[: num_blocks * hash_block_size],
                block_size=hash_block_size,
                lora_id=lora.adapter_id if lora else None,
                medium=HELD_TURN_MEDIUM,
                lora_name=lora.name if lora else None,
                session_id=request.session_id,
            )
        )
        self._hashes[request.request_id] = hashes

    def ended(self, request_id: str) -> None:
        """The hold of `request_id` ended: its blocks are no longer offered."""
        hashes = self._hashes.pop(request_id, None)
        if hashes:
            self._queue.append(BlockRemoved(block_hashes=hashes, medium=HELD_TURN_MEDIUM))

    def take(self) -> list[KVCacheEvent]:
        events, self._queue = self._queue, []
        return events
