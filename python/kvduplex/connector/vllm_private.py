"""Every access of DuplexConnector to vLLM that is not the KV-connector API, in one place.

vLLM promises connectors nothing beyond `KVConnectorBase_V1`; what is below reads or writes
its internals, each for a reason no public hook serves (said at each). Each has a guard that
checks the installed vLLM has the shape it needs: where the connector cannot work without it,
at start-up, failing with `VllmShapeError` naming the access and vLLM's version; where a
fallback exists, degrading to it with a warning that names them. tests/connector/
test_vllm_private.py checks each shape on the installed vLLM (CI runs it on every vLLM the
package accepts), so a vLLM that changes one fails there first.

The accesses (docs/connector.md, "Private vLLM accesses"):
- the prompt edit of a prefill for another engine of a state-space model
  (`drop_last_prompt_token`, guard `check_prompt_edit`);
- references of our own in vLLM's block pool, which the public `bind_kv_cache_manager` hands
  over with no contract of its own (`take_block_refs` and the others below, guard
  `check_block_pool`), and the hook that runs before the pool's prefix-cache reset, so held
  turns follow vLLM's cache resets (`before_prefix_cache_reset`, guarded as it is set);
- the idle engine's wake-up (`engine_wakeup`) and the end of a worker's busy poll after an idle
  step (`worker_rest`): both find vLLM's process object on the stack (`_on_stack`).
- the count of a waiting request's allocation by vLLM's KV-cache manager, for admission-exact
  retention (`AllocationCount`, guarded when it is built, at `bind_kv_cache_manager`).
"""

from __future__ import annotations

import inspect
import math
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import vllm
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

# Under vLLM's logger tree, so vLLM's handler, format and level apply.
logger = init_logger(f"vllm.{__name__}")


class VllmShapeError(RuntimeError):
    """The installed vLLM lacks the shape of an internal the connector needs."""


def _changed(access: str, detail: str) -> str:
    return (
        f"DuplexConnector: {access} does not match vLLM {vllm.__version__} ({detail}); "
        "kvduplex is tested with vLLM 0.32 and 0.33"
    )


# ------------------------------------------------------------------- the prompt edit


PROMPT_EDIT = "the prompt edit of a prefill for another engine (Request.prompt_token_ids, ...)"


def drop_last_prompt_token(request: Request, hash_block_size: int | None) -> None:
    """Make `request` a prompt one token shorter that samples one token: a prefill for another
    engine of a model with a state-space group stops before the prompt's last token, so the
    reader pulls the state after the others and computes that token itself. No connector hook
    shortens a prompt (`get_num_new_matched_tokens` only counts tokens computed elsewhere, and
    vLLM always computes a prompt to its end); vLLM's own NixlConnector edits the request the
    same way (`_truncate_request_for_prefill`, 0.32 and 0.33). `hash_block_size`: vLLM's
    block pool's, to drop the hash of a full block that covered the dropped token (None: no
    pool bound yet, nothing hashed to drop)."""
    del request.prompt_token_ids[-1]
    del request._all_token_ids[-1]
    request.num_prompt_tokens -= 1
    request.max_tokens = 1
    if hash_block_size is not None and isinstance(request.block_hashes, list):
        del request.block_hashes[request.num_prompt_tokens // hash_block_size :]


def check_prompt_edit() -> None:
    """Start-up guard of `drop_last_prompt_token`: edits a real vLLM `Request` and checks that
    every view of its tokens is one shorter. Raises `VllmShapeError` otherwise: a prefill that
    computed the whole prompt would hand its reader a state one token ahead."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    try:
        probe = Request("kvduplex-probe", [1, 2, 3], SamplingParams(max_tokens=4), None)
        drop_last_prompt_token(probe, None)
        shape = (
            list(probe.prompt_token_ids),
            list(probe.all_token_ids),
            probe.num_tokens,
            probe.num_prompt_tokens,
            probe.max_tokens,
        )
    except (AttributeError, TypeError, IndexError) as exc:
        raise VllmShapeError(_changed(PROMPT_EDIT, repr(exc))) from exc
    if shape != ([1, 2], [1, 2], 2, 2, 1):
        raise VllmShapeError(
            _changed(
                PROMPT_EDIT,
                f"after the edit (prompt, all tokens, num_tokens, num_prompt_tokens, "
                f"max_tokens) = {shape}",
            )
        )


# ----------------------------------------------------------------- the block pool


BLOCK_POOL = "references in vLLM's block pool (BlockPool.blocks, touch, free_blocks, ...)"

# Method -> the parameters it is called with here (by position).
_BLOCK_POOL_METHODS = {
    "touch": ("blocks",),
    "free_blocks": ("ordered_blocks",),
    "get_cached_block": ("block_hash", "kv_cache_group_ids"),
    "get_num_free_blocks": (),
}


def check_block_pool(pool: BlockPool) -> None:
    """Guard of the block pool's use, when vLLM binds it (`bind_kv_cache_manager`, at start-up):
    its methods take what they are given here, and it has its blocks by id and the size of a
    hashed block. Raises `VllmShapeError`: without it no hold can be taken or ended."""
    missing = []
    for name, params in _BLOCK_POOL_METHODS.items():
        method = getattr(pool, name, None)
        if method is None:
            missing.append(f"no {name}")
            continue
        signature = inspect.signature(method).parameters.values()
        found = tuple(param.name for param in signature)
        required = [param for param in signature if param.default is param.empty]
        if found[: len(params)] != params or len(required) > len(params):
            missing.append(f"{name}{found} where {name}{params} was expected")
    if not isinstance(getattr(pool, "blocks", None), list):
        missing.append("no list of blocks")
    elif pool.blocks and not hasattr(pool.blocks[0], "ref_cnt"):
        missing.append("blocks without ref_cnt")
    if not isinstance(getattr(pool, "hash_block_size", None), int):
        missing.append("no hash_block_size")
    if missing:
        raise VllmShapeError(_changed(BLOCK_POOL, "; ".join(missing)))


def take_block_refs(pool: BlockPool, block_ids: Iterable[int]) -> list[KVCacheBlock]:
    """A reference of our own on each block (never vLLM's null block): the blocks stay
    allocated after vLLM frees the request, until `free_block_refs`. vLLM's other way to keep
    a finished request's blocks (`request_finished` returning True) keeps its engine stepping
    non-stop while they are kept (docs/connector.md, "Holding blocks")."""
    blocks = [pool.blocks[block_id] for block_id in block_ids]
    pool.touch(blocks)
    return blocks


def free_block_refs(pool: BlockPool, blocks: list[KVCacheBlock]) -> None:
    """Drop the references `take_block_refs` took; last block first, as vLLM frees a
    request's blocks, so the tail is evicted first."""
    pool.free_blocks(reversed(blocks))


def cached_block_id(pool: BlockPool, block_hash: Any, group_id: int) -> int | None:
    """The block of KV-cache group `group_id` that vLLM's prefix cache keeps for
    `block_hash`, if any."""
    cached = pool.get_cached_block(block_hash, [group_id])
    return cached[0].block_id if cached else None


def num_free_blocks(pool: BlockPool) -> int:
    return pool.get_num_free_blocks()


def hash_block_size(pool: BlockPool) -> int:
    """Tokens per hash of `Request.block_hashes`."""
    return pool.hash_block_size


# ------------------------------------------------------- the block pool's reset


BLOCK_POOL_RESET = "the hook before vLLM's prefix-cache reset (BlockPool.reset_prefix_cache)"


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
        raise VllmShapeError(
            _changed(
                BLOCK_POOL_RESET,
                "no reset_prefix_cache(self) -> bool, or no blocks counting references "
                "(ref_cnt): held KV blocks could not follow its cache resets",
            )
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


# ---------------------------------------------------------- vLLM's process objects


ENGINE_WAKEUP = "the idle engine's wake-up (EngineCoreProc.input_queue, WAKEUP)"
WORKER_REST = "the end of a worker's busy poll (WorkerProc.rpc_broadcast_mq._spin_condition)"


def _names(function: Any) -> tuple[str, ...]:
    """The attribute and global names a function's code uses."""
    function = inspect.unwrap(function) if callable(function) else function
    return getattr(getattr(function, "__code__", None), "co_names", ())


def _class_uses(cls: type, name: str) -> bool:
    """Whether any method of `cls` names attribute `name` (sets or reads it)."""
    return any(name in _names(member) for member in vars(cls).values())


def engine_wakeup_shape() -> str | None:
    """What `engine_wakeup` needs and the installed vLLM lacks (None: nothing): a WAKEUP
    request type its EngineCoreProc handles, and that process's input queue."""
    try:
        from vllm.v1.engine import EngineCoreRequestType
        from vllm.v1.engine.core import EngineCoreProc
    except ImportError as exc:
        return repr(exc)
    if not hasattr(EngineCoreRequestType, "WAKEUP"):
        return "no EngineCoreRequestType.WAKEUP"
    if "WAKEUP" not in _names(getattr(EngineCoreProc, "_handle_client_request", None)):
        return "EngineCoreProc._handle_client_request does not handle WAKEUP"
    if "input_queue" not in _names(EngineCoreProc.__init__):
        return "EngineCoreProc.__init__ sets no input_queue"
    if "input_queue" not in _names(getattr(EngineCoreProc, "_process_input_queue", None)):
        return "EngineCoreProc._process_input_queue waits on no input_queue"
    return None


def engine_wakeup() -> Callable[[], None] | None:
    """vLLM's way to wake its idle EngineCoreProc, which otherwise blocks on its input queue
    while its scheduler has no requests: the WAKEUP request vLLM itself puts there for
    shutdown. The connector is built inside `EngineCoreProc.__init__`, whose `self` is on the
    stack. No hook of 0.32 or 0.33 wakes an idle engine (`has_pending_push_work` is asked
    before it waits on its input queue, not while it waits). None: no EngineCoreProc builds
    this connector (an engine its caller steps, e.g. `LLM`), or, with a warning, this vLLM's
    differs."""
    try:
        from vllm.v1.engine import EngineCoreRequestType
        from vllm.v1.engine.core import EngineCoreProc
    except ImportError:
        EngineCoreProc = None  # noqa: N806
    owner = _on_stack(EngineCoreProc) if EngineCoreProc is not None else None
    if owner is None:
        return None
    missing = engine_wakeup_shape()
    if missing is None and not hasattr(getattr(owner, "input_queue", None), "put_nowait"):
        missing = "its input_queue is not set before the scheduler is built"
    if missing is not None:
        logger.warning(
            "%s; holds that end while the engine is idle wait for its next step",
            _changed(ENGINE_WAKEUP, missing),
        )
        return None
    queue = owner.input_queue
    return lambda: queue.put_nowait((EngineCoreRequestType.WAKEUP, None))


def worker_rest_shape() -> str | None:
    """What `worker_rest` needs and the installed vLLM lacks (None: nothing): a WorkerProc
    reading its step queue (`rpc_broadcast_mq`), a queue that polls through a `SpinCondition`
    and a condition that stops polling once its `last_read` is `busy_loop_s` past."""
    try:
        from vllm.distributed.device_communicators.shm_broadcast import (
            MessageQueue,
            SpinCondition,
        )
        from vllm.v1.executor.multiproc_executor import WorkerProc
    except ImportError as exc:
        return repr(exc)
    if not _class_uses(WorkerProc, "rpc_broadcast_mq"):
        return "WorkerProc has no rpc_broadcast_mq"
    if not _class_uses(MessageQueue, "_spin_condition"):
        return "MessageQueue has no _spin_condition"
    if not {"last_read", "busy_loop_s"} <= set(_names(SpinCondition.wait)):
        return "SpinCondition.wait does not poll by last_read and busy_loop_s"
    return None


def worker_rest() -> Callable[[], None] | None:
    """Ends the busy poll of vLLM's step queue in this worker process: after a read, vLLM's
    multiprocessing workers poll the queue without sleeping for a second (`busy_loop_s`)
    before they wait on its socket, which kept an idle server's core busy through the idle
    steps the connector asks for (`idle_steps.py`). Setting the queue's `last_read` into the
    past makes its next wait that socket wait (vLLM's own idle state), which the next step's
    notification ends. The connector's worker is built from a message of that queue: the
    `WorkerProc` reading it is on the stack. None: no such worker (another executor), or, with
    a warning, this vLLM's differs."""
    try:
        from vllm.v1.executor.multiproc_executor import WorkerProc
    except ImportError:
        return None
    proc = _on_stack(WorkerProc)
    if proc is None:
        return None
    missing = worker_rest_shape()
    if missing is not None:
        logger.warning(
            "%s; an idle server's worker polls for a second after each idle step",
            _changed(WORKER_REST, missing),
        )
        return None

    def rest() -> None:
        # The queue may be replaced or closed (shutdown): look it up at each use.
        condition = getattr(getattr(proc, "rpc_broadcast_mq", None), "_spin_condition", None)
        if condition is not None:  # None: a writer's queue, or one without polling
            condition.last_read = -math.inf

    return rest


def _on_stack(cls: type) -> object | None:
    """The innermost `self` on the caller's stack that is a `cls`."""
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, cls):
            return owner
        frame = frame.f_back
    return None


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
