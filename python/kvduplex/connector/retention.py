"""How long an engine keeps held blocks: the cap on held turns, memory pressure, expiry.

Held blocks (a prefill node's prompts for their decode nodes, a decode node's finished turns
for the next turn) are worth less than the requests the engine runs: they are given up,
least recently used and unclaimed first, when the engine's free blocks fall below what its
requests need, before vLLM would preempt one of them. Two tiers: what running requests need
for their next step(s) may take any unclaimed hold; what the next step could admit of the
waiting requests may take held turns, and prompts no reader has claimed for `UNREAD_PROMPT_S`.
A prompt held for a decode node is read within moments of its hand-off (its reader asks for it
as soon as it gets the request), and giving it up then makes the decode node compute the whole
prompt, to let a waiting request in a little sooner; but a decode node that computes the prompt
itself (a pull would gain less than its recompute threshold) never asks, and such a prompt
would keep its blocks from waiting requests until its lease ends. A held turn waits for a next
turn that may never come. The scheduler owns
the blocks' references (it frees them once TP rank 0 reports a hold ended); TP rank 0's hold
book owns the claims, so the scheduler orders evictions of *a number of blocks* and the hold
book picks which holds (unclaimed only: no block is freed under a read).

Accounting (`Retention`, pure: time comes in as an argument):
- Every order travels in one step's metadata and is acknowledged once, by TP rank 0, in the
  worker metadata that also reports the holds it freed; until then its blocks count as about
  to be freed, so an eviction shipped and one reported are never counted twice, and two turns
  finishing in one step order only what they need together.
- While an order is outstanding, vLLM's `has_pending_block_frees` says so, and a running
  request that cannot get blocks waits for them instead of preempting another. When vLLM is
  about to preempt and no order is outstanding, one is made there and then.
- An order that freed less than it asked (the rest is claimed) holds back further pressure
  orders for `FRUITLESS_BACKOFF_S`: vLLM then preempts as it would without holds.

Idle engines: vLLM's EngineCore steps only while its scheduler has requests (or a connector
has "push work"); an idle one blocks on its input queue, so a hold that ends while it is idle
would keep its blocks until the next request. `wake_at` is when the engine should step: when
a hold's lease has passed since the last step, or once a second while any hold lasts
(a reader's release or the end of a claim frees a hold too); the idle waker
(`idle_steps.py`) wakes the engine at those moments, so it takes one step, in which TP rank
0 ends the holds and the scheduler frees their blocks.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from kvduplex.connector.metadata import EvictOrder

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

# Under vLLM's logger tree, so vLLM's handler, format and level apply.
logger = init_logger(f"vllm.{__name__}")

# An idle engine with holds steps this often, to free holds whose reader released them.
IDLE_CHECK_S = 1.0
# An eviction order not acknowledged within this long is dropped (a lost step's output).
ORDER_TIMEOUT_S = 5.0
# After an order freed less than asked (claimed holds), no pressure order for this long.
FRUITLESS_BACKOFF_S = 0.5
# A prompt held for a decode node that no reader has claimed for this long since its hold was
# shipped to the workers may be given up for waiting requests. TP rank 0's hold book takes the
# hold a moment after it is shipped and counts from there: it is asked to free prompts unread
# for `UNREAD_MARGIN_S` less, so that what the scheduler counts as unread is unread there too.
UNREAD_PROMPT_S = 1.0
UNREAD_MARGIN_S = 0.1


@dataclass
class _Held:
    num_blocks: int
    turn: bool
    expires_at: float
    # When the hold was shipped to the workers (None: not yet).
    shipped_at: float | None = None


@dataclass(frozen=True)
class _Shipped:
    order: EvictOrder
    sent_at: float


class Retention:
    """The scheduler's view of its holds: blocks held, evictions ordered, when to step."""

    def __init__(self, max_turn_blocks: int) -> None:
        self.max_turn_blocks = max_turn_blocks
        self._held: dict[str, _Held] = {}
        self.held_blocks = 0
        self.turn_blocks = 0
        self._next = EvictOrder()
        self._shipped: deque[_Shipped] = deque()
        self._backoff_until = -math.inf
        self._last_step = -math.inf
        # The idle waker's thread reads the wake time while the engine thread changes holds.
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- holds

    def hold(self, request_id: str, num_blocks: int, turn: bool, expires_at: float) -> None:
        """A hold was taken; a turn past the cap orders room among the older turns."""
        with self._lock:
            if turn:
                overflow = (
                    self.turn_blocks + num_blocks - self.max_turn_blocks - self._outstanding(True)
                )
                if overflow > 0:
                    self._add(cap_blocks=overflow)
                self.turn_blocks += num_blocks
            self._held[request_id] = _Held(num_blocks, turn, expires_at)
            self.held_blocks += num_blocks

    def shipped(self, request_ids: list[str], now: float) -> None:
        """These holds went to the workers with the step built at `now`."""
        with self._lock:
            for request_id in request_ids:
                held = self._held.get(request_id)
                if held is not None and held.shipped_at is None:
                    held.shipped_at = now

    def freed(self, request_id: str) -> int | None:
        """A hold ended: its blocks go back (None: not held)."""
        with self._lock:
            held = self._held.pop(request_id, None)
            if held is None:
                return None
            self.held_blocks -= held.num_blocks
            if held.turn:
                self.turn_blocks -= held.num_blocks
            return held.num_blocks

    # ------------------------------------------------------------- pressure

    def pressure(self, free_blocks: int, running_need: int, waiting_need: int, now: float) -> int:
        """Running requests need `running_need` blocks, the waiting ones the next step could
        admit `waiting_need`, and `free_blocks` are free: order the shortfall from the holds
        (any for the running, turns and unread prompts for the waiting), beyond what orders
        outstanding free already. Returns the blocks ordered."""
        with self._lock:
            if now < self._backoff_until:
                return 0
            outstanding = self._outstanding(False)
            evictable = self.held_blocks - outstanding
            for_running = max(0, min(running_need - free_blocks - outstanding, evictable))
            short = running_need + waiting_need - free_blocks - outstanding - for_running
            for_waiting = 0
            if short > 0:
                unread = sum(
                    h.num_blocks
                    for h in self._held.values()
                    if not h.turn
                    and h.shipped_at is not None
                    and h.shipped_at + UNREAD_PROMPT_S <= now
                )
                turns = self.turn_blocks + unread - self._outstanding(True)
                for_waiting = max(0, min(short, turns, evictable - for_running))
            if for_running or for_waiting:
                self._add(turn_blocks=for_waiting, any_blocks=for_running)
            return for_running + for_waiting

    def take_order(self, now: float) -> EvictOrder | None:
        """The order for this step's metadata (None: nothing to evict)."""
        with self._lock:
            order, self._next = self._next, EvictOrder()
            if not order.total:
                return None
            self._shipped.append(_Shipped(order, now))
            return order

    def acknowledged(self, num_orders: int, freed_blocks: int, now: float) -> None:
        """TP rank 0 carried out the `num_orders` oldest orders, freeing `freed_blocks`
        (reported in the same worker metadata, and already given back with `freed`)."""
        with self._lock:
            asked = 0
            for _ in range(min(num_orders, len(self._shipped))):
                asked += self._shipped.popleft().order.total
            if num_orders and freed_blocks < asked:
                self._backoff_until = now + FRUITLESS_BACKOFF_S

    def frees_pending(self, now: float) -> bool:
        """Whether blocks are about to come back from orders made or shipped."""
        with self._lock:
            while self._shipped and self._shipped[0].sent_at + ORDER_TIMEOUT_S < now:
                self._shipped.popleft()
            return bool(self._shipped) or self._next != EvictOrder()

    def _outstanding(self, turns_only: bool) -> int:
        """Blocks ordered (this step's order and those shipped) and not acknowledged yet:
        only those that turns alone may satisfy, or all."""
        orders = [shipped.order for shipped in self._shipped] + [self._next]
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

    # ----------------------------------------------------------------- idle

    def stepped(self, now: float) -> None:
        """The engine took a step at `now`: TP rank 0 ends what has expired by then."""
        with self._lock:
            self._last_step = now

    def wake_at(self) -> float | None:
        """When the engine should next step to free holds (None: no holds)."""
        with self._lock:
            return self._wake_at()

    def _wake_at(self) -> float | None:
        if not self._held:
            return None
        expiries = (h.expires_at for h in self._held.values() if h.expires_at > self._last_step)
        return min(self._last_step + IDLE_CHECK_S, min(expiries, default=math.inf))


def blocks_needed(
    requests: list[tuple[bool, int, int]],
    block_size: int,
    horizon_tokens: int,
    token_budget: int,
    seats: int,
) -> tuple[int, int]:
    """Blocks an engine's live requests need over its next steps, (running, waiting):
    `requests` is (running, computed tokens, tokens) of each, in scheduling order. A running
    request needs the blocks its next `horizon_tokens` tokens start; waiting ones the blocks
    of their uncomputed tokens, in order, as many as the next step could admit (`token_budget`
    tokens, `seats` requests). Prefix-cache hits are not subtracted: they are counted as free
    blocks too."""
    running_need = waiting_need = 0
    waiting = []
    for running, computed, tokens in requests:
        if running:
            running_need += -(-(computed + horizon_tokens) // block_size) - -(-computed // block_size)
            seats -= 1
        else:
            waiting.append(tokens - computed)
    for uncomputed in waiting[: max(0, seats)]:
        admitted = min(uncomputed, token_budget)
        if admitted <= 0:
            break
        token_budget -= admitted
        waiting_need += -(-admitted // block_size)
    return running_need, waiting_need


def most_blocks_needed(
    num_requests: int, block_size: int, horizon_tokens: int, token_budget: int
) -> int:
    """An upper bound of the sum `blocks_needed` returns for `num_requests` live requests,
    whatever their state: each running one starts at most ceil(horizon / block_size) + 1
    blocks; the admitted waiting ones share the token budget, plus one partial block each."""
    per_running = -(-horizon_tokens // block_size) + 1
    return num_requests * (per_running + 1) + -(-token_budget // block_size)


# Waiting requests whose uncomputed tokens count as needed; one waiting for a pull has its
# blocks already.
_WAITING_STATUSES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class LiveRequests:
    """An engine's requests from arrival to end (in arrival order), and the blocks they need
    before an eviction ordered now can free any (`blocks_needed`)."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        scheduler_config = vllm_config.scheduler_config
        self._block_size = vllm_config.cache_config.block_size
        # The next step's tokens, or the next two steps' with asynchronous scheduling (the
        # step after is scheduled before this one's output, which frees the blocks, is in).
        self._horizon_tokens = (1 + vllm_config.num_lookahead_tokens) * (
            2 if scheduler_config.async_scheduling else 1
        )
        self._token_budget = scheduler_config.max_num_batched_tokens
        self._seats = scheduler_config.max_num_seqs
        self._requests: dict[str, Request] = {}

    def add(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def others_running(self, request_id: str) -> bool:
        """Whether a request other than `request_id` is running (or was scheduled already in
        the step being scheduled): the engine's next step computes whether it waits or not."""
        return any(
            request.status == RequestStatus.RUNNING
            for other, request in self._requests.items()
            if other != request_id
        )

    def blocks_needed(self, free_blocks: int) -> tuple[int, int]:
        """(running, waiting): see `blocks_needed`; (0, 0) without walking the requests when
        `free_blocks` cover the most they could need (`most_blocks_needed`), so an engine far
        from shortage pays O(1) per step, not O(live requests)."""
        if free_blocks >= most_blocks_needed(
            len(self._requests), self._block_size, self._horizon_tokens, self._token_budget
        ):
            return 0, 0
        return blocks_needed(
            [
                (
                    request.status == RequestStatus.RUNNING,
                    request.num_computed_tokens,
                    request.num_tokens,
                )
                for request in self._requests.values()
                if request.status == RequestStatus.RUNNING or request.status in _WAITING_STATUSES
            ],
            self._block_size,
            self._horizon_tokens,
            self._token_budget,
            self._seats,
        )

