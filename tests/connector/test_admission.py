"""Admission-exact retention under vLLM's real Scheduler: a decode node's held turns yield as
soon as a waiting request's admission (its whole prompt, or its pull's blocks) needs them."""

from __future__ import annotations

import pytest
from vllm.v1.request import RequestStatus

from duplex_harness import BLOCK_SIZE, Engine, answer_lookup, decode, prefill, prompt_tokens
from kvduplex.connector.metadata import DuplexConnectorMetadata, DuplexWorkerMetadata

BIDIRECTIONAL = {"bidirectional_kv_xfer": True, "decode_kv_hold_max_fraction": 0.5}
# A token budget below the waiting prompt: its first chunk fits beside the held turns, the
# whole prompt does not.
BUDGET = 128


class Rank0:
    """Plays D's TP rank 0 within a step: carries out the step's eviction order on the least
    recently held unclaimed turns (its hold book's choice), and answers lookups from `held`."""

    def __init__(self, d: Engine, held: dict | None = None) -> None:
        self.d = d
        self.held = held
        self.orders: list[tuple[int, int]] = []  # (step, blocks ordered)

    def __call__(self, meta: DuplexConnectorMetadata) -> DuplexWorkerMetadata | None:
        lookups = {q.request_id: answer_lookup(q, self.held) for q in meta.lookups}
        if meta.evict is None:
            return DuplexWorkerMetadata(lookups=lookups) if lookups else None
        self.orders.append((len(self.d.steps), meta.evict.total))
        freed, blocks = [], 0
        for request_id, held_blocks in self.d.duplex._held.items():  # oldest hold first
            if blocks >= meta.evict.total:
                break
            freed.append(request_id)
            blocks += len(held_blocks)
        return DuplexWorkerMetadata(lookups=lookups, freed_holds=freed, evictions_done=1)


def _d_with_two_held_turns(engines, reserve_full_isl: bool) -> tuple[Engine, Engine]:
    """D: 32 blocks (31 usable), a 128-token budget; two 7-block turns held (14), 17 free."""
    p = engines("P", BIDIRECTIONAL)
    d = engines(
        "D",
        BIDIRECTIONAL,
        num_blocks=32,
        scheduler={"max_num_batched_tokens": BUDGET, "scheduler_reserve_full_isl": reserve_full_isl},
    )
    for i in range(2):
        turn = prompt_tokens(100, start=1000 * (i + 1))
        _, params = decode(d, f"turn{i}", turn, prefill(p, f"p{i}", turn), max_tokens=2)
        assert params is not None
    d.step()  # the holds are shipped
    assert d.duplex._retention.turn_blocks == 14
    assert d.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 17
    assert all(s.meta.evict is None for s in d.steps)
    return p, d


def test_a_waiting_prompt_that_fits_only_without_the_held_turns_is_admitted_in_the_next_step(
    engines,
):
    """A 300-token prompt (19 blocks) waits behind 14 held blocks with 17 free. vLLM admits a
    prompt only when the whole of it fits (`scheduler_reserve_full_isl`, its default); before
    admission-exact retention the need was counted as the budget's chunk (8 blocks), no
    eviction was ordered, and the prompt waited until a turn's lease ended (120 s)."""
    _, d = _d_with_two_held_turns(engines, reserve_full_isl=True)
    waiting = d.add("w", prompt_tokens(300, start=5000), max_tokens=2)
    rank0 = Rank0(d)
    first = d.step(rank0=rank0)  # vLLM finds the shortage: the prompt waits, the order ships
    assert "w" not in first.output.num_scheduled_tokens
    assert rank0.orders == [(len(d.steps) - 1, 19 - 17)]
    assert "turn0" not in d.duplex._held and "turn1" in d.duplex._held
    second = d.step(rank0=rank0)
    assert waiting.status == RequestStatus.RUNNING
    assert second.output.num_scheduled_tokens == {"w": BUDGET}
    assert len(rank0.orders) == 1 and waiting.num_preemptions == 0


def test_a_waiting_prompt_admitted_by_its_first_chunk_orders_nothing(engines):
    """Without `scheduler_reserve_full_isl` vLLM admits the first chunk (8 blocks): it is
    admitted at once, and nothing held is given up for it yet."""
    _, d = _d_with_two_held_turns(engines, reserve_full_isl=False)
    d.add("w", prompt_tokens(300, start=5000), max_tokens=2)
    rank0 = Rank0(d)
    step = d.step(rank0=rank0)
    assert step.output.num_scheduled_tokens == {"w": BUDGET}
    assert rank0.orders == []


@pytest.mark.parametrize("reserve_full_isl", [True, False])
def test_a_waiting_pull_that_needs_all_its_blocks_at_once_is_admitted_in_the_next_step(
    engines, reserve_full_isl
):
    """D pulls a 300-token prompt from P: an asynchronous load takes the blocks of all its
    tokens at once (19), whatever the token budget and with or without
    `scheduler_reserve_full_isl`; 17 are free beside the held turns. Before admission-exact
    retention its need was the budget's chunk (8 blocks) and it waited."""
    p, d = _d_with_two_held_turns(engines, reserve_full_isl)
    prompt = prompt_tokens(300, start=5000)
    params = prefill(p, "p-w", prompt)
    waiting = d.add("w", prompt, max_tokens=2, params=params)
    rank0 = Rank0(d, held=params)
    for _ in range(5):  # the grant (a lookup round) comes first, with no shortage seen yet
        step = d.step(rank0=rank0)
        if rank0.orders or waiting.status != RequestStatus.WAITING:
            break
    assert rank0.orders == [(len(d.steps) - 1, 19 - 17)], "the pull's blocks were not ordered"
    assert waiting.status == RequestStatus.WAITING and not step.meta.loads
    step = d.step(rank0=rank0)
    assert waiting.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (load,) = step.meta.loads
    assert load.request_id == "w" and len(load.local_block_ids) == -(-300 // BLOCK_SIZE)
    assert len(rank0.orders) == 1
