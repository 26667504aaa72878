"""How long an engine keeps held blocks: the cap on held turns, memory pressure.

Held blocks (a prefill node's prompts for their decode nodes, a decode node's finished turns
for the next turn) are worth less than the requests the engine runs: they are given up,
least recently used and unclaimed first, when the engine's free blocks fall below what its
requests need, before vLLM would preempt one of them or make one wait. Two tiers: what running
requests need for their next step(s) may take any unclaimed hold; what vLLM's next step needs
to admit waiting requests may take held turns, and prompts no reader has claimed for
`UNREAD_PROMPT_S`.
A prompt held for a decode node is read within moments of its hand-off (its reader asks for it
as soon as it gets the request), and giving it up then makes the decode node compute the whole
prompt, to let a waiting request in a little sooner; but a decode node that computes the prompt
itself (a pull would gain less than its recompute threshold) never asks, and such a prompt
would keep its blocks from waiting requests until its lease ends. A held turn waits for a next
turn that may never come. The holds and their counts are `holds.py`'s (`Holds`, which this
reads); TP rank 0's hold book owns the claims, so the scheduler orders evictions of *a number
of blocks* and the hold book picks which holds (unclaimed only: no block is freed under a read).

Admission (`LiveRequests.waiting_need`): a waiting request needs exactly what vLLM's allocation
for it would take from the pool in the next step (`Scheduler.schedule`'s waiting loop and
`KVCacheManager.allocate_slots`, the same in vLLM 0.32 and 0.33), counted by vLLM's own
KV-cache manager (`vllm_private.AllocationCount`): the whole sequence with `scheduler_reserve_full_isl`
(vLLM's default), else the first chunk within the token budget; an asynchronous load (a pull)
all its blocks at once, beside what vLLM keeps for prefills under way; less its prefix-cache
hit on blocks in use; plus vLLM's watermark while anything runs. In vLLM's order, each after
those before it, until the token budget or the seats run out; the connector's answer for each
is the one vLLM got (`matched`). The order made when vLLM first leaves such a request waiting
ships in that step; TP rank 0 frees the holds during it, and vLLM admits the request in the
next step (async scheduling: the one after, scheduled before this step's output is in).

Orders (`Retention`, pure: time comes in as an argument):
- Every order travels in one step's metadata; TP rank 0 carries it out as the step begins and
  reports the holds it freed in that step's report, which vLLM hands back after the reports of
  the steps built before (one per step, in order; TP rank 0 reports every step). Until that
  report, the order's blocks count as about to be freed, so an eviction shipped and one
  reported are never counted twice, and two turns finishing in one step order only what they
  need together.
- While an order is outstanding, vLLM's `has_pending_block_frees` says so, and a running
  request that cannot get blocks waits for them instead of preempting another. When vLLM is
  about to preempt and no order is outstanding, one is made there and then.
- An order whose step freed less than it asked (the rest is claimed: claims live in the hold
  book, taken by peers between steps, and the scheduler never sees them) holds back further
  pressure orders for `FRUITLESS_BACKOFF_S`: vLLM then preempts as it would without holds, and
  a claim that ends meanwhile is found by the next order (a reader whose own request cannot
  get in hands its claim back within `ALLOCATION_WAIT_S`, `pull_decision.py`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from kvduplex.connector.metadata import EvictOrder
from kvduplex.connector.vllm_private import AllocationCount

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from kvduplex.connector.holds import Holds

# Under vLLM's logger tree, so vLLM's handler, format and level apply.
logger = init_logger(f"vllm.{__name__}")

# After an order freed less than asked (claimed holds), no pressure order for this long.
FRUITLESS_BACKOFF_S = 0.5
# A prompt held for a decode node that no reader has claimed for this long since its hold was
# shipped to the workers may be given up for waiting requests. TP rank 0's hold book takes the
# hold a moment after it is shipped and counts from there: it is asked to free prompts unread
# for `UNREAD_MARGIN_S` less, so that what the scheduler counts as unread is unread there too.
UNREAD_PROMPT_S = 1.0
UNREAD_MARGIN_S = 0.1


class Retention:
    """The eviction orders of an engine's holds (`holds`: what is held)."""

    def __init__(self, holds: Holds, max_turn_blocks: int) -> None:
        self.max_turn_blocks = max_turn_blocks
        self._holds = holds
        self._next = EvictOrder()
        # The orders of the steps built and not reported yet, oldest first, one per step.
        self._in_flight: deque[EvictOrder] = deque()
        # When the last order freed less than it asked (-inf: never).
        self._fruitless_at = -math.inf

    def turn_held(self) -> None:
        """A turn was held (`Holds.keep`): past the cap, order room among the older turns."""
        overflow = self._holds.turn_blocks - self.max_turn_blocks - self._outstanding(True)
        if overflow > 0:
            self._add(cap_blocks=overflow)

    def pressure(self, free_blocks: int, running_need: int, waiting_need: int, now: float) -> int:
        """Running requests need `running_need` blocks, the waiting ones the next step could
        admit `waiting_need`, and `free_blocks` are free: order the shortfall from the holds
        (any for the running, turns and unread prompts for the waiting), beyond what orders
        outstanding free already. Returns the blocks ordered."""
        if now < self._fruitless_at + FRUITLESS_BACKOFF_S:
            return 0
        held = self._holds
        outstanding = self._outstanding(False)
        evictable = held.held_blocks - outstanding
        for_running = max(0, min(running_need - free_blocks - outstanding, evictable))
        short = running_need + waiting_need - free_blocks - outstanding - for_running
        for_waiting = 0
        if short > 0:
            unread = held.unread_prompt_blocks(UNREAD_PROMPT_S, now)
            turns = held.turn_blocks + unread - self._outstanding(True)
            for_waiting = max(0, min(short, turns, evictable - for_running))
        if for_running or for_waiting:
            self._add(turn_blocks=for_waiting, any_blocks=for_running)
        return for_running + for_waiting

    def take_order(self) -> EvictOrder | None:
        """The order for the step being built (None: nothing to evict)."""
        order, self._next = self._next, EvictOrder()
        self._in_flight.append(order)
        return order if order.total else None

    def reported(self, freed_blocks: int, now: float) -> None:
        """The oldest step in flight reported, with holds of `freed_blocks` blocks ended (its
        order's, and any that ended otherwise): its order is done."""
        if not self._in_flight:
            return  # (no step built here: a report of none)
        order = self._in_flight.popleft()
        if order.total and freed_blocks < order.total:
            self._fruitless_at = now

    def fruitless_since(self, since: float) -> bool:
        """Whether an order freed less than it asked at or after `since` (`time.time()`):
        room this engine needs is held by holds its readers have claimed."""
        return self._fruitless_at >= since

    def frees_pending(self) -> bool:
        """Whether blocks are about to come back from orders made or shipped."""
        return any(order.total for order in self._in_flight) or self._next.total > 0

    def _outstanding(self, turns_only: bool) -> int:
        """Blocks ordered (this step's order and those in flight) and not reported yet: only
        those that turns alone may satisfy, or all."""
        orders = [*self._in_flight, self._next]
        if turns_only:
            return sum(order.cap_blocks + order.turn_blocks for order in orders)
        return sum(order.total for order in orders)

    def _add(self, cap_blocks: int = 0, turn_blocks: int = 0, any_blocks: int = 0) -> None:
        order = self._next
        self._next = EvictOrder(
            order.cap_blocks + cap_blocks,
            order.turn_blocks + turn_blocks,
            order.any_blocks + any_blocks,
        )


def running_blocks_needed(computed: Iterable[int], block_size: int, horizon_tokens: int) -> int:
    """Blocks the running requests' next `horizon_tokens` tokens start (`computed`: each
    one's computed tokens)."""
    return sum(-(-(c + horizon_tokens) // block_size) - -(-c // block_size) for c in computed)


def most_running_blocks(num_requests: int, block_size: int, horizon_tokens: int) -> int:
    """An upper bound of `running_blocks_needed` for `num_requests` requests, whatever their
    computed tokens: each starts at most ceil(horizon / block_size) blocks (plus one, spare)."""
    return num_requests * (-(-horizon_tokens // block_size) + 1)


# Waiting requests vLLM's waiting loop may admit; one waiting for a pull has its blocks already.
_WAITING_STATUSES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class LiveRequests:
    """An engine's requests from arrival to end (in arrival order), and the blocks they need
    before an eviction ordered now can free any: the running ones' next tokens
    (`running_need`), and what vLLM's waiting loop asks of the pool to admit the waiting ones
    in the next step (`waiting_need`)."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        scheduler_config = vllm_config.scheduler_config
        self._block_size = vllm_config.cache_config.block_size
        # The next step's tokens, or the next two steps' with asynchronous scheduling (the
        # step after is scheduled before this one's output, which frees the blocks, is in).
        self._horizon_tokens = (1 + vllm_config.num_lookahead_tokens) * (
            2 if scheduler_config.async_scheduling else 1
        )
        self._lookahead_tokens = vllm_config.num_lookahead_tokens
        self._max_model_len = vllm_config.model_config.max_model_len
        # vLLM's waiting loop's limits and rules (`Scheduler.schedule`, 0.32 and 0.33).
        self._token_budget = (
            scheduler_config.max_num_scheduled_tokens or scheduler_config.max_num_batched_tokens
        )
        self._input_budget = scheduler_config.max_num_batched_tokens
        self._seats = scheduler_config.max_num_active_seqs or scheduler_config.max_num_seqs
        self._whole_prompt = scheduler_config.scheduler_reserve_full_isl
        self._chunked = scheduler_config.enable_chunked_prefill
        self._long_prefill = scheduler_config.long_prefill_token_threshold
        self._long_prefill_adaptive = scheduler_config.long_prefill_token_threshold_adaptive
        self._priority = scheduler_config.policy == "priority"
        self._count: AllocationCount | None = None
        self._requests: dict[str, Request] = {}
        # Requests not seen running since they arrived or were preempted.
        self._waiting: dict[str, Request] = {}
        # The connector's last answer for a waiting request: (tokens, asynchronous load).
        self._matched: dict[str, tuple[int | None, bool]] = {}

    def bind(self, manager: KVCacheManager) -> None:
        self._count = AllocationCount(manager, self._max_model_len)

    def add(self, request: Request) -> None:
        self._requests[request.request_id] = request
        self._waiting[request.request_id] = request

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._waiting.pop(request_id, None)
        self._matched.pop(request_id, None)

    def matched(
        self, request: Request, tokens: int | None, load_async: bool
    ) -> tuple[int | None, bool]:
        """The connector's answer to vLLM's waiting loop for `request`, kept (what admitting
        it takes) and returned: `tokens` the connector loads (None: ask again in the next
        step, vLLM skips it), asynchronously or not."""
        self._matched[request.request_id] = (tokens, load_async)
        return tokens, load_async

    def preempted(self, request_ids: Iterable[str] | None) -> None:
        """vLLM preempted these running requests: they wait again."""
        for request_id in request_ids or ():
            request = self._requests.get(request_id)
            if request is not None:
                self._waiting[request_id] = request

    def others_running(self, request_id: str) -> bool:
        """Whether a request other than `request_id` is running (or was scheduled already in
        the step being scheduled): the engine's next step computes whether it waits or not."""
        return any(
            request.status == RequestStatus.RUNNING
            for other, request in self._requests.items()
            if other != request_id
        )

    def running_need(self, free_blocks: int) -> int:
        """Blocks the running requests' next step(s) start (`running_blocks_needed`); 0
        without walking the requests when `free_blocks` cover the most they could need, so
        an engine far from shortage with nothing waiting pays O(1) per step."""
        if free_blocks >= most_running_blocks(
            len(self._requests), self._block_size, self._horizon_tokens
        ):
            return 0
        return running_blocks_needed(
            (
                r.num_computed_tokens
                for r in self._requests.values()
                if r.status == RequestStatus.RUNNING
            ),
            self._block_size,
            self._horizon_tokens,
        )

    def blocks_needed(self, free_blocks: int, scheduler_output: SchedulerOutput) -> tuple[int, int]:
        """(running, waiting) after the step `scheduler_output` schedules: `running_need` and
        `waiting_need` (counted while it could be met: up to the pool's blocks)."""
        return self.running_need(free_blocks), self.waiting_need(
            scheduler_output.num_scheduled_tokens, self._count.pool_blocks if self._count else 0
        )

    def waiting_need(self, scheduled: dict[str, int], limit: int) -> int:
        """Free blocks vLLM's waiting loop needs in the next step to admit, in its order,
        the waiting requests it would admit with blocks enough: each one's allocation (its
        whole sequence with `scheduler_reserve_full_isl`, vLLM's default; a pull's blocks
        all at once, beside what vLLM keeps for prefills under way; its first chunk
        otherwise), plus vLLM's watermark, after those before it; until the token budget or
        the seats run out, or the need passes `limit`. `scheduled`: this step's tokens per
        request (before vLLM counts them as computed). With nothing waiting, a pass over the
        requests not seen running (pulls under way); else also over the running ones and, for
        each request counted, vLLM's prefix lookup and block counts, as its own step makes."""
        count = self._count
        queue = self._waiting_in_order()
        if count is None or not any(r.status in _WAITING_STATUSES for r in queue):
            return 0  # nothing waits (pulls under way have their blocks)
        running = [r for r in self._requests.values() if r.status == RequestStatus.RUNNING]
        seats = self._seats - len(running)
        long_prefill = self._long_prefill if len(running) + len(queue) > 1 else 0
        if long_prefill and self._long_prefill_adaptive:
            long_prefill = max(long_prefill, self._input_budget // (len(running) + len(queue)))
        # Running requests are scheduled first: a decode takes a token (its blocks are
        # `running_need`'s), a prompt computed in chunks its next chunk, and that chunk's blocks.
        after = {
            r.request_id: r.num_computed_tokens + scheduled.get(r.request_id, 0) for r in running
        }
        budget, chunks = self._token_budget, {}
        for r in running:
            done = after[r.request_id]
            chunk = max(0, min(r.num_tokens - done, long_prefill or budget, budget))
            budget -= max(1, chunk)
            if chunk:
                end = done + chunk
                chunks[r.request_id] = count.blocks(
                    r, count.empty, done, done, end + self._lookahead_tokens, end, False
                )
        taken = sum(chunks.values())
        # Blocks vLLM keeps for prefills under way when it admits a pull: those under way
        # already (counted at the first pull), and those this walk admits.
        under_way: int | None = None
        admitted_under_way = 0
        need = 0
        for request in queue:
            if budget <= 0 or seats <= 0 or need > limit:
                break
            tokens, load_async = self._matched.get(request.request_id, (0, False))
            if request.status not in _WAITING_STATUSES or tokens is None:
                continue  # vLLM skips it
            if request.num_computed_tokens:  # a pull done: its blocks are there, no lookup
                hit, local, tokens, load_async = count.empty, request.num_computed_tokens, 0, False
            else:
                hit, local = count.hit(request)
            computed = local + tokens
            if load_async:
                new = 0
            else:
                new = request.num_tokens - computed
                if 0 < long_prefill < new:
                    new = long_prefill
                if not self._chunked and new > budget:
                    break
                new = min(new, budget)
            lookahead = 0 if load_async else self._lookahead_tokens
            step = count.blocks(
                request, hit, local, computed, computed + new + lookahead, computed + new, False
            )
            whole = min(request.num_tokens, self._max_model_len)
            full = count.blocks(
                request, hit, local, min(computed, self._max_model_len), whole, whole, True
            )
            gate = step
            if load_async:
                if under_way is None:
                    under_way = sum(
                        count.remaining(r) - chunks.get(r.request_id, 0)
                        for r in self._under_way(after)
                    )
                gate += under_way + admitted_under_way
            if self._whole_prompt:
                gate = max(gate, full)
            need = max(need, taken + gate + (count.watermark if running or taken else 0))
            taken += step
            if load_async or computed + new < request.num_tokens:
                admitted_under_way += max(0, full - step)
            if not load_async:
                seats -= 1
                budget -= new
                running.append(request)
        return need

    def _waiting_in_order(self) -> list[Request]:
        """The waiting requests in vLLM's order: those holding blocks (a pull done) first,
        then the preempted (the last first) and the new ones (`fcfs`), or by priority."""
        holding, preempted, new = [], [], []
        for request_id, request in list(self._waiting.items()):
            if request.status == RequestStatus.RUNNING:
                del self._waiting[request_id]
                self._matched.pop(request_id, None)
            elif (
                request.num_computed_tokens
                or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            ):
                holding.append(request)
            elif request.status == RequestStatus.PREEMPTED:
                preempted.append(request)
            else:
                new.append(request)
        if self._priority:

            def key(request: Request) -> tuple[int, float]:
                return request.priority, request.arrival_time

            return sorted(holding, key=key) + sorted(preempted + new, key=key)
        return holding + preempted[::-1] + new

    def _under_way(self, after: dict[str, int]) -> list[Request]:
        """Requests whose prefill is under way with blocks of their own: vLLM's in-flight
        prefills (a pull, or a prompt computed in chunks)."""
        return [
            r
            for r in self._requests.values()
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            or (r.status == RequestStatus.RUNNING and after[r.request_id] < r.num_tokens)
        ]
