"""Admission-exact retention under vLLM's real Scheduler: a decode node's held turns yield as
soon as a waiting request's admission (its whole prompt, or its pull's blocks) needs them."""

from __future__ import annotations

import random
import time

import pytest
import vllm
from vllm.v1.request import RequestStatus

from duplex_harness import BLOCK_SIZE, Engine, answer_lookup, decode, prefill, prompt_tokens
from kvduplex.connector.metadata import DuplexConnectorMetadata, DuplexWorkerMetadata
from kvduplex.connector.pull_decision import ALLOCATION_WAIT_S
from kvduplex.connector.retention import FRUITLESS_BACKOFF_S
from kvduplex.connector.vllm_private import VllmShapeError

BIDIRECTIONAL = {"bidirectional_kv_xfer": True, "decode_kv_hold_max_fraction": 0.5}
# A token budget below the waiting prompt: its first chunk fits beside the held turns, the
# whole prompt does not.
BUDGET = 128


class Rank0:
    """Plays D's TP rank 0 within a step: carries out the step's eviction order on the least
    recently held unclaimed turns (its hold book's choice), and answers lookups from `held`."""

    def __init__(self, d: Engine, held: dict | None = None, evict: bool = True) -> None:
        self.d = d
        self.held = held
        self.evict = evict
        self.orders: list[tuple[int, int]] = []  # (step, blocks ordered)

    def __call__(self, meta: DuplexConnectorMetadata) -> DuplexWorkerMetadata | None:
        lookups = {q.request_id: answer_lookup(q, self.held) for q in meta.lookups}
        if meta.evict is None or not self.evict:
            return DuplexWorkerMetadata(lookups=lookups) if lookups else None
        self.orders.append((len(self.d.steps), meta.evict.total))
        freed, blocks = [], 0
        for request_id, hold in self.d.duplex._held._holds.items():  # oldest hold first
            if blocks >= meta.evict.total:
                break
            freed.append(request_id)
            blocks += len(hold.blocks)
        return DuplexWorkerMetadata(lookups=lookups, freed_holds=freed)


def _d_with_two_held_turns(
    engines, reserve_full_isl: bool, **scheduler: int
) -> tuple[Engine, Engine]:
    """D: 32 blocks (31 usable), a 128-token budget; two 7-block turns held (14), 17 free."""
    p = engines("P", BIDIRECTIONAL)
    d = engines(
        "D",
        BIDIRECTIONAL,
        num_blocks=32,
        scheduler={
            "max_num_batched_tokens": BUDGET,
            "scheduler_reserve_full_isl": reserve_full_isl,
            **scheduler,
        },
    )
    for i in range(2):
        turn = prompt_tokens(100, start=1000 * (i + 1))
        _, params = decode(d, f"turn{i}", turn, prefill(p, f"p{i}", turn), max_tokens=2)
        assert params is not None
    d.step()  # the holds are shipped
    assert d.duplex._held.turn_blocks == 14
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


def test_a_granted_pull_that_cannot_be_admitted_gives_its_claim_back_and_computes(engines):
    """The circular wait of bidirectional P/D: D's request pulls a 300-token prompt (19 blocks,
    17 free) from P, granted (P keeps its blocks for D under the claim), while D's held turns
    are claimed by P's requests, which wait for P's blocks: D's hold book frees none. Before,
    D kept the claim until it ran out (30 s) and P's request waited as long. Now, after
    `ALLOCATION_WAIT_S`, D hands the claim back, reads nothing and computes the prompt once
    its turns are free (their claims ended in P's then possible admission)."""
    p, d = _d_with_two_held_turns(engines, reserve_full_isl=True)
    prompt = prompt_tokens(300, start=5000)
    params = prefill(p, "p-w", prompt)
    waiting = d.add("w", prompt, max_tokens=2, params=params)
    claimed = Rank0(d, held=params, evict=False)
    live = d.duplex._live
    for _ in range(5):  # the grant, then vLLM finds the shortage and orders the turns
        if d.step(rank0=claimed).meta.evict is not None:
            break
    assert d.steps[-1].meta.evict is not None and d.duplex._held.turn_blocks == 14  # claimed
    assert live._matched["w"][0] == 300 and waiting.status == RequestStatus.WAITING
    time.sleep(ALLOCATION_WAIT_S)
    step = d.step(rank0=claimed)
    (release,) = step.meta.releases
    assert (release.remote_request_id, release.claim_id) == ("p-w", 1)
    assert not step.meta.loads and live._matched["w"][0] == 0  # computes, for good
    assert waiting.status == RequestStatus.WAITING  # its 19 blocks are still held
    rank0 = Rank0(d, held=params)  # P's reads are done: D's turns are unclaimed again
    time.sleep(FRUITLESS_BACKOFF_S)  # the orders that freed nothing held pressure back
    for _ in range(3):
        step = d.step(rank0=rank0)
        assert not step.meta.loads and not step.meta.releases
        if waiting.status == RequestStatus.RUNNING:
            break
    assert step.output.num_scheduled_tokens == {"w": BUDGET}  # its first chunk, computed
    assert waiting.num_computed_tokens == BUDGET


def test_a_granted_pull_waiting_on_running_requests_alone_keeps_its_claim(engines):
    """An engine that holds nothing waits only for its running requests, which end without
    anyone's claim: its granted pull (19 blocks, 17 free beside a running prompt) keeps the
    claim past `ALLOCATION_WAIT_S` and pulls once the running request is gone."""
    p = engines("P", {})
    d = engines("D", {}, num_blocks=32, scheduler={"max_num_batched_tokens": BUDGET})
    d.add("r", prompt_tokens(200, start=9000), max_tokens=50)  # 13 blocks, then 14
    d.step()
    d.step()
    prompt = prompt_tokens(300, start=5000)
    params = prefill(p, "p-w", prompt)
    waiting = d.add("w", prompt, max_tokens=2, params=params)
    rank0 = Rank0(d, held=params)
    live = d.duplex._live
    for _ in range(5):  # until vLLM had the granted pull's answer
        d.step(rank0=rank0)
        if live._matched.get("w", (None,))[0] is not None:
            break
    assert live._matched["w"][0] == 300 and waiting.status == RequestStatus.WAITING
    time.sleep(ALLOCATION_WAIT_S)
    step = d.step(rank0=rank0)
    assert not step.meta.releases and live._matched["w"][0] == 300
    d.scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    step = d.step(rank0=rank0)
    assert waiting.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (load,) = step.meta.loads
    assert load.request_id == "w" and load.remote_request_id == "p-w"


def test_a_pull_beside_a_prompt_computed_in_chunks_counts_what_vllm_keeps_for_that_prompt(
    engines,
):
    """vLLM admits a pull only if its blocks fit beside what prefills under way still need
    (their reservation), after their next chunks: D computes a 200-token prompt (13 blocks)
    in 64-token chunks while a 100-token pull (7 blocks) waits. When the pull's grant is in,
    9 blocks are free; the next step's chunk takes 4, the pull 7, and vLLM keeps the prompt's
    last block: 3 short, 3 ordered, and the pull is admitted in the next step. (Counted as a
    7-block chunk, nothing was ordered and the pull waited for the prompt's end.)"""
    p, d = _d_with_two_held_turns(engines, reserve_full_isl=False, long_prefill_token_threshold=64)
    pool = d.scheduler.kv_cache_manager.block_pool
    prompt = prompt_tokens(100, start=5000)
    params = prefill(p, "p-w", prompt)
    computed = d.add("c", prompt_tokens(200, start=9000), max_tokens=2)
    waiting = d.add("w", prompt, max_tokens=2, params=params)
    rank0 = Rank0(d, held=params)
    d.step(rank0=rank0)  # c's first chunk; w's grant is asked for
    assert waiting.status == RequestStatus.WAITING and computed.num_computed_tokens == 64
    free_before = pool.get_num_free_blocks()
    assert free_before == 13
    d.step(rank0=rank0)  # c's second chunk (4 blocks: 9 free); w's pull does not fit
    assert waiting.status == RequestStatus.WAITING
    assert rank0.orders == [(len(d.steps) - 1, 4 + 7 + 1 - 9)]
    step = d.step(rank0=rank0)
    assert waiting.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [load.request_id for load in step.meta.loads] == ["w"]
    assert "turn1" in d.duplex._held and len(rank0.orders) == 1


def test_a_prefix_in_use_costs_the_waiting_prompt_nothing(engines):
    """A prompt that starts with a running request's prompt takes those blocks from the prefix
    cache (they are in use: no new block): its need is the rest of the prompt only, so one
    held turn is given up for it, not both (counted as the whole prompt, both would go)."""
    _, d = _d_with_two_held_turns(engines, reserve_full_isl=True)
    shared = prompt_tokens(96, start=7000)  # 6 blocks
    d.add("r", shared, max_tokens=50)
    d.step()
    d.step()
    pool = d.scheduler.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    assert free == 17 - 7  # r: its 6 prompt blocks and the block of its next tokens
    waiting = d.add("w", shared + prompt_tokens(200, start=8000), max_tokens=2)  # 19 blocks
    rank0 = Rank0(d)
    d.step(rank0=rank0)
    assert rank0.orders == [(len(d.steps) - 1, 19 - 6 - free)]
    assert "turn0" not in d.duplex._held and "turn1" in d.duplex._held
    step = d.step(rank0=rank0)
    assert waiting.status == RequestStatus.RUNNING and "w" in step.output.num_scheduled_tokens
    assert len(rank0.orders) == 1


def test_a_vllm_whose_allocation_count_changed_fails_at_start_up(engines, monkeypatch):
    """The waiting requests' need is counted by vLLM's own KV-cache manager (private to
    vLLM, `vllm_private.AllocationCount`): the installed vLLM passes its guard, and a vLLM
    that changed what it is made of fails when the connector is bound, naming the access,
    the part and vLLM's version, instead of counting wrong."""
    d = engines("D", BIDIRECTIONAL)
    manager = d.scheduler.kv_cache_manager
    d.connector.bind_kv_cache_manager(manager)  # the installed vLLM's shape (0.32 and 0.33)
    changes = [
        (manager.coordinator, "get_num_blocks_to_allocate", lambda request_id, num_tokens: 0),
        (manager.coordinator, "find_longest_cache_hit", lambda block_hashes, max_length: None),
        (manager, "watermark_blocks", None),
        (manager.block_pool, "num_gpu_blocks", None),
    ]
    for target, name, value in changes:
        monkeypatch.setattr(target, name, value)
        with pytest.raises(VllmShapeError) as changed:
            d.connector.bind_kv_cache_manager(manager)
        message = str(changed.value)
        assert name in message and "allocation" in message and vllm.__version__ in message
        monkeypatch.undo()
    for name in ("prefix_cache_lookup_enabled", "empty_kv_cache_blocks"):
        owner = type(manager) if name in vars(type(manager)) else manager
        monkeypatch.delattr(owner, name)
        with pytest.raises(VllmShapeError, match=name):
            d.connector.bind_kv_cache_manager(manager)
        monkeypatch.undo()


@pytest.mark.parametrize("reserve_full_isl", [True, False])
def test_the_counted_need_is_exactly_what_vllm_admits_with(engines, reserve_full_isl):
    """Random prompts beside D's held turns, starting with a held turn's tokens (blocks in
    use), a prompt of before (cached free blocks) or nothing: vLLM's next step admits the
    prompt exactly when the free blocks cover the need counted for it, and a pull left waiting
    was counted short of them (nothing runs, nothing is evicted)."""
    rng = random.Random(35)
    p, d = _d_with_two_held_turns(engines, reserve_full_isl)
    pool = d.scheduler.kv_cache_manager.block_pool
    live = d.duplex._live
    turn0 = prompt_tokens(100, start=1000)  # held: its 6 full blocks are in use
    earlier: list[int] = []
    admitted = waited = 0
    for case in range(12):
        prefix = rng.choice([turn0[: 16 * rng.randrange(1, 7)], earlier[:64], []])
        prompt = prefix + prompt_tokens(rng.randrange(40, 420), start=20_000 + 1000 * case)
        if case % 3 == 2:  # a pull of the prompt from P
            params = prefill(p, f"p-{case}", prompt)
            request = d.add(f"w{case}", prompt, max_tokens=2, params=params)
            rank0 = Rank0(d, held=params, evict=False)
            while (
                request.status == RequestStatus.WAITING
                and live._matched.get(request.request_id, (None,))[0] is None
            ):  # until vLLM had the connector's answer
                d.step(rank0=rank0)
            if request.status == RequestStatus.WAITING:
                need = live.waiting_need({}, 10**6)
                assert need > pool.get_num_free_blocks(), (case, need)
                waited += 1
            p.step(freed_holds=[f"p-{case}"])  # P's hold ends (the test never reads it)
        else:
            request = d.add(f"w{case}", prompt, max_tokens=2)
            need, free = live.waiting_need({}, 10**6), pool.get_num_free_blocks()
            d.step()
            fits = request.status == RequestStatus.RUNNING
            assert fits == (need <= free), (case, need, free)
            admitted += fits
            waited += not fits
        d.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
        d.step()
        earlier = prompt
        assert d.duplex._held.turn_blocks == 14  # nothing was evicted
    assert admitted and waited  # both sides of the boundary were seen


def test_waiting_prompts_are_counted_in_order_within_the_token_budget_and_the_seats(engines):
    """Without `scheduler_reserve_full_isl`: a 100-token prompt (7 blocks), then a 200-token
    one, with a 150-token budget: the first whole and the second's 50-token chunk (4 blocks);
    the third gets no budget and is not counted. vLLM's next step schedules exactly those.
    With two seats and one taken, only the first is counted."""
    _, d = _d_with_two_held_turns(engines, reserve_full_isl=False, max_num_batched_tokens=150)
    watermark = d.scheduler.kv_cache_manager.watermark_blocks
    for name, length, start in (("a", 100, 5000), ("b", 200, 6000), ("c", 100, 7000)):
        d.add(name, prompt_tokens(length, start=start))
    assert d.duplex._live.waiting_need({}, 10**6) == 7 + 4 + watermark
    step = d.step()
    assert step.output.num_scheduled_tokens == {"a": 100, "b": 50}

    _, d = _d_with_two_held_turns(engines, reserve_full_isl=False, max_num_seqs=2)
    d.add("r", prompt_tokens(20, start=9000), max_tokens=50)
    d.step()
    d.add("a", prompt_tokens(100, start=5000))
    d.add("b", prompt_tokens(100, start=6000))
    assert d.duplex._live.waiting_need({}, 10**6) == 7 + watermark
    step = d.step()
    assert set(step.output.num_scheduled_tokens) == {"r", "a"}
