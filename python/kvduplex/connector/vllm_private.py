"""The connector's accesses to vLLM's private state, each with a guard that refuses loudly at
start when vLLM's shape differs from the one known (vLLM 0.32 and 0.33)."""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock


def before_prefix_cache_reset(block_pool: BlockPool, before: Callable[[], None]) -> None:
    """Run `before` whenever vLLM resets `block_pool`'s prefix cache, before the reset.

    vLLM's `Scheduler.reset_prefix_cache` (its dev endpoint, sleep, pause with `clear_cache`,
    RL frameworks' weight updates) preempts the running requests if asked, then calls
    `BlockPool.reset_prefix_cache()`, which fails while any block but the null block is in use
    (and, with `reset_running_requests`, raises), and only then the connector's `reset_cache`.
    No public hook runs before the pool's reset, so this pool's method is wrapped (on the
    instance: vLLM's coordinator calls `pool.reset_prefix_cache()`). Private: the method's
    name, that it takes no argument and returns a bool."""
    method = getattr(type(block_pool), "reset_prefix_cache", None)
    if (
        not callable(method)
        or list(inspect.signature(method).parameters) != ["self"]
        or not isinstance(getattr(block_pool, "num_gpu_blocks", None), int)
        or not isinstance(getattr(block_pool.blocks[0], "ref_cnt", None), int)
    ):
        raise RuntimeError(
            "DuplexConnector: this vLLM's BlockPool has no reset_prefix_cache(self) -> bool, "
            "or no blocks counting references (`ref_cnt`), as vLLM 0.32-0.33 have: held KV "
            "blocks could not follow its cache resets. Use a vLLM version the connector "
            "supports."
        )
    reset = block_pool.reset_prefix_cache

    def reset_prefix_cache() -> bool:
        before()
        return reset()

    block_pool.reset_prefix_cache = reset_prefix_cache  # type: ignore[method-assign]


def reset_frees_all(block_pool: BlockPool, references: Iterable[KVCacheBlock]) -> bool:
    """Whether vLLM's prefix-cache reset succeeds once `references` (one per reference held)
    are freed: every block in use but the null block is in use by them alone. Private:
    `num_gpu_blocks` and a block's `ref_cnt`."""
    ours = Counter(block.block_id for block in references)
    blocks = block_pool.blocks
    in_use = block_pool.num_gpu_blocks - block_pool.get_num_free_blocks() - 1
    return len(ours) == in_use and all(blocks[i].ref_cnt == n for i, n in ours.items())
