"""Hybrid models under vLLM's real Scheduler and hybrid KV-cache manager: a full-attention
group and a sliding-window group (32 tokens = two 16-token blocks) sharing one block pool.

What is held, offered and pulled per group: full attention every block of the turn, the
sliding window only the blocks vLLM keeps inside it (its null block, id 0, elsewhere); a pull
happens only when the owner still holds every block each of the reader's groups needs.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import RequestStatus

from duplex_harness import (
    BLOCK_SIZE,
    HEAD_SIZE,
    NUM_KV_HEADS,
    decode,
    make_kv_cache_config,
    make_kv_caches,
    make_worker,
    prefill,
    prompt_tokens,
)
from kvduplex import protocol
from kvduplex.connector.connector import DuplexConnector
from kvduplex.connector.groups import (
    FULL_ATTENTION,
    SLIDING_WINDOW,
    STATE_SPACE,
    TransferGroups,
    UnsupportedKVCacheGroup,
)
from kvduplex.connector.metadata import DuplexConnectorMetadata, LoadSpec, PeerAddress
from kvduplex.connector.params import ParamsContext, Rejected, RemoteBlocks, parse_remote_blocks

WINDOW = 32
HYBRID = {"bidirectional_kv_xfer": True}


def hybrid(engines, name):
    return engines(name, HYBRID, sliding_window=WINDOW)


def test_the_connector_declares_hybrid_manager_support():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    assert supports_hma(DuplexConnector)


@pytest.mark.parametrize("window,retained", [(32, 0), (32, 5), (48, 16), (17, 0)])
def test_the_first_needed_block_is_vllms_first_block_after_the_skipped_tokens(window, retained):
    spec = SlidingWindowSpec(
        block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
        dtype=torch.float32, sliding_window=window, extra_retained_tokens=retained,
    )
    config = KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]
    )
    (group,) = TransferGroups.from_kv_cache_config(config).groups
    # vLLM's own rule, as its SlidingWindowManager applies it (no block pool needed).
    manager = SimpleNamespace(sliding_window=window, extra_retained_tokens=retained)
    for num_tokens in range(0, 200):
        skipped = SlidingWindowManager.get_num_skipped_tokens(manager, num_tokens)
        assert group.first_needed_block(num_tokens) == skipped // BLOCK_SIZE, num_tokens


def test_groups_follow_vllms_window_rule():
    groups = TransferGroups.from_kv_cache_config(make_kv_cache_config(64, sliding_window=WINDOW))
    full, window = groups.groups
    assert (full.kind, window.kind) == (FULL_ATTENTION, SLIDING_WINDOW)
    # The next token after 100 attends to tokens 69..100: blocks from 69 // 16 = 4 on.
    assert full.first_needed_block(100) == 0
    assert window.first_needed_block(100) == 4
    assert window.first_needed_block(31) == 0
    # A pull of 100 tokens needs window blocks 4..6: held -> 100; block 4 freed -> nothing.
    held = [list(range(1, 8)), [0, 0, 0, 0, 12, 13, 14]]
    assert groups.pullable_tokens(held, 100, 0, owner_tokens=100) == 100
    # A window group's blocks may serve a shorter pull than the owner's turn.
    assert groups.pullable_tokens(held, 100, 0, owner_tokens=110) == 100
    freed = [list(range(1, 8)), [0, 0, 0, 0, 0, 13, 14]]
    assert groups.pullable_tokens(freed, 100, 0, owner_tokens=100) == 0
    # ...unless the reader's own cache already covers the freed block.
    assert groups.pullable_tokens(freed, 100, 80, owner_tokens=100) == 100
    assert groups.describe().keys() == {"kv_cache_group0", "kv_cache_group1"}


def test_a_hybrid_turn_is_held_pulled_and_pulled_back_per_group(engines):
    p, d = hybrid(engines, "P"), hybrid(engines, "D")
    turn1 = prompt_tokens(100)

    # P holds all 7 full-attention blocks and the 3 sliding-window blocks inside the window.
    p_params = prefill(p, "p1", turn1)
    full, window = p_params["remote_block_ids"]
    assert len(full) == len(window) == 7
    assert 0 not in full and window[:4] == [0, 0, 0, 0] and 0 not in window[4:]
    held = full + window[4:]
    assert all(p.ref_count(b) == 1 for b in held)

    # D pulls the full group's 7 blocks and the window's 3 into its own non-null blocks.
    load, d_params = decode(d, "d1", turn1, p_params, max_tokens=80)
    assert load.blocks_per_group == (7, 3)
    assert load.remote_block_ids == tuple(full + window[4:])
    assert 0 not in load.local_block_ids and load.num_tokens == 100

    # D's finished turn (179 tokens): the window's blocks from (179 - 31) // 16 = 9 on.
    d_full, d_window = d_params["remote_block_ids"]
    assert d_params["remote_num_tokens"] == 179
    assert d_window[:9] == [0] * 9 and 0 not in d_window[9:] and 0 not in d_full

    p.step(freed_holds={"p1"})
    assert all(p.ref_count(b) == 0 for b in held)

    # Turn 2 on P: its cache covers 96 tokens; it pulls 83, i.e. full blocks 6..11 and the
    # window's blocks 9..11, no block outside the window.
    turn2 = turn1 + [7] * 80 + prompt_tokens(70, start=500)
    p.add("p2", turn2, max_tokens=1, params=d_params)
    step = p.pull_step(d_params)
    (load,) = step.meta.loads
    assert load.num_tokens == 179 - 96
    assert load.blocks_per_group == (6, 3)
    assert load.remote_block_ids == tuple(d_full[6:12] + d_window[9:12])
    step = p.step(finished_recving={"p2"})
    step = p.step()
    assert step.output.num_scheduled_tokens == {"p2": len(turn2) - 179}

    # D's hold is released by P's read; every block D held goes back.
    d_held = d_full + d_window[9:]
    assert all(d.ref_count(b) == 1 for b in d_held)
    d.step(freed_holds={"d1"})
    assert all(d.ref_count(b) == 0 for b in d_held)


def test_no_pull_when_the_owner_freed_a_window_block_the_reader_needs(engines, connector_log):
    p, d = hybrid(engines, "P"), hybrid(engines, "D")
    turn1 = prompt_tokens(100)
    p_params = prefill(p, "p1", turn1)
    # As if P's window had been one block narrower: block 4 is gone on P (its grant says so).
    params = copy.deepcopy(p_params)
    params["remote_block_ids"][1][4] = 0
    d.add("d1", turn1, max_tokens=2, params=params)
    step = d.pull_step(params)
    assert not step.meta.loads
    assert step.output.num_scheduled_tokens == {"d1": 100}  # computed locally
    # P's claim goes back at once.
    assert [(r.remote_request_id, r.claim_id) for r in step.meta.releases] == [("p1", 1)]


def _context(sliding_window):
    return ParamsContext(
        engine_id="D", tp_size=1, total_kv_heads=2, block_size=BLOCK_SIZE, max_model_len=1024,
        bidirectional=True, read_deadline_margin_s=1.0,
        groups=TransferGroups.from_kv_cache_config(
            make_kv_cache_config(64, sliding_window=sliding_window)
        ),
    )


def _params(block_ids, num_tokens=40):
    return {
        "do_remote_prefill": True, "remote_engine_id": "P", "remote_request_id": "p1",
        "remote_host": "127.0.0.1", "remote_port": 41001, "remote_ports": [41001], "tp_size": 1,
        "remote_block_ids": block_ids, "remote_num_tokens": num_tokens,
        "remote_block_size": BLOCK_SIZE, "remote_block_fingerprints": ["0" * 16] * 3,
        "remote_lease_expiry": time.time() + 60,
        protocol.PROTOCOL_KEY: protocol.PROTOCOL_VERSION,
    }


@pytest.mark.parametrize(
    "block_ids,reason",
    [
        ([1, 2, 3], "one list per KV-cache group (2)"),
        ([[1, 2, 3]], "one list per KV-cache group (2)"),
        ([[1, 2, 3], [4, 5]], "remote_block_ids[1] has 2 ids but 40 tokens need 3 block(s)"),
        ([[0, 2, 3], [0, 5, 6]], "remote_block_ids[0] holds out-of-range id 0"),
        ([[1, 2, 3], [4, 0, 6]], "remote_block_ids[1] may hold null blocks only before its window"),
        ([[1, 2, 3], [0, 3, 6]], "duplicate"),
        ([[1, 2, 3], [0, "5", 6]], "integers only"),
    ],
)
def test_malformed_per_group_block_ids_are_rejected_with_the_group_named(block_ids, reason):
    rejected = parse_remote_blocks(_params(block_ids), _context(WINDOW))
    assert isinstance(rejected, Rejected) and reason in rejected.reason, rejected


def test_well_formed_per_group_block_ids_parse():
    parsed = parse_remote_blocks(_params([[1, 2, 3], [0, 5, 6]]), _context(WINDOW))
    assert isinstance(parsed, RemoteBlocks)
    assert parsed.block_ids == ((1, 2, 3), (0, 5, 6))
    # One group: vLLM's flat list, as before.
    parsed = parse_remote_blocks(_params([1, 2, 3]), _context(None))
    assert isinstance(parsed, RemoteBlocks) and parsed.block_ids == ((1, 2, 3),)


def test_at_a_window_edge_the_prompt_is_pulled_but_its_last_token(engines):
    """111 tokens: the window for token 110 starts in block 4 ((110 - 31) // 16), the one for
    the next token in block 5. After a pull of the whole prompt vLLM would recompute token 110
    with block 4 nulled; the pull stops one token short instead, and P keeps block 4 (taken
    back from its prefix cache) so that D finds it."""
    p, d = hybrid(engines, "P"), hybrid(engines, "D")
    prompt = prompt_tokens(111)
    p_params = prefill(p, "p1", prompt)
    full, window = p_params["remote_block_ids"]
    assert window[:4] == [0, 0, 0, 0] and 0 not in window[4:]
    assert all(p.ref_count(b) == 1 for b in full + window[4:])

    d.add("d1", prompt, max_tokens=2, params=p_params)
    step = d.pull_step(p_params)
    (load,) = step.meta.loads
    assert load.num_tokens == 110
    assert load.blocks_per_group == (7, 3)
    assert load.remote_block_ids == tuple(full + window[4:])
    d.step(finished_recving={"d1"})
    step = d.step()
    assert step.output.num_scheduled_tokens == {"d1": 1}  # D computes the last token
    # The block taken back from P's prefix cache is freed with the others when the hold ends.
    p.step(freed_holds={"p1"})
    assert all(p.ref_count(b) == 0 for b in full + window[4:])


def test_a_failed_hybrid_pull_is_reported_per_request_and_recomputed(engines):
    """vLLM maps block-level load errors back to requests only with one KV-cache group; a
    hybrid model's failed pull is reported as the request's (`failed_recving`)."""
    p, d = hybrid(engines, "P"), hybrid(engines, "D")
    prompt = prompt_tokens(100)
    p_params = prefill(p, "p1", prompt)
    d.add("d1", prompt, max_tokens=2, params=p_params)
    assert d.pull_step(p_params).meta.loads
    d.step(finished_recving={"d1"}, failed_recving={"d1"})
    step = d.step()
    assert step.output.num_scheduled_tokens == {"d1": 100}  # recomputed from the start


def test_a_hybrid_worker_reports_a_failed_pull_by_request(tiny_config_dir):
    kv_caches = make_kv_caches(8)
    worker = make_worker(tiny_config_dir, "hybrid-reader", kv_caches, sliding_window=WINDOW)
    try:
        spec = LoadSpec(
            request_id="r1",
            peer=PeerAddress("owner", "127.0.0.1", (1,)),
            remote_request_id="o1",
            local_block_ids=(1, 2),
            remote_block_ids=(3, 4),
            num_tokens=32,
            lease_expiry=time.time() + 30,
            blocks_per_group=(1, 1),
            failure="blocks this request needs cannot be pulled (KV-cache group 1: freed by the owner)",
        )
        worker.begin_step(DuplexConnectorMetadata(loads=[spec]))
        results = worker.get_transfer_results()
        assert results.finished_recving == {"r1"} and results.failed_recving == {"r1"}
        assert worker.get_block_ids_with_load_errors() == set()
    finally:
        worker.shutdown()


# ----------------------------------------------------------------------- state space (Mamba)


def mamba(engines, name):
    return engines(name, HYBRID, mamba=True)


def test_a_mamba_turn_is_pulled_with_its_state_and_pulled_back(engines):
    p, d = mamba(engines, "P"), mamba(engines, "D")
    turn1 = prompt_tokens(100)

    # P stops its prefill one token short: D computes the last token from the state before it.
    p_params = prefill(p, "p1", turn1)
    assert p_params["remote_num_tokens"] == 99
    full, state = p_params["remote_block_ids"]
    assert len(full) == len(state) == 7
    assert 0 not in full and state[:6] == [0] * 6 and state[6] != 0
    assert all(p.ref_count(b) == 1 for b in full + state[6:])

    load, d_params = decode(d, "d1", turn1, p_params, max_tokens=80)
    assert load.num_tokens == 99
    assert load.blocks_per_group == (7, 1)
    assert load.remote_block_ids == tuple(full + state[6:])
    # D's turn: 100 + 80 - 1 tokens computed, its state in block 11 ((179 - 1) // 16).
    d_full, d_state = d_params["remote_block_ids"]
    assert d_params["remote_num_tokens"] == 179
    assert d_state[:11] == [0] * 11 and d_state[11] != 0 and len(d_full) == 12

    # Turn 2 on P: exactly D's 179 tokens come back (the state is after those), P computes
    # the rest but the last token.
    turn2 = turn1 + [7] * 80 + prompt_tokens(70, start=500)
    p.add("p2", turn2, max_tokens=1, params=d_params)
    step = p.pull_step(d_params)
    (load,) = step.meta.loads
    assert load.blocks_per_group[1] == 1 and load.remote_block_ids[-1] == d_state[11]
    local_hit = 179 - load.num_tokens
    assert load.remote_block_ids[:-1] == tuple(d_full[local_hit // 16 :])
    p.step(finished_recving={"p2"})
    # P computes tokens 179..248 (its prompt stops one short), in align mode's chunks that end
    # at block boundaries (192, 240).
    chunks = [p.step().output.num_scheduled_tokens["p2"] for _ in range(3)]
    assert chunks == [192 - 179, 240 - 192, len(turn2) - 1 - 240]


def test_a_mamba_prefill_for_another_engine_stops_one_token_short(engines):
    p = mamba(engines, "P")
    p.add("p1", prompt_tokens(96), max_tokens=20, params={"do_remote_decode": True})
    request = p.scheduler.requests["p1"]
    assert request.num_prompt_tokens == len(request.prompt_token_ids) == 95
    assert request.max_tokens == 1
    # The hash of block 5 covered the dropped token: gone with it.
    assert len(request.block_hashes) == 95 // 16
    # A plain request (no hand-off) keeps its prompt.
    p.add("p2", prompt_tokens(96, start=300), max_tokens=20)
    assert p.scheduler.requests["p2"].num_prompt_tokens == 96


def test_a_mamba_state_is_pulled_only_for_the_owners_whole_turn(engines):
    p, d = mamba(engines, "P"), mamba(engines, "D")
    turn1 = prompt_tokens(100)
    p_params = prefill(p, "p1", turn1)
    _, d_params = decode(d, "d1", turn1, p_params, max_tokens=80)
    # The next prompt differs from D's turn at token 150: D's state (after 179 tokens) is of
    # no use, and no shorter pull has a state.
    turn2 = turn1 + [7] * 50 + [9] * 30 + prompt_tokens(70, start=500)
    p.add("p2", turn2, max_tokens=1, params=d_params)
    steps = [p.pull_step(d_params)]
    while steps[-1].finished("p2") is None and len(steps) < 8:
        steps.append(p.step())
    assert steps[-1].finished("p2") is not None
    assert not any(step.meta.loads for step in steps)
    # P's own cache: its turn-1 state at the block boundary 96 (align mode keeps it).
    computed = sum(step.output.num_scheduled_tokens.get("p2", 0) for step in steps)
    assert computed == len(turn2) - 1 - 96
    # D is told at once that its turn will not be read.
    assert [r.remote_request_id for step in steps for r in step.meta.releases] == ["d1"]


def test_mamba_groups_follow_the_state_rule():
    groups = TransferGroups.from_kv_cache_config(make_kv_cache_config(64, mamba=True))
    full, state = groups.groups
    assert (full.kind, state.kind) == (FULL_ATTENTION, STATE_SPACE)
    assert state.first_needed_block(100) == 6 and state.first_needed_block(96) == 5
    # Never the whole prompt (vLLM recomputes its last token), and only the owner's tokens.
    assert groups.pull_limit(100) == 99
    held = [list(range(1, 8)), [0] * 6 + [20]]
    assert groups.pullable_tokens(held, 99, 0, owner_tokens=99) == 99
    assert groups.pullable_tokens(held, 98, 0, owner_tokens=99) == 0
    assert groups.pullable_tokens(held, 99, 48, owner_tokens=99) == 99
    assert groups.pullable_tokens([held[0], [0] * 7], 99, 0, owner_tokens=99) == 0
    # Of a finished turn's table only the running state is offered.
    assert groups.needed_blocks(1, [0, 0, 5, 0, 0, 0, 20], 99) == [0] * 6 + [20]
    assert groups.needed_blocks(0, [1, 2, 3], 40) == [1, 2, 3]
    assert "state=MAMBA2 shapes=((3, 640), (8, 64, 64)) dtypes=float32,float32" in (
        groups.describe()["kv_cache_group1"]
    )


def _mamba_context():
    return ParamsContext(
        engine_id="D", tp_size=1, total_kv_heads=2, block_size=BLOCK_SIZE, max_model_len=1024,
        bidirectional=True, read_deadline_margin_s=1.0,
        groups=TransferGroups.from_kv_cache_config(make_kv_cache_config(64, mamba=True)),
    )


@pytest.mark.parametrize("state", [[0, 5, 6], [0, 6, 0], [4, 0, 0]])
def test_a_mamba_table_holds_one_state_in_its_last_block(state):
    rejected = parse_remote_blocks(_params([[1, 2, 3], state]), _mamba_context())
    assert isinstance(rejected, Rejected), rejected
    assert "remote_block_ids[1] must hold one state, in its last block, or none" in rejected.reason


def test_a_mamba_table_cut_before_its_state_parses():
    # As a lookup leaves it when the prompt matched only part of the owner's turn.
    parsed = parse_remote_blocks(_params([[1, 2, 3], [0, 0, 0]]), _mamba_context())
    assert isinstance(parsed, RemoteBlocks) and parsed.block_ids[1] == (0, 0, 0)


def test_a_mamba_group_without_prefix_caching_is_refused_naming_the_group():
    config = make_kv_cache_config(64, mamba=True)
    full, state = config.kv_cache_groups
    none_mode = KVCacheGroupSpec(state.layer_names, dataclasses.replace(state.kv_cache_spec, mamba_cache_mode="none"))
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[full, none_mode])
    with pytest.raises(UnsupportedKVCacheGroup, match="KV-cache group 1 is a Mamba group in mamba_cache_mode 'none'"):
        TransferGroups.from_kv_cache_config(config)


def test_a_mamba_turn_with_a_token_in_flight_is_not_held(engines):
    """With async scheduling a finished request may still have a token in flight, and the
    state-space group's state already moves past it: no state of the computed tokens alone."""
    p, d = mamba(engines, "P"), mamba(engines, "D")
    turn1 = prompt_tokens(100)
    p_params = prefill(p, "p1", turn1)
    d.add("d1", turn1, max_tokens=80, params=p_params)
    d.pull_step(p_params)
    d.step(finished_recving={"d1"})
    d.step()
    request = d.scheduler.requests["d1"]
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    blocks = d.scheduler.kv_cache_manager.get_block_ids("d1")
    request.num_in_flight_tokens = 1
    assert d.duplex.request_finished(request, blocks) == (False, None)
    request.num_in_flight_tokens = 0
    _, params = d.duplex.request_finished(request, blocks)
    assert params is not None and params["remote_num_tokens"] == request.num_computed_tokens
