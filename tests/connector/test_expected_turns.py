"""A decode node's turns in flight (`expected_turns.py`): the scheduler tells TP rank 0 which
turns it may hold from their first step and settles them when they finish; a lookup that
extends one waits for its hold instead of finding nothing. Real vLLM Scheduler, real workers
with their transfer cores (UCX, side channels)."""

from __future__ import annotations

import threading
import time

from vllm.v1.request import RequestStatus

from duplex_harness import (
    BLOCK_SIZE,
    decode,
    look_up,
    make_kv_caches,
    make_worker,
    prefill,
    prompt_tokens,
)
from kvduplex.connector.metadata import DuplexConnectorMetadata, ExpectedTurn, HoldSpec
from kvduplex.connector.token_fingerprint import block_fingerprints, request_salt

BIDIRECTIONAL = {"bidirectional_kv_xfer": True}
NUM_BLOCKS = 24


def test_a_decode_request_is_expected_from_its_first_step_and_settled_as_it_finishes(engines):
    p, d = engines("P", BIDIRECTIONAL), engines("D", BIDIRECTIONAL)
    prompt = prompt_tokens(70)
    params = prefill(p, "p1", prompt)
    assert all(not step.meta.expected for step in p.steps), "a prefill hands its turn off"
    _, held = decode(d, "d1", prompt, params, max_tokens=5)
    full = prompt[: 70 // BLOCK_SIZE * BLOCK_SIZE]
    full_blocks = tuple(block_fingerprints(full, BLOCK_SIZE, request_salt(None, None, None)))
    expected = [turn for step in d.steps for turn in step.meta.expected]
    assert expected == [ExpectedTurn("d1", full_blocks)]
    # The grant of P's blocks presented the same prompt (hashed once for both).
    grant = next(spec for step in d.steps for spec in step.meta.lookups)
    assert grant.fingerprints[: len(full_blocks)] == full_blocks
    # Settled in the step that ships its hold: TP rank 0 holds it, then settles it.
    step = d.step()
    assert [h.request_id for h in step.meta.holds] == ["d1"] and step.meta.settled == ["d1"]
    assert held["remote_request_id"] == "d1"
    # Aborted before it ran: expected and settled in the same step, never held.
    d.add("d2", prompt, max_tokens=5, params=params)
    d.scheduler.finish_requests("d2", RequestStatus.FINISHED_ABORTED)
    step = d.step()
    assert [t.request_id for t in step.meta.expected] == ["d2"] and step.meta.settled == ["d2"]
    assert step.meta.holds == []


def test_no_turn_is_expected_where_none_could_be_held_or_extended(engines):
    p = engines("P", BIDIRECTIONAL)
    params = prefill(p, "p1", prompt_tokens(70))
    one_way = engines("D", {})
    decode(one_way, "d1", prompt_tokens(70), params, max_tokens=2)
    short = engines("D", BIDIRECTIONAL)
    decode(short, "d2", prompt_tokens(BLOCK_SIZE - 1), {"do_remote_prefill": True}, max_tokens=2)
    for engine in (one_way, short):
        assert all(not s.meta.expected and not s.meta.settled for s in engine.steps), engine.name


def test_a_lookup_that_extends_a_turn_in_flight_waits_for_its_hold(tiny_config_dir):
    """TP rank 0 of the decode node is told the turn is coming; a reader's lookup of the next
    turn's prompt, asked before the hold, is answered with the whole turn once it is held. A
    turn settled without a hold answers with nothing then, not at the lookup's deadline."""
    owner = make_worker(tiny_config_dir, "decode", make_kv_caches(NUM_BLOCKS))
    handshake = owner.get_handshake_metadata()
    address = f"{handshake.host}:{handshake.port}"
    reader = make_worker(
        tiny_config_dir, "prefill", make_kv_caches(NUM_BLOCKS), {"decode_peers": [address]}
    )
    fps = [f"{0xE0 + i:016x}" for i in range(5)]
    try:
        owner.start_load_kv(DuplexConnectorMetadata(expected=[ExpectedTurn("turn", tuple(fps[:2]))]))
        hold = HoldSpec("turn", time.time() + 60, 4, tuple(fps[:4]), turn=True, offer=b"{}")

        def finish_late() -> None:
            time.sleep(0.3)
            owner.start_load_kv(DuplexConnectorMetadata(holds=[hold], settled=["turn"]))

        finisher = threading.Thread(target=finish_late)
        asked_at = time.monotonic()
        finisher.start()
        match = look_up(reader, "next-turn", fps, timeout_s=5.0)
        finisher.join()
        assert match is not None and match.owner_request_id == "turn", match
        assert match.matched_blocks == 4 and time.monotonic() - asked_at >= 0.3
        # Settled without a hold: the lookup gets its answer (none) then, not at its deadline.
        owner.start_load_kv(DuplexConnectorMetadata(expected=[ExpectedTurn("gone", (fps[4],))]))
        threading.Timer(
            0.3, owner.start_load_kv, [DuplexConnectorMetadata(settled=["gone"])]
        ).start()
        asked_at = time.monotonic()
        assert look_up(reader, "after-abort", [fps[4], f"{0xEF:016x}"], timeout_s=5.0) is None
        assert 0.3 <= time.monotonic() - asked_at < 5.0
    finally:
        reader.shutdown()
        owner.shutdown()
