"""Every access of DuplexConnector to vLLM that is not the KV-connector API, in one place.

vLLM promises connectors nothing beyond `KVConnectorBase_V1`; what is below reads its
internals, each for a reason no public hook serves (said at each), with a guard that checks
the installed vLLM has the shape it needs and fails at start-up with `VllmShapeError`, naming
the access and vLLM's version.

The accesses (docs/connector.md):
- the count of a waiting request's allocation by vLLM's KV-cache manager, for
  admission-exact retention (`AllocationCount`, guarded when it is built, at
  `bind_kv_cache_manager`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import vllm

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import Request


class VllmShapeError(RuntimeError):
    """The installed vLLM lacks the shape of an internal the connector needs."""


def _changed(access: str, detail: str) -> str:
    return (
        f"DuplexConnector: {access} does not match vLLM {vllm.__version__} ({detail}); "
        "kvduplex is tested with vLLM 0.32 and 0.33"
    )


# ------------------------------------------------------- the allocation count


ALLOCATION_COUNT = (
    "the count of a waiting request's allocation by vLLM's KV-cache manager "
    "(KVCacheManager.coordinator, ...)"
)


def _takes(method: Any, params: Iterable[str]) -> bool:
    """Whether `method` is there and takes parameters of these names."""
    return method is not None and set(params) <= inspect.signature(method).parameters.keys()


class AllocationCount:
    """vLLM's own count of the blocks an allocation takes from the pool: the calls its
    `KVCacheManager.allocate_slots` makes (the same in vLLM 0.32 and 0.33), so that a prefix
    hit (blocks in use cost nothing, cached free ones count), sliding windows and state-space
    groups count as they do there (`retention.LiveRequests.waiting_need`). The KV-cache
    manager is what vLLM hands connectors (`bind_kv_cache_manager`), but the parts read here
    are beyond the connector API. Guard: built when vLLM binds the manager (start-up), it
    checks them and raises `VllmShapeError` naming those this vLLM lacks, instead of
    counting wrong."""

    _COUNT_ARGS = frozenset(
        (
            "request_id",
            "num_tokens",
            "new_computed_blocks",
            "num_encoder_tokens",
            "total_computed_tokens",
            "num_local_computed_tokens",
            "num_tokens_main_model",
            "apply_admission_cap",
            "prefill_end",
        )
    )

    def __init__(self, manager: KVCacheManager, max_model_len: int) -> None:
        coordinator = getattr(manager, "coordinator", None)
        count = getattr(coordinator, "get_num_blocks_to_allocate", None)
        missing = [
            name
            for name, present in (
                (
                    "KVCacheManager.coordinator.find_longest_cache_hit"
                    "(block_hashes, max_cache_hit_length)",
                    _takes(
                        getattr(coordinator, "find_longest_cache_hit", None),
                        ("block_hashes", "max_cache_hit_length"),
                    ),
                ),
                (
                    "KVCacheManager.prefix_cache_lookup_enabled",
                    hasattr(manager, "prefix_cache_lookup_enabled"),
                ),
                ("KVCacheManager.empty_kv_cache_blocks", hasattr(manager, "empty_kv_cache_blocks")),
                (
                    "KVCacheManager.watermark_blocks",
                    isinstance(getattr(manager, "watermark_blocks", None), int),
                ),
                (
                    "KVCacheManager.block_pool.num_gpu_blocks",
                    isinstance(getattr(manager.block_pool, "num_gpu_blocks", None), int),
                ),
                (
                    "KVCacheManager.coordinator.get_num_blocks_to_allocate"
                    f"({', '.join(sorted(self._COUNT_ARGS))})",
                    _takes(count, self._COUNT_ARGS),
                ),
            )
            if not present
        ]
        if missing:
            raise VllmShapeError(_changed(ALLOCATION_COUNT, f"no {', '.join(missing)}"))
        self._manager = manager
        self._coordinator = coordinator
        self._max_model_len = max_model_len
        self.watermark = manager.watermark_blocks
        """Free blocks vLLM keeps beside a waiting request's allocation while any runs."""
        self.empty = manager.empty_kv_cache_blocks.blocks
        """No hit: no block in any group."""
        self.pool_blocks = manager.block_pool.num_gpu_blocks

    def hit(self, request: Request) -> tuple[Any, int]:
        """The local prefix-cache hit vLLM's waiting loop finds: (blocks per group, tokens)."""
        if not self._manager.prefix_cache_lookup_enabled(request):
            return self.empty, 0
        blocks, tokens, _ = self._coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        return blocks, tokens

    def blocks(
        self,
        request: Request,
        hit: Any,
        local: int,
        computed: int,
        num_tokens: int,
        main: int,
        full: bool,
    ) -> int:
        """Blocks `allocate_slots` takes for `request` with the `hit` of `local` tokens and
        `computed` tokens in all: slots up to `num_tokens` (`main` of the model's own), or
        its check that the whole sequence fits (`full`)."""
        return self._coordinator.get_num_blocks_to_allocate(
            request_id=request.request_id,
            num_tokens=min(num_tokens, self._max_model_len),
            new_computed_blocks=hit,
            num_encoder_tokens=0,
            total_computed_tokens=computed,
            num_local_computed_tokens=local,
            num_tokens_main_model=main,
            apply_admission_cap=full,
            prefill_end=max(request.num_prompt_tokens, request.num_tokens - 1),
        )

    def remaining(self, request: Request) -> int:
        """Blocks a request with blocks already (a prefill under way, a pull) still needs to
        finish its sequence: what vLLM keeps free for it when it admits a pull."""
        full = min(request.num_tokens, self._max_model_len)
        computed = request.num_computed_tokens
        return self.blocks(request, self.empty, computed, computed, full, full, full=True)
