"""`retention.py`'s pure logic (orders, pressure) over `holds.py`'s record of held turns (counts,
wake times), on vLLM's own block pool; and the hold book's lease end, which those wake times
count on."""

from __future__ import annotations

import math
import random
import threading
import time

import pytest
from vllm.v1.core.block_pool import BlockPool

from kvduplex import _core
from kvduplex.connector import retention as retention_module
from kvduplex.connector.holds import IDLE_CHECK_S, Holds
from kvduplex.connector.idle_steps import IdleWaker
from kvduplex.connector.retention import Retention, most_running_blocks, running_blocks_needed
from kvduplex.connector.stats import DuplexConnectorStats


class _Book:
    """An engine's holds on a real block pool, and their eviction orders."""

    def __init__(self, max_turn_blocks: int = 100) -> None:
        self.pool = BlockPool(64, enable_caching=False, hash_block_size=16)
        self.holds = Holds(DuplexConnectorStats())
        self.holds.bind(self.pool, lambda: None)
        self.retention = Retention(self.holds, max_turn_blocks)

    def hold(self, request_id: str, num_blocks: int, turn: bool, expires_at: float = 100.0):
        blocks = self.pool.get_new_blocks(num_blocks)
        self.holds.keep(request_id, [b.block_id for b in blocks], turn, expires_at)
        self.pool.free_blocks(blocks)  # the request is freed; the hold's reference stays
        if turn:
            self.retention.turn_held()


def test_pressure_orders_the_shortfall_once_until_its_steps_report():
    b = _Book()
    r = b.retention
    b.hold("a", 4, True)
    b.hold("b", 3, False)
    assert b.holds.held_blocks == 7 and b.holds.turn_blocks == 4
    assert r.pressure(free_blocks=2, running_need=5, waiting_need=0, now=0.0) == 3
    # Ordered, not shipped yet: asking again orders nothing more.
    assert r.pressure(free_blocks=2, running_need=5, waiting_need=0, now=0.0) == 0
    order = r.take_order()
    assert order is not None and (order.cap_blocks, order.turn_blocks, order.any_blocks) == (0, 0, 3)
    # Shipped, its step not reported: still counted as coming back, however long it takes.
    assert r.take_order() is None  # the next step (async scheduling), no order of its own
    assert r.pressure(free_blocks=2, running_need=5, waiting_need=0, now=60.0) == 0
    assert r.frees_pending()
    # Its step reports "b" (3 blocks) ended: nothing is pending, though the next step is not in.
    assert b.holds.end(["b"]) == 3
    r.reported(3, now=60.1)
    assert not r.frees_pending()
    assert b.holds.held_blocks == 4
    # Never more than what is held.
    assert r.pressure(free_blocks=0, running_need=50, waiting_need=0, now=60.2) == 4
    assert b.holds.end(["b"]) == 0  # freed once


def test_waiting_requests_take_held_turns_and_prompts_no_reader_claimed_for_a_while():
    b = _Book()
    r = b.retention
    b.hold("prompt", 4, False)
    b.hold("turn", 3, True)
    # Nothing running needs blocks; the waiting ones need 6 more than are free: the turn's 3.
    assert r.pressure(free_blocks=2, running_need=0, waiting_need=8, now=0.0) == 3
    order = r.take_order()
    assert (order.cap_blocks, order.turn_blocks, order.any_blocks) == (0, 3, 0)
    # A running request short of 2 more may take the prompt too.
    assert r.pressure(free_blocks=0, running_need=5, waiting_need=8, now=0.0) == 2
    assert r.take_order().any_blocks == 2
    # No reader asked for a prompt: after UNREAD_PROMPT_S the waiting ones may take it.
    b = _Book()
    r = b.retention
    b.hold("prompt", 4, False)
    assert r.pressure(free_blocks=0, running_need=0, waiting_need=2, now=60.0) == 0  # unshipped
    b.holds.shipped(["prompt"], now=0.0)
    before = retention_module.UNREAD_PROMPT_S - 0.1
    assert r.pressure(free_blocks=0, running_need=0, waiting_need=2, now=before) == 0
    after = retention_module.UNREAD_PROMPT_S
    assert r.pressure(free_blocks=0, running_need=0, waiting_need=2, now=after) == 2
    assert r.take_order().turn_blocks == 2


def test_turns_past_the_cap_order_room_once():
    b = _Book(max_turn_blocks=10)
    b.hold("t1", 6, True)
    b.hold("t2", 6, True)  # 2 over
    b.hold("p", 6, False)  # prompts do not count
    b.hold("t3", 6, True)  # 6 more over, the 2 ordered already
    order = b.retention.take_order()
    assert (order.cap_blocks, order.turn_blocks, order.any_blocks) == (8, 0, 0)


def test_an_order_that_freed_too_little_holds_pressure_back_for_a_while():
    b = _Book()
    r = b.retention
    b.hold("claimed", 5, True)
    r.pressure(0, 5, 0, now=0.0)
    r.take_order()
    r.reported(0, now=0.1)  # its step freed nothing: the turn is claimed
    assert r.pressure(0, 5, 0, now=0.2) == 0  # vLLM preempts meanwhile
    assert not r.frees_pending()
    assert r.pressure(0, 5, 0, now=0.1 + retention_module.FRUITLESS_BACKOFF_S + 0.01) == 5


def test_an_idle_engine_wakes_at_expiry_and_once_a_second_while_holds_last():
    b = _Book()
    holds = b.holds
    assert holds.wake_at() is None
    holds.stepped(10.0)
    b.hold("a", 1, False, expires_at=10.4)
    assert holds.wake_at() == 10.4
    holds.stepped(10.5)  # the expiry was checked in this step; "a" is claimed and stays
    assert holds.wake_at() == 10.5 + IDLE_CHECK_S
    holds.end(["a"])
    assert holds.wake_at() is None


def test_a_reset_drops_every_hold_and_the_books_later_report_is_expected():
    b = _Book()
    b.hold("t", 3, True)
    b.hold("p", 2, False)
    assert b.pool.get_num_free_blocks() == 63 - 5
    assert sorted(b.holds.drop_all()) == ["p", "t"]
    assert b.pool.get_num_free_blocks() == 63
    assert not b.holds and b.holds.held_blocks == 0 and b.holds.turn_blocks == 0
    assert b.holds.end(["t", "p"]) == 0  # TP rank 0's ends of the dropped holds: no double free
    assert b.pool.get_num_free_blocks() == 63


def test_the_hold_book_has_ended_a_lease_when_the_scheduler_wakes_for_its_end():
    """The scheduler wakes an idle engine at the lease end it announced (time.time()); the hold
    book ends leases on its own clock. CI: the book's end came a moment after the wake-up's
    step, which freed nothing, and the blocks waited for the next once-a-second step."""
    fingerprints = ["0" * 16]
    with _core.Engine("lease-clock", {"model": "none"}) as engine:
        engine.hold("past", 1, time.time() - 0.5, fingerprints=fingerprints, turn=False)
        engine.hold("far", 1, 1e300, fingerprints=fingerprints, turn=True)
        with pytest.raises(ValueError, match="finite"):
            engine.hold("nan", 1, math.nan, fingerprints=fingerprints, turn=True)
        assert engine.expire_holds() == ["past"]
        for attempt in range(5):
            held_at, held_at_monotonic = time.time(), time.monotonic()
            lease_expiry = held_at + 0.3
            engine.hold(f"soon-{attempt}", 1, lease_expiry, fingerprints=fingerprints, turn=False)
            early = engine.expire_holds()
            assert early == [] or time.time() >= lease_expiry  # (a starved host's late look)
            while time.time() < lease_expiry:  # the scheduler's wake-up at wake_at(), to the microsecond
                time.sleep(max(0.0, lease_expiry - time.time() - 0.01))
            # A wall clock being slewed (NTP: 0.5% measured on a VM just started) runs ahead of
            # the monotonic one that the book converted the end to: it ends when that reaches it.
            slewed = (time.time() - held_at) - (time.monotonic() - held_at_monotonic)
            time.sleep(max(0.0, slewed))
            assert engine.expire_holds() == [f"soon-{attempt}"], "the lease outlived its wake-up"
        assert engine.hold_occupancy()[1] == 1  # "far" stays


def test_running_requests_need_the_blocks_their_next_tokens_start():
    # Block 16. Running at 32 tokens: its next token starts a block; at 33: none.
    assert running_blocks_needed([32, 33], 16, 1) == 1
    # Two steps ahead (async scheduling): 31 -> 33 crosses a block boundary.
    assert running_blocks_needed([31], 16, 2) == 1


def test_the_bound_that_spares_the_walk_is_never_below_what_the_walk_finds():
    """An engine with at least `most_running_blocks` free blocks (and nothing waiting) skips
    the per-step walk over its requests: in no state may the walk find more."""
    rng = random.Random(7)
    for _ in range(2000):
        block_size = rng.choice([1, 16, 128])
        horizon = rng.choice([1, 2, 5, 130])
        computed = [rng.randrange(0, 5000) for _ in range(rng.randrange(0, 40))]
        needed = running_blocks_needed(computed, block_size, horizon)
        assert needed <= most_running_blocks(len(computed), block_size, horizon)


def test_the_idle_waker_wakes_the_engine_when_nudged_out_of_waiting_for_nothing():
    """No step due: the waker waits without a timeout. A step that became due is put on the
    engine's queue once the waker is nudged (a lookup opened the copy's renewal window)."""
    due: list[float | None] = [None]
    put = threading.Event()
    waker = IdleWaker(lambda: due[0])  # (no EngineCoreProc here: no thread of its own)
    waker._put = put.set
    thread = threading.Thread(target=waker._run, daemon=True)
    thread.start()
    try:
        time.sleep(0.2)
        assert not put.is_set()
        due[0] = 0.0
        assert not put.wait(0.3), "woke without being told"
        waker.nudge()
        assert put.wait(5.0), "a nudged waker did not wake the engine"
    finally:
        waker.close()
        thread.join(timeout=5)
