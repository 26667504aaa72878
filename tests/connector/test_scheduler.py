"""DuplexConnector's scheduler side under vLLM's real Scheduler: pulls, holds, leases."""

from __future__ import annotations

import json
import time

import pytest
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.tokenizers import get_tokenizer
from vllm.v1.request import Request, RequestStatus

from duplex_harness import (
    BLOCK_SIZE,
    answer_lookup,
    decode,
    make_engine,
    prefill,
    prompt_tokens,
    running,
)
from kvduplex import protocol
from kvduplex.connector import held_mirror, retention
from kvduplex.connector import lookup as lookup_module
from kvduplex.connector.metadata import (
    AnnouncedChanges,
    DuplexConnectorMetadata,
    DuplexWorkerMetadata,
    LookupMatch,
)
from kvduplex.connector.offers import held_output_tokens
from kvduplex.connector.stats import DuplexConnectorStats
from kvduplex.connector.token_fingerprint import block_fingerprints, request_salt, salt_of
from kvduplex_testing.tiny_model import build_tiny_chat_model

BIDIRECTIONAL = {"bidirectional_kv_xfer": True}


def test_multi_turn_lifecycle(engines):
    p = engines("P", BIDIRECTIONAL)
    d = engines("D", BIDIRECTIONAL)
    turn1 = prompt_tokens(100)

    # Turn 1, P->D: P prefills and holds its 7 blocks for D.
    p_params = prefill(p, "p1", turn1)
    assert p_params["do_remote_prefill"] is True and p_params["do_remote_decode"] is False
    assert p_params["remote_num_tokens"] == 100
    held_on_p = p_params["remote_block_ids"]
    assert len(held_on_p) == 7
    step = p.step()
    assert [h.request_id for h in step.meta.holds] == ["p1"]
    assert all(p.ref_count(b) == 1 for b in held_on_p)

    # D pulls all 100 prompt tokens, then decodes 80 tokens and holds its blocks for turn 2.
    load, d_params = decode(d, "d1", turn1, p_params, max_tokens=80)
    assert load.remote_block_ids == tuple(held_on_p)
    assert load.num_tokens == 100
    assert len(load.local_block_ids) == 7
    assert d_params["do_remote_decode"] is True and d_params["do_remote_prefill"] is False
    assert d_params["remote_num_tokens"] == 179  # prompt + 80 outputs, the last not computed
    assert len(d_params["remote_block_ids"]) == 12

    # vLLM freed the request at once: the hold is the blocks' only reference, and P's engine
    # has no request left that would make it step while the hold lasts.
    assert "p1" not in p.scheduler.requests and not p.scheduler.has_requests()
    # D's read-done notification reaches P's worker: P frees (its prefix cache keeps them).
    p.step(freed_holds={"p1"})
    assert all(p.ref_count(b) == 0 for b in held_on_p)

    # Turn 2 on P: history (turn 1 + D's answer) + a new message. P's prefix cache covers 96
    # tokens; D holds 179, so P pulls 83 tokens (blocks 6..11, the last one partial).
    turn2 = turn1 + [7] * 80 + prompt_tokens(70, start=500)
    p.add("p2", turn2, max_tokens=1, params=d_params)
    step = p.pull_step(d_params)
    (load,) = step.meta.loads
    assert load.num_tokens == 179 - 96
    assert load.remote_block_ids == tuple(d_params["remote_block_ids"][6:12])
    assert step.output.num_scheduled_tokens == {}
    step = p.step(finished_recving={"p2"})
    step = p.step()
    # The read is done: the claim D granted (claim 1) goes back.
    assert [(r.remote_request_id, r.claim_id) for r in step.meta.releases] == [("d1", 1)]
    assert step.output.num_scheduled_tokens == {"p2": len(turn2) - 179}
    p_params2 = step.finished("p2").kv_transfer_params
    assert p_params2["remote_num_tokens"] == len(turn2)

    # P's read released D's hold.
    held_on_d = d_params["remote_block_ids"]
    assert all(d.ref_count(b) == 1 for b in held_on_d)
    d.step(freed_holds={"d1"})
    assert all(d.ref_count(b) == 0 for b in held_on_d)

    # Turn 2 on D: its own prefix cache covers 176 tokens; it pulls the remaining 74 from P.
    load, _ = decode(d, "d2", turn2, p_params2, max_tokens=4)
    assert load.num_tokens == len(turn2) - 176
    assert load.remote_block_ids == tuple(p_params2["remote_block_ids"][11:])


@pytest.mark.parametrize("gain,pulls", [(63, False), (64, True)])
def test_threshold_boundary_prefill_to_decode(engines, gain, pulls):
    p, d = engines("P"), engines("D")
    prompt = prompt_tokens(gain)
    params = prefill(p, "p1", prompt)
    d.add("d1", prompt, max_tokens=2, params=params)
    step = d.pull_step(params)
    # The connector leaves vLLM's scheduler output alone (vLLM's base class forbids changing
    # it): an asynchronous pull is no synchronous load; the workers post it before the forward
    # pass all the same (`bind_connector_metadata`: test_worker_transfer.py).
    assert step.output.has_sync_kv_loads is False
    if pulls:
        assert [load.num_tokens for load in step.meta.loads] == [64]
        assert step.meta.releases == []
    else:
        # Not worth a pull: P is not even asked for a grant (its lease ends the hold).
        assert step.meta.loads == [] and step.meta.releases == []
        assert [s.meta.lookups for s in d.steps] == [[]]
        assert step.output.num_scheduled_tokens == {"d1": gain}
        assert d.stats.data["lookups_skipped"] == 1


@pytest.mark.parametrize("gain,pulls", [(31, False), (32, True)])
def test_threshold_boundary_decode_to_prefill(engines, gain, pulls):
    """The threshold also applies to D->P, beyond P's local prefix-cache hit."""
    config = {**BIDIRECTIONAL, "kv_recompute_threshold": 32}
    p, d = engines("P", config), engines("D", config)
    turn1 = prompt_tokens(64)
    _, d_params = decode(d, "d1", turn1, prefill(p, "p1", turn1), max_tokens=gain + 1)
    p.step(freed_holds={"p1"})
    # P's cache holds the 64 prompt tokens; D holds 64 + gain.
    p.add("p2", turn1 + [7] * (gain + 1) + prompt_tokens(5, start=600), params=d_params)
    step = p.pull_step(d_params)
    if pulls:
        assert [load.num_tokens for load in step.meta.loads] == [gain]
    else:
        assert step.meta.loads == [] and step.meta.releases == []


def test_partial_last_block_is_pulled_and_divergence_inside_it_is_not(engines):
    config = {**BIDIRECTIONAL, "kv_recompute_threshold": 0}
    p, d = engines("P", config), engines("D", config)
    turn1 = prompt_tokens(33)
    _, d_params = decode(d, "d1", turn1, prefill(p, "p1", turn1), max_tokens=8)
    assert d_params["remote_num_tokens"] == 40  # 2 full blocks + 8 tokens

    fresh = engines("P", config)
    history = turn1 + [7] * 8
    fresh.add("same", history + prompt_tokens(30, start=700), params=d_params)
    (load,) = fresh.pull_step(d_params).meta.loads
    assert load.num_tokens == 40 and len(load.remote_block_ids) == 3

    edited = list(history)
    edited[37] = 9  # inside D's partial third block
    fresh.add("edited", edited + prompt_tokens(30, start=800), params=dict(d_params))
    (load,) = fresh.pull_step(d_params).meta.loads
    assert load.num_tokens == 32 and len(load.remote_block_ids) == 2


def test_fingerprint_mismatch_pulls_only_the_matching_prefix(engines, connector_log):
    config = {**BIDIRECTIONAL, "kv_recompute_threshold": 0}
    p, d = engines("P", config), engines("D", config)
    turn1 = prompt_tokens(90)
    _, d_params = decode(d, "d1", turn1, prefill(p, "p1", turn1), max_tokens=10)

    # Reasoning stripped from the history: tokens from position 50 on differ.
    edited = turn1[:50] + prompt_tokens(60, start=900)
    fresh = engines("P", config)
    fresh.add("p2", edited, params=d_params)
    step = fresh.pull_step(d_params)
    (load,) = step.meta.loads
    assert load.num_tokens == 48  # blocks 0-2 match; block 3 holds token 50

    # The first block differs: D holds nothing of this prompt, nothing is pulled or claimed.
    other = engines("P", config)
    other.add("p3", [1] + turn1[1:], params=dict(d_params))
    step = other.pull_step(d_params)
    assert step.meta.loads == [] and step.meta.releases == []
    assert step.output.num_scheduled_tokens == {"p3": 90}


@pytest.mark.parametrize(
    "stop_token_ids,expected",
    [(None, RequestStatus.FINISHED_LENGTH_CAPPED), ([7], RequestStatus.FINISHED_STOPPED)],
)
def test_decode_turn_is_held_after_both_finish_statuses(engines, stop_token_ids, expected):
    p, d = engines("P", BIDIRECTIONAL), engines("D", BIDIRECTIONAL)
    prompt = prompt_tokens(70)
    params = prefill(p, "p1", prompt)
    d.add("d1", prompt, max_tokens=5, params=params, stop_token_ids=stop_token_ids)
    d.pull_step(params)
    d.step(finished_recving={"d1"})
    for _ in range(6):
        finished = d.step(token=7).finished("d1")
        if finished is not None:
            break
    assert finished.finish_reason == RequestStatus.get_finished_reason(expected)
    assert finished.kv_transfer_params["do_remote_decode"] is True
    held = finished.kv_transfer_params["remote_block_ids"]
    assert all(d.ref_count(b) == 1 for b in held)


def test_a_hold_ends_when_tp_rank_0_reports_it(engines, connector_log):
    """A held turn is a reference of the connector's own in vLLM's block pool, not a request
    that vLLM keeps (which would make the engine step non-stop while the hold lasts); with
    tensor parallelism TP rank 0 keeps the hold for every rank and reports its end once."""
    p = engines("P", tp_size=2)
    params = prefill(p, "p1", prompt_tokens(100))
    held = params["remote_block_ids"]
    step = p.step()  # the hold reaches the workers
    assert [h.request_id for h in step.meta.holds] == ["p1"]
    assert not p.scheduler.has_requests()  # nothing keeps the engine stepping
    assert all(p.ref_count(b) == 1 for b in held)
    p.step(freed_holds=["p1", "nobody"])  # rank 0, and a report for no hold
    assert all(p.ref_count(b) == 0 for b in held)
    assert connector_log.messages() == [
        "A worker ended a hold on request nobody, which is not held"
    ]
    # Ended holds are forgotten: a late duplicate report changes nothing.
    p.step(freed_holds=["p1"])
    assert all(p.ref_count(b) == 0 for b in held)


def test_an_aborted_request_is_not_held_and_hands_its_grant_back(engines):
    p, d = engines("P", BIDIRECTIONAL), engines("D", BIDIRECTIONAL)
    prompt = prompt_tokens(70)
    params = prefill(p, "p1", prompt)
    d.add("d1", prompt, max_tokens=5, params=params)
    step = d.step()
    (grant,) = step.meta.lookups
    assert grant.owner_request_id == "p1"
    # Aborted while its grant was on its way: the claim goes back when the grant arrives.
    d.scheduler.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    step = d.step(worker_meta=DuplexWorkerMetadata(lookups={"d1": answer_lookup(grant, params)}))
    step = d.step()
    assert [(r.remote_request_id, r.claim_id) for r in step.meta.releases] == [("p1", 1)]
    assert step.meta.holds == []
    assert "d1" not in d.scheduler.requests
    # Aborted before asking: nothing was granted, nothing to hand back (P's lease ends it).
    d.add("d2", prompt, max_tokens=5, params=params)
    d.scheduler.finish_requests("d2", RequestStatus.FINISHED_ABORTED)
    step = d.step()
    assert step.meta.releases == [] and step.meta.lookups == []


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_config_dir):
    """The tiny chat model: a tokenizer whose words are one token each. (`tiny_config_dir`
    seeds vLLM's block hashes.)"""
    return build_tiny_chat_model(tmp_path_factory.mktemp("chat") / "model")


WORD, STOP_WORD = 300, 400  # token ids of two words of the chat vocabulary


ABORTED, LENGTH = RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_LENGTH_CAPPED


@pytest.mark.parametrize(
    "stop,min_tokens,tokens,status,held",
    [
        # vLLM's frontend saw the stop string and aborted; the engine ran one token further.
        (True, 0, [WORD, STOP_WORD, WORD], ABORTED, 1),
        # ... or several tokens further.
        (True, 0, [WORD, WORD, STOP_WORD, WORD, WORD], ABORTED, 2),
        # The engine reached max_tokens before the frontend's abort came: the client still
        # saw only the answer before the stop string.
        (True, 0, [WORD, STOP_WORD, WORD], LENGTH, 1),
        # Reached max_tokens with no stop string in the answer: all of it.
        (True, 0, [WORD, WORD, WORD], LENGTH, 3),
        # The client aborted before the stop string came.
        (True, 0, [WORD, WORD], ABORTED, None),
        # The client aborted a request without stop strings.
        (False, 0, [WORD, STOP_WORD], ABORTED, None),
        # vLLM ignores a stop string within min_tokens, so only the client can have aborted.
        (True, 2, [STOP_WORD, WORD], ABORTED, None),
        # ... and a stop string within min_tokens does not cut the answer.
        (True, 1, [STOP_WORD, WORD], LENGTH, 2),
    ],
    ids=[
        "stop-string", "stop-string-later", "length-past-stop-string", "length-no-stop-string",
        "client-abort", "client-abort-no-stop", "within-min-tokens", "length-within-min-tokens",
    ],
)
def test_a_turn_holds_the_answer_its_client_saw_and_a_client_abort_is_not_held(
    chat_model_dir, stop, min_tokens, tokens, status, held
):
    """A turn's hold ends where the answer its client saw ends: before the first stop string
    (past `min_tokens`), however the engine finished (a frontend's abort on the stop string,
    or max_tokens reached before that abort came)."""
    p, d = (make_engine(chat_model_dir, name, BIDIRECTIONAL, tokenizer=True) for name in "PD")
    stop_string = get_tokenizer(str(chat_model_dir)).decode([STOP_WORD])
    prompt = prompt_tokens(70)
    params = prefill(p, "p1", prompt)
    request = d.add(
        "d1",
        prompt,
        max_tokens=10,
        params=params,
        stop=[stop_string] if stop else None,
        min_tokens=min_tokens,
    )
    d.pull_step(params)
    d.step(finished_recving={"d1"})
    for _ in range(2 * len(tokens)):
        if len(request.output_token_ids) == len(tokens):
            break
        d.step(token=tokens[len(request.output_token_ids)])
    assert list(request.output_token_ids) == tokens
    # What EngineCore.abort_requests does, for a stop string and a client's abort alike; or
    # what the scheduler does at max_tokens.
    d.scheduler.finish_requests("d1", status)
    holds = d.step().meta.holds
    assert [hold.request_id for hold in holds] == (["d1"] if held is not None else [])
    if held is not None:  # not the tokens the engine computed past the stop string
        # ... nor the last token, whose KV no step computed.
        seen = tokens[: min(held, len(tokens) - 1)]
        offer = protocol.decode_offer(holds[0].offer)
        assert offer[protocol.REMOTE_NUM_TOKENS] == len(prompt) + len(seen)
        salt = request_salt(None, None, None)
        assert list(holds[0].fingerprints) == block_fingerprints([*prompt, *seen], BLOCK_SIZE, salt)


OTHER_WORD = 500


@pytest.mark.parametrize("include_stop", [False, True], ids=["stop-cut", "stop-included"])
@pytest.mark.parametrize("status", [ABORTED, LENGTH], ids=["aborted", "length"])
def test_of_several_stop_strings_the_one_vllm_matches_ends_the_held_answer(
    chat_model_dir, include_stop, status
):
    """As vLLM's frontend (`check_stop_strings`): the stop string that ends first in the answer
    wins, not the one that starts first; with `include_stop_str_in_output` the client saw it
    too."""
    tokenizer = get_tokenizer(str(chat_model_dir))
    tokens = [WORD, STOP_WORD, OTHER_WORD, WORD, WORD]
    # Starts first, ends last; the second ends first.
    stops = [tokenizer.decode([STOP_WORD, OTHER_WORD, WORD]), tokenizer.decode([OTHER_WORD])]
    params = SamplingParams(stop=stops, include_stop_str_in_output=include_stop, max_tokens=5)
    request = Request("r", prompt_tokens(10), params, None)
    request.append_output_token_ids(tokens)
    request.status = status
    assert held_output_tokens(request, tokenizer) == (3 if include_stop else 2)
    # Without a tokenizer vLLM matches no stop strings: a finished request's client saw all.
    assert held_output_tokens(request, None) == (None if status == ABORTED else len(tokens))


def test_the_salt_separates_lora_adapters_by_name_and_path():
    """As in vLLM's block hashes: one adapter name loaded from another path is other KV."""

    def salt(lora: LoRARequest | None, cache_salt: str | None = None) -> str:
        request = Request(
            "r", [1, 2, 3], SamplingParams(), None, lora_request=lora, cache_salt=cache_salt
        )
        return salt_of(request)

    v1, v2 = LoRARequest("adapter", 1, "/loras/a-v1"), LoRARequest("adapter", 1, "/loras/a-v2")
    assert salt(v1) != salt(v2)
    # vLLM's integer id is per engine: not part of the salt.
    assert salt(v1) == salt(LoRARequest("adapter", 7, "/loras/a-v1"))
    assert len({salt(None), salt(v1), salt(None, "tenant"), salt(v1, "tenant")}) == 4


def test_bidirectional_off_decode_frees_at_once(engines):
    p, d = engines("P"), engines("D")
    prompt = prompt_tokens(70)
    _, d_params = decode(d, "d1", prompt, prefill(p, "p1", prompt), max_tokens=3)
    assert d_params is None
    assert "d1" not in d.scheduler.requests


def test_lease_expiry_frees_a_claimed_hold_exactly_once_and_never_early(engines):
    """A hold a reader claimed stays out of the free pool under cache pressure until it
    ends: the eviction that pressure orders frees nothing claimed."""
    now = [0.0]
    p = engines("P", {"kv_lease_ttl_s": 5.0}, num_blocks=16)
    # The worker's hold book, reduced to what this test needs: request id -> lease end; the
    # decode node's claim keeps every hold from eviction.
    book: dict[str, float] = {}

    def expire() -> set[str]:
        ended = {rid for rid, end in book.items() if end <= now[0]}
        for rid in ended:
            del book[rid]
        return ended

    params = prefill(p, "p1", prompt_tokens(100))
    held = set(params["remote_block_ids"])
    assert len(held) == 7
    orders = []

    def worker_step() -> None:
        step = p.step(freed_holds=expire())
        for hold in step.meta.holds:
            assert hold.lease_expiry - time.time() == pytest.approx(5.0, abs=1.0)
            book[hold.request_id] = now[0] + 5.0
        if step.meta.evict is not None:
            orders.append(step.meta.evict)

    worker_step()
    # 16 blocks, block 0 reserved, 7 held: a 9-block prompt (130 tokens) cannot be admitted,
    # evicting cached blocks included, until P's lease ends.
    p.add("big", prompt_tokens(130, start=300), max_tokens=5)
    for _ in range(3):
        now[0] += 1.0
        worker_step()
        orders.clear()
        assert "big" not in running(p)
        assert all(p.ref_count(b) == 1 for b in held)
    now[0] = 5.0
    worker_step()  # lease ends: the workers report it this step
    assert all(p.ref_count(b) == 0 for b in held)
    worker_step()
    assert "big" in running(p)
    assert set(p.block_ids("big")) & held  # the freed blocks are reused only now
    assert expire() == set() and not book


def test_an_eviction_order_counts_until_its_own_steps_report_however_long_the_step(
    engines, monkeypatch
):
    """vLLM asks `has_pending_block_frees` again while the step that carries an eviction order
    still runs (a long forward pass on a busy host, seconds): the order's blocks are still on
    their way, so nothing more is ordered. On the tree before `holds.py`, an order counted for
    `ORDER_TIMEOUT_S` (5 s) only: asked later, the scheduler ordered the same blocks again."""
    p = engines("P", {"kv_lease_ttl_s": 30.0}, num_blocks=16)
    prefill(p, "p1", prompt_tokens(100))  # 7 blocks held
    p.step()
    assert p.duplex.has_pending_block_frees()  # vLLM is about to preempt: an order is made
    orders = []
    real_time = time.time

    def rank0(meta: DuplexConnectorMetadata) -> DuplexWorkerMetadata | None:
        if meta.evict is None:
            return None
        orders.append(meta.evict)
        with monkeypatch.context() as later:
            later.setattr(time, "time", lambda: real_time() + 10.0)
            assert p.duplex.has_pending_block_frees()  # 10 s into the step: still coming
        return DuplexWorkerMetadata(freed_holds=["p1"])

    p.step(rank0=rank0)
    step = p.step(rank0=rank0)
    assert len(orders) == 1 and step.meta.evict is None  # one order, shipped once
    assert "p1" not in p.duplex._held and not p.duplex.has_pending_block_frees()


def test_an_unclaimed_prompt_hold_is_given_up_for_a_running_request_at_once(engines):
    """P's prompt held for a decode node that has not asked yet: a waiting request waits for
    it (giving it up would make the decode node compute the prompt; it does for a second,
    `UNREAD_PROMPT_S`, see the next test), a running request that needs its blocks gets them.
    Its blocks are freed exactly once."""
    p = engines("P", {"kv_lease_ttl_s": 30.0}, num_blocks=16)
    params = prefill(p, "p1", prompt_tokens(100))
    held = set(params["remote_block_ids"])
    p.step()
    # 16 blocks, block 0 reserved, 7 held, 8 free: a 130-token prompt (9 blocks) waits.
    p.add("big", prompt_tokens(130, start=300), max_tokens=5)
    step = p.step()
    assert "big" not in running(p) and step.meta.evict is None
    p.scheduler.finish_requests("big", RequestStatus.FINISHED_ABORTED)
    # A 100-token prompt (7 blocks) runs and grows past 8 blocks: the hold goes first.
    long = p.add("long", prompt_tokens(100, start=600), max_tokens=40)
    orders = []

    def rank0(meta: DuplexConnectorMetadata) -> DuplexWorkerMetadata | None:
        # TP rank 0 frees the unclaimed hold as the step begins and reports it in its output.
        if meta.evict is None:
            return None
        orders.append(meta.evict)
        return DuplexWorkerMetadata(freed_holds=["p1"] if "p1" in p.duplex._held else [])

    for _ in range(60):
        step = p.step(rank0=rank0)
        if step.finished("long") is not None:
            break
    assert step.finished("long") is not None and long.num_preemptions == 0
    assert [order.any_blocks for order in orders][:1] == [1]
    assert all(p.ref_count(b) == 0 for b in held)
    assert p.duplex._held.held_blocks == 0
    assert p.stats.data["held_blocks"] == 0


def test_decode_hold_cap_evicts_to_make_room_for_new_turns(engines):
    config = {**BIDIRECTIONAL, "decode_kv_hold_max_fraction": 0.2}
    p, d = engines("P", config), engines("D", config, num_blocks=64)
    # 64 blocks * 0.2 = 12 blocks may be held: the first turn (7 blocks) fits; the second
    # (7 more) is held too, and the workers are told to free 2 blocks of the least recently
    # used unclaimed turns.
    a, b = prompt_tokens(100), prompt_tokens(100, start=400)
    _, first = decode(d, "d1", a, prefill(p, "p1", a), max_tokens=2)
    assert all(s.meta.evict is None for s in d.steps)
    _, second = decode(d, "d2", b, prefill(p, "p2", b), max_tokens=2)
    assert first is not None and second is not None
    d.step()
    assert [s.meta.evict.cap_blocks for s in d.steps if s.meta.evict] == [2]
    # The worker evicted d1: its blocks come back; a new turn then needs no eviction.
    d.step(freed_holds={"d1"})
    p3_params = prefill(p, "p3", prompt_tokens(20, start=900))
    _, third = decode(d, "d3", prompt_tokens(20, start=900), p3_params, max_tokens=2)
    assert third is not None
    assert [s.meta.evict.cap_blocks for s in d.steps if s.meta.evict] == [2]
    # A turn larger than the whole cap is never held.
    big = prompt_tokens(200, start=2000)
    _, too_big = decode(d, "d4", big, prefill(p, "p4", big), max_tokens=2)
    assert too_big is None


def test_consecutive_turns_past_the_cap_order_each_block_once(engines):
    """Three 7-block turns, 12 blocks allowed. The second turn orders 2; TP rank 0 frees the
    least recently used unclaimed turn (7 blocks) in that order's step and reports it there;
    the third turn then orders its own overflow, 2, not the first order's again (orders still
    in flight are counted once: `test_retention.py`)."""
    config = {**BIDIRECTIONAL, "decode_kv_hold_max_fraction": 0.2}
    p, d = engines("P", config), engines("D", config, num_blocks=64)

    def rank0(meta: DuplexConnectorMetadata) -> DuplexWorkerMetadata | None:
        if meta.evict is None:
            return None
        oldest = next(iter(d.duplex._held._holds))  # (the test's turns are unclaimed)
        return DuplexWorkerMetadata(freed_holds=[oldest])

    for i in range(3):
        prompt = prompt_tokens(100, start=400 * (i + 1))
        decode(d, f"d{i}", prompt, prefill(p, f"p{i}", prompt), max_tokens=2)
        d.step(rank0=rank0)
    assert [s.meta.evict.cap_blocks for s in d.steps if s.meta.evict] == [2, 2]
    assert list(d.duplex._held._holds) == ["d2"] and d.duplex._held.turn_blocks == 7


def test_no_params_without_worker_addresses(engines, connector_log):
    p = engines("P", announce=False)
    p.add("p1", prompt_tokens(40), max_tokens=1, params={"do_remote_decode": True})
    step = p.step()
    assert step.finished("p1").kv_transfer_params is None
    assert "p1" not in p.scheduler.requests
    assert "No transfer-engine address" in connector_log.text


def test_failed_pull_recomputes_from_the_local_hit_and_never_pulls_again(engines):
    p, d = engines("P"), engines("D")
    prompt = prompt_tokens(100)
    params = prefill(p, "p1", prompt)
    d.add("d1", prompt, max_tokens=3, params=params)
    (load,) = d.pull_step(params).meta.loads
    # The read failed: the worker reports the request done with its blocks invalid.
    d.step(finished_recving={"d1"}, invalid_block_ids=set(load.local_block_ids))
    step = d.step()
    assert step.output.num_scheduled_tokens == {"d1": 100}
    assert step.meta.loads == []
    assert d.duplex.get_num_new_matched_tokens(d.scheduler.requests["d1"], 0) == (0, False)


def test_pull_counts_start_at_a_local_prefix_hit(engines):
    p, d = engines("P"), engines("D")
    shared = prompt_tokens(64)
    d.add("warm", shared, max_tokens=1)
    d.step()
    prompt = shared + prompt_tokens(80, start=700)
    params = prefill(p, "p1", prompt)
    d.add("d1", prompt, max_tokens=2, params=params)
    (load,) = d.pull_step(params).meta.loads
    assert load.num_tokens == 80
    assert load.remote_block_ids == tuple(params["remote_block_ids"][64 // BLOCK_SIZE :])


def test_auto_threshold_learns_from_worker_reads_and_steps(engines):
    p, d = engines("P"), engines("D", {"kv_recompute_threshold": "auto"})
    assert d.duplex._decision.recompute_threshold() == 64
    for i in range(4):
        d.add(f"warm{i}", prompt_tokens(100, start=2000 + 100 * i))
        reads = DuplexConnectorStats()
        # Reads far slower than this step's compute: pulling never pays off.
        reads.record_transfer(5.0 * (i + 1), blocks_per_group=(1,), nbytes=1, tokens=16 * (i + 1))
        d.step(worker_stats=reads)
    assert d.duplex._decision.recompute_threshold() == 1025
    prompt = prompt_tokens(300)
    params = prefill(p, "p1", prompt)
    d.add("d1", prompt, max_tokens=2, params=params)
    step = d.step()
    # Not worth asking P for a grant: computed at once.
    assert step.meta.loads == [] and step.meta.lookups == []
    assert step.output.num_scheduled_tokens == {"d1": 300}


# ------------------------------------------------------------------ lookups (no params)

LOOKUP = {
    "bidirectional_kv_xfer": True,
    "lookup_timeout_ms": 100,
    "kv_recompute_threshold": 16,
    # An engine to ask (without one, nothing is looked up).
    "decode_peers": ["127.0.0.1:41002"],
}


def _held_turn(engines) -> tuple[list[int], dict]:
    """D decodes a 100-token turn with 80 outputs and holds it; returns (its tokens, params)."""
    p = engines("P", BIDIRECTIONAL)
    d = engines("D", LOOKUP)
    turn1 = prompt_tokens(100)
    p_params = prefill(p, "p1", turn1)
    _, d_params = decode(d, "d1", turn1, p_params, max_tokens=80)
    d.step()
    (hold,) = [h for s in d.steps for h in s.meta.holds]
    # D offers its finished turn to lookups: fingerprints of every block and its params.
    assert hold.request_id == "d1" and hold.num_blocks == 12 and len(hold.fingerprints) == 12
    assert json.loads(hold.offer) == d_params
    return turn1 + [7] * 79, d_params


def test_lookup_finds_the_held_history_and_pulls_it_with_the_claim(engines):
    history, d_params = _held_turn(engines)
    p2 = engines("P", LOOKUP)
    turn2 = history + prompt_tokens(40, start=600)  # 219 tokens: 13 full blocks
    p2.add("p2", turn2, max_tokens=1, params={"do_remote_decode": True})
    step = p2.step()
    # Not scheduled while the lookup runs; the workers are asked with its full blocks.
    assert step.output.num_scheduled_tokens == {}
    (lookup,) = step.meta.lookups
    assert lookup.request_id == "p2" and len(lookup.fingerprints) == 13
    assert lookup.fingerprints[:11] == tuple(d_params["remote_block_fingerprints"][:11])
    assert p2.step().output.num_scheduled_tokens == {}  # still waiting, asked only once
    assert p2.steps[-1].meta.lookups == []
    match = LookupMatch(
        "D/tp0", "127.0.0.1:41002", "d1", 11, 5, time.time() + 30, json.dumps(d_params).encode()
    )
    p2.step(worker_meta=DuplexWorkerMetadata(lookups={"p2": [match]}))
    step = p2.step()
    (load,) = step.meta.loads
    assert load.remote_request_id == "d1"
    # 11 full blocks matched; the 12th, partial (the answer's tail), matches by fingerprint.
    assert load.num_tokens == 179
    assert load.remote_block_ids == tuple(d_params["remote_block_ids"])
    assert load.lease_expiry == pytest.approx(time.time() + 30.0, abs=5)
    # Every TP rank's load done: the claim goes back.
    p2.step(finished_recving={"p2"})
    assert [(r.remote_request_id, r.claim_id) for r in p2.step().meta.releases] == [("d1", 5)]


def test_no_lookup_and_no_wait_where_no_engine_could_hold_the_prompt(engines):
    """No engine known, or a prompt without one full block: the request is scheduled in its
    first step; once TP rank 0 counts a peer, lookups run."""
    alone = engines("P", {**LOOKUP, "decode_peers": []})
    alone.add("p1", prompt_tokens(200), max_tokens=1, params={"do_remote_decode": True})
    step = alone.step()
    assert step.meta.lookups == [] and "p1" in step.output.num_scheduled_tokens
    alone.step(worker_meta=DuplexWorkerMetadata(lookup_targets=1))
    alone.add("p2", prompt_tokens(200, start=700), max_tokens=1, params={"do_remote_decode": True})
    step = alone.step()
    assert [lookup.request_id for lookup in step.meta.lookups] == ["p2"]
    # Shorter than one block: nothing a lookup could match.
    short = engines("P", LOOKUP)
    short.add("s", prompt_tokens(15), max_tokens=1, params={"do_remote_decode": True})
    step = short.step()
    assert step.meta.lookups == [] and "s" in step.output.num_scheduled_tokens


def _announced(added=(), removed=(), *, whole=False, synced=True) -> DuplexWorkerMetadata:
    """TP rank 0's report of what the decode nodes' announcements changed."""
    return DuplexWorkerMetadata(
        announced=AnnouncedChanges(whole, tuple(added), tuple(removed), synced)
    )


def _looked_up(engine, request_id: str, prompt: list[int], params: dict | None = None) -> bool:
    """Adds the request and runs it to its end; whether it was looked up (a miss answered)."""
    engine.add(request_id, prompt, max_tokens=1, params=params)
    step = engine.step()
    asked = [lookup.request_id for lookup in step.meta.lookups] == [request_id]
    answer = DuplexWorkerMetadata(lookups={request_id: []}) if asked else None
    for _ in range(5):
        if step.finished(request_id) is not None:
            return asked
        step = engine.step(worker_meta=answer)
        answer = None
    raise AssertionError(f"{request_id} did not finish")


def test_what_decode_nodes_announced_rules_out_lookups_that_could_not_gain_enough(
    engines, monkeypatch
):
    """TP rank 0 reports what the decode nodes announced they hold; while that is recent and
    complete, a prompt no decode node holds enough more of than P has to reach the recompute
    threshold prefills in the step it arrives (no step spent asking). A prompt whose blocks
    are announced, a prompt P handed off whose turn is not announced yet, and any prompt once
    the copy is stale are looked up."""
    monkeypatch.setattr(held_mirror, "FRESH_S", 0.5)
    history, d_params = _held_turn(engines)
    # D announces every block of its turn, the partial last one (3 tokens) by its tokens.
    turn_blocks = d_params["remote_block_fingerprints"]
    p = engines("P", LOOKUP)
    p.step(worker_meta=_announced(whole=True, synced=False))
    # Some decode node has not announced all it holds yet: asked.
    assert _looked_up(p, "unsynced", prompt_tokens(100, start=3000))
    p.step(worker_meta=_announced(whole=True))
    assert not _looked_up(p, "new", prompt_tokens(100, start=4000))
    assert p.stats.data["lookups_ruled_out"] == 1

    # D announced the turn: its next turn is asked.
    p.step(worker_meta=_announced(turn_blocks))
    assert _looked_up(p, "p2", history + prompt_tokens(40, start=600))
    # With every full block here, the held turn's partial last block could still be gained,
    # but its 3 tokens are fewer than the recompute threshold (16): not asked.
    assert not _looked_up(p, "p2-other", history + prompt_tokens(40, start=900))
    # Once P has every block D may hold (its own copy of p2's prompt), it is not.
    p2_prompt = history + prompt_tokens(40, start=600)
    assert not _looked_up(p, "p2-longer", p2_prompt + prompt_tokens(20, start=1000))
    # D gave the turn up: nothing to gain beyond what P has (the history, here since p2).
    p.step(worker_meta=_announced(removed=turn_blocks))
    assert not _looked_up(p, "p3", history + prompt_tokens(40, start=1100))

    # P hands a prompt off: the turn D computes after it is asked for before D announces it.
    handed = prompt_tokens(200, start=5000)
    assert not _looked_up(p, "handoff", handed, {"do_remote_decode": True})
    assert _looked_up(p, "next", handed + [7] * 20 + prompt_tokens(40, start=700))
    salt = request_salt(None, None, None)
    handed_blocks = block_fingerprints(handed, BLOCK_SIZE, salt)[: len(handed) // BLOCK_SIZE]
    # Announced, then given up: ruled out again.
    p.step(worker_meta=_announced(handed_blocks))
    p.step(worker_meta=_announced(removed=handed_blocks))
    assert not _looked_up(p, "next-again", handed + [7] * 20 + prompt_tokens(40, start=800))
    assert p.stats.data["lookups_ruled_out"] == 6

    # A prompt shorter than a block handed off: its turn's first block (its tokens and the
    # answer's first) is asked for until announced.
    short = prompt_tokens(10, start=8000)
    assert not _looked_up(p, "short", short, {"do_remote_decode": True})
    turn = short + [7] * 20
    assert _looked_up(p, "after-short", turn + prompt_tokens(20, start=8100))
    # Announced (its full block and its partial one): the guard has done its work, and the 14
    # tokens D holds beyond P's block are fewer than the threshold.
    turn_blocks = block_fingerprints(turn, BLOCK_SIZE, salt)
    p.step(worker_meta=_announced(turn_blocks))
    assert not _looked_up(p, "after-short-2", turn + prompt_tokens(20, start=8200))
    p.step(worker_meta=_announced(removed=turn_blocks))
    assert not _looked_up(p, "after-short-3", turn + prompt_tokens(20, start=8300))
    assert p.stats.data["lookups_ruled_out"] == 8

    # A whole set too large to send leaves the copy incomplete: asked.
    p.step(worker_meta=DuplexWorkerMetadata(announced=AnnouncedChanges(True, (), (), True, False)))
    assert _looked_up(p, "incomplete", prompt_tokens(100, start=9000))
    p.step(worker_meta=_announced(whole=True))
    assert not _looked_up(p, "complete", prompt_tokens(100, start=9100))

    # No step for longer than the copy is trusted: a turn a decode node finished meanwhile is
    # in no report, so the lookup asks.
    time.sleep(0.6)
    assert _looked_up(p, "stale", prompt_tokens(100, start=6000))


def test_an_idle_prefill_node_steps_to_keep_its_copy_of_the_announcements_fresh(
    engines, monkeypatch
):
    """An idle engine takes no step and gets no report: its copy would be stale by the time a
    conversation's next turn comes, and the turn would be asked. While it looks prompts up, it
    asks vLLM for a step (push work) shortly before the copy goes stale; that step's report
    renews it, and a prompt arriving after a pause is still ruled out in its first step. Not
    for longer than `IDLE_REFRESH_S` after its last lookup."""
    monkeypatch.setattr(held_mirror, "FRESH_S", 0.3)
    p = engines("P", LOOKUP)
    p.step(worker_meta=_announced(whole=True))
    assert not p.connector.has_pending_push_work()  # no lookup yet: nothing uses the copy
    assert not _looked_up(p, "first", prompt_tokens(100, start=3000))
    assert not p.connector.has_pending_push_work()
    time.sleep(0.3 - held_mirror.REFRESH_LEAD_S + 0.02)
    assert p.connector.has_pending_push_work()
    # The idle step: TP rank 0 reports every step, here that nothing changed
    # (`test_tp_rank_0_reports_...`: vLLM drops a step's report with nothing in it).
    p.step(worker_meta=DuplexWorkerMetadata())
    assert not p.connector.has_pending_push_work()
    time.sleep(0.2)  # 0.5 s since the last report before the idle step: stale without it
    assert not _looked_up(p, "after-a-pause", prompt_tokens(100, start=4000))
    assert p.stats.data["lookups_ruled_out"] == 2
    # Long after the last lookup the engine stays idle, and a prompt is asked again.
    monkeypatch.setattr(lookup_module, "IDLE_REFRESH_S", 0.1)
    time.sleep(0.35)
    assert not p.connector.has_pending_push_work()
    nudges: list[int] = []
    monkeypatch.setattr(p.duplex._waker, "nudge", lambda: nudges.append(1))
    assert _looked_up(p, "much-later", prompt_tokens(100, start=5000))
    # That lookup opened the window again: the idle waker, which may wait for nothing, is told.
    assert nudges


def test_lookup_miss_or_silence_prefills_and_a_late_claim_is_released(engines):
    history, d_params = _held_turn(engines)
    p2 = engines("P", LOOKUP)
    p2.add("miss", history + [5] * 40, max_tokens=1, params={"do_remote_decode": True})
    p2.step()
    step = p2.step(worker_meta=DuplexWorkerMetadata(lookups={"miss": []}))
    p2.step()
    assert "miss" in running(p2) or p2.steps[-1].finished("miss") is not None
    assert all(not s.meta.loads for s in p2.steps)

    # No answer by the lookup's deadline (100 ms): the workers report it in the first step
    # built past the deadline; that step's report without it, and the request prefills.
    p2.add("silent", prompt_tokens(300, start=2000), max_tokens=1, params={"do_remote_decode": True})
    p2.step()
    time.sleep(0.15)
    step = p2.step()
    assert "silent" not in step.output.num_scheduled_tokens  # its report may hold the answer
    step = p2.step()
    assert "silent" in step.output.num_scheduled_tokens  # it did not: prefills, no grace
    late = LookupMatch(
        "D/tp0", "127.0.0.1:41002", "d1", 3, 9, time.time() + 30, json.dumps(d_params).encode()
    )
    p2.step(worker_meta=DuplexWorkerMetadata(lookups={"silent": [late]}))
    step = p2.step()
    (release,) = step.meta.releases
    assert (release.remote_request_id, release.claim_id) == ("d1", 9)


def test_a_lookup_has_one_deadline_set_when_asked_and_its_last_report_is_taken(engines):
    """The deadline the workers get is the one the scheduler set when it asked: its lookup
    budget (`lookup_timeout_ms`) or, for a grant of the blocks params name, which may need a
    first handshake, `handshake_timeout_s`. An answer in the report of the first step built
    past the deadline (where the workers report every lookup) is still taken."""
    history, d_params = _held_turn(engines)
    p2 = engines("P", LOOKUP)
    p2.add("p2", history + prompt_tokens(40, start=600), max_tokens=1, params={"do_remote_decode": True})
    before = time.monotonic()
    (spec,) = p2.step().meta.lookups
    assert before + 0.1 <= spec.deadline <= time.monotonic() + 0.1
    time.sleep(0.15)
    match = LookupMatch(
        "D/tp0", "127.0.0.1:41002", "d1", 11, 5, time.time() + 30, json.dumps(d_params).encode()
    )
    p2.step(worker_meta=DuplexWorkerMetadata(lookups={"p2": [match]}))
    step = p2.step()
    assert [(load.remote_request_id, load.num_tokens) for load in step.meta.loads] == [("d1", 179)]
    assert step.meta.releases == []

    p3 = engines("P", {**LOOKUP, "handshake_timeout_s": 7})
    p3.add("p3", history + [5] * 40, max_tokens=1, params=d_params)
    before = time.monotonic()
    (spec,) = p3.step().meta.lookups
    assert spec.owner_request_id == "d1"
    assert before + 7 <= spec.deadline <= time.monotonic() + 7


def test_lookup_is_skipped_below_the_threshold_and_answers_are_checked(engines):
    history, d_params = _held_turn(engines)
    p2 = engines("P", {**LOOKUP, "kv_recompute_threshold": 512})
    p2.add("short", history + [5] * 40, max_tokens=1, params={"do_remote_decode": True})
    step = p2.step()
    assert step.meta.lookups == [] and "short" in step.output.num_scheduled_tokens
    # An answer naming another engine than the one that answered is refused, claim released.
    p3 = engines("P", LOOKUP)
    p3.add("spoof", history + [5] * 40, max_tokens=1, params={"do_remote_decode": True})
    p3.step()
    spoof = LookupMatch(
        "X/tp0", "127.0.0.1:41002", "d1", 11, 2, time.time() + 30, json.dumps(d_params).encode()
    )
    p3.step(worker_meta=DuplexWorkerMetadata(lookups={"spoof": [spoof]}))
    step = p3.step()
    assert step.meta.loads == []
    assert [(r.remote_request_id, r.claim_id) for r in step.meta.releases] == [("d1", 2)]


def test_a_garbage_lookup_answer_prefills_normally(engines, connector_log):
    history, _ = _held_turn(engines)
    p2 = engines("P", LOOKUP)
    p2.add("junk", history + [5] * 40, max_tokens=1, params={"do_remote_decode": True})
    p2.step()
    junk = LookupMatch(
        "D/tp0", "127.0.0.1:41002", "d1", 11, 4, time.time() + 30, b"\xff not json"
    )
    p2.step(worker_meta=DuplexWorkerMetadata(lookups={"junk": [junk]}))
    step = p2.step()
    assert step.meta.loads == [] and "junk" in step.output.num_scheduled_tokens
    assert any("malformed params" in m for m in connector_log.messages())


def test_of_two_owners_the_one_whose_partial_block_matches_wins(engines):
    """Two D's hold turns sharing the same full blocks (an older and a newer turn of one
    conversation); both match 11 blocks, but only the newer one's partial 12th block holds the
    prompt's tokens. P takes that one and hands the other claim back."""
    history, d_params = _held_turn(engines)
    older = dict(d_params, remote_request_id="d0", remote_num_tokens=177)
    p2 = engines("P", LOOKUP)
    p2.add("p2", history + prompt_tokens(40, start=600), max_tokens=1, params={"do_remote_decode": True})
    p2.step()
    answers = [
        LookupMatch("D/tp0", "127.0.0.1:41002", "d0", 11, 1, time.time() + 30, json.dumps(older).encode()),
        LookupMatch("D/tp0", "127.0.0.1:41002", "d1", 11, 2, time.time() + 30, json.dumps(d_params).encode()),
    ]
    p2.step(worker_meta=DuplexWorkerMetadata(lookups={"p2": answers}))
    step = p2.step()
    (load,) = step.meta.loads
    assert (load.remote_request_id, load.num_tokens) == ("d1", 179)
    assert [(r.remote_request_id, r.claim_id) for r in step.meta.releases] == [("d0", 1)]


def test_layerwise_pull_of_a_decode_turn_runs_in_the_same_step(engines):
    """`layerwise_load`: P's pull of D's turn is synchronous (vLLM counts the tokens as
    computed and runs the new ones in the same step, each layer waiting for its blocks);
    D's pull of P's prompt stays asynchronous."""
    config = {**BIDIRECTIONAL, "layerwise_load": True}
    p, d = engines("P", config), engines("D", config)
    turn1 = prompt_tokens(100)
    p_params = prefill(p, "p1", turn1)
    load, d_params = decode(d, "d1", turn1, p_params, max_tokens=80)
    assert load is not None and not load.layerwise  # waited for as before (decode() checks)
    p.step(freed_holds={"p1"})

    turn2 = turn1 + [7] * 80 + prompt_tokens(70, start=500)
    p.add("p2", turn2, max_tokens=1, params=d_params)
    step = p.pull_step(d_params)
    (load,) = step.meta.loads
    assert load.layerwise and load.num_tokens == 179 - 96
    # Scheduled at once: the tokens after D's turn, with the pull inside this forward pass.
    assert step.output.num_scheduled_tokens == {"p2": len(turn2) - 179}
    assert step.finished("p2") is not None


def _burst_on_a_small_cache(engines, evictable: bool) -> tuple:
    """D (24 blocks, 23 usable) holds one 7-block turn, then 3 requests decode 32 -> 96
    tokens (6 blocks each: 18 in all, more than the 16 left beside the turn). The test plays
    TP rank 0's hold book: the turn is unclaimed (`evictable`) or claimed by a reader.
    Returns (preemptions, steps whose metadata ordered an eviction, D, D's held turn blocks)."""
    config = {**BIDIRECTIONAL, "decode_kv_hold_max_fraction": 0.5}
    p, d = engines("P", config), engines("D", config, num_blocks=24)
    turn = prompt_tokens(100)
    _, d_params = decode(d, "d1", turn, prefill(p, "p1", turn), max_tokens=2)
    assert d_params is not None
    held = set(d_params["remote_block_ids"])
    assert len(held) == 7 and all(d.ref_count(b) == 1 for b in held)
    burst = [d.add(f"b{i}", prompt_tokens(32, start=3000 + 100 * i), max_tokens=64) for i in range(3)]
    ordered = []

    def rank0(meta: DuplexConnectorMetadata) -> DuplexWorkerMetadata | None:
        if meta.evict is None:
            return None
        ordered.append(len(d.steps) + 1)
        return DuplexWorkerMetadata(
            freed_holds=["d1"] if evictable and "d1" in d.duplex._held else []
        )

    for _ in range(200):
        d.step(rank0=rank0)
        if all(r.is_finished() for r in burst):
            break
    assert all(r.is_finished() for r in burst)
    return sum(r.num_preemptions for r in burst), ordered, d, held


def test_held_blocks_are_evicted_before_any_preemption_under_a_burst(engines):
    preemptions, ordered, d, held = _burst_on_a_small_cache(engines, evictable=True)
    assert preemptions == 0
    assert ordered, "the burst ran the cache short: the turn was ordered out"
    assert "d1" not in d.duplex._held and d.duplex._held.held_blocks == 0
    assert all(d.ref_count(b) == 0 for b in held)  # freed exactly once (never below 0)
    # Control: the same burst with the turn claimed (under a read) preempts instead: vLLM
    # waits for held blocks only while an eviction may free some.
    preemptions, _, d, held = _burst_on_a_small_cache(engines, evictable=False)
    assert preemptions > 0
    assert all(d.ref_count(b) == 1 for b in held)


def test_a_prompt_no_decode_node_asks_for_gives_way_to_waiting_requests(engines, monkeypatch):
    """A decode node that computes a prompt itself (a pull would gain too little) never asks
    for it. Waiting requests short of blocks may take such a prompt once no reader claimed it
    for `UNREAD_PROMPT_S`; before that, and while it lasts, they wait, as for a prompt about to
    be read (a running request's need takes any hold at once)."""
    monkeypatch.setattr(retention, "UNREAD_PROMPT_S", 0.3)
    p = engines("P", BIDIRECTIONAL, num_blocks=16)  # 15 usable
    started = time.time()
    prefill(p, "p1", prompt_tokens(100))  # 7 blocks held for a D that never reads them
    assert p.duplex._held.held_blocks == 7
    waiting = p.add("w", prompt_tokens(150, start=2000), max_tokens=1)  # needs 10 blocks
    ordered = []

    def rank0(meta: DuplexConnectorMetadata) -> DuplexWorkerMetadata | None:
        if meta.evict is None:
            return None
        ordered.append((time.time(), meta.evict))
        return DuplexWorkerMetadata(freed_holds=["p1"] if "p1" in p.duplex._held else [])

    deadline = time.monotonic() + 5
    while not waiting.is_finished() and time.monotonic() < deadline:
        p.step(rank0=rank0)
        time.sleep(0.02)
    assert waiting.is_finished()
    (when, order), *_ = ordered
    assert order.turn_blocks > 0 and order.any_blocks == 0
    assert when - started >= 0.3  # not before the prompt went unread that long
    assert "p1" not in p.duplex._held and p.duplex._held.held_blocks == 0


def test_an_idle_engine_steps_when_a_hold_expires(engines):
    """`has_pending_push_work` (vLLM keeps an idle engine stepping while it is true) turns
    true at a hold's expiry, and false after the step in which TP rank 0 frees it."""
    p = engines("P", {"kv_lease_ttl_s": 1.0, "read_deadline_margin_s": 0.1})
    prefill(p, "p1", prompt_tokens(100))
    p.step()
    assert p.duplex._held
    assert not p.connector.has_pending_push_work()
    holds = p.duplex._held
    wake_at = holds.wake_at()
    assert wake_at is not None and wake_at <= time.time() + 1.0
    time.sleep(max(0.0, wake_at - time.time()) + 0.01)
    assert p.connector.has_pending_push_work()
    p.step()  # the worker's expiry runs in this step; it reports the hold freed
    assert not p.connector.has_pending_push_work()
    p.step(freed_holds={"p1"})
    assert not p.duplex._held and holds.wake_at() is None
    assert not p.connector.has_pending_push_work()
