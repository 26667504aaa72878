"""A decode node's turns in flight (`expected_turns.py`): the scheduler tells TP rank 0 which
turns it may hold from their first step and settles them when they finish; the prefill node's
lookup of a prompt that continues one it handed off names it, and waits for its hold instead of
finding nothing. Real vLLM Scheduler, real workers with their transfer cores (UCX, side
channels)."""

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
from kvduplex.connector.metadata import (
    DuplexConnectorMetadata,
    ExpectedTurn,
    HoldSpec,
)
from kvduplex.connector.token_fingerprint import PromptFingerprints, request_salt

BIDIRECTIONAL = {"bidirectional_kv_xfer": True}
NUM_BLOCKS = 24


def test_a_decode_request_is_expected_from_its_first_step_and_settled_as_it_finishes(engines):
    p, d = engines("P", BIDIRECTIONAL), engines("D", BIDIRECTIONAL)
    prompt = prompt_tokens(70)
    params = prefill(p, "p1", prompt)
    assert all(not step.meta.expected for step in p.steps), "a prefill hands its turn off"
    _, held = decode(d, "d1", prompt, params, max_tokens=5)
    fingerprints = PromptFingerprints(prompt, BLOCK_SIZE, request_salt(None, None, None))
    expected = [turn for step in d.steps for turn in step.meta.expected]
    assert expected == [ExpectedTurn("d1", fingerprints.end)]
    # The grant of P's blocks presented the same prompt (hashed once for both).
    grant = next(spec for step in d.steps for spec in step.meta.lookups)
    assert grant.fingerprints == tuple(fingerprints.of_prefix(70))
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
    # A decode node that keeps no turns expects none.
    one_way = engines("D", {})
    decode(one_way, "d3", prompt, prefill(p, "p3", prompt), max_tokens=2)
    assert all(not s.meta.expected and not s.meta.settled for s in one_way.steps)


def test_the_next_turns_lookup_names_the_prompt_handed_off_until_its_turn_is_announced(engines):
    """P hands a prompt to D; the next turn's lookup names that prompt's end (D answers "not
    yet" while it computes the turn). A prompt sharing only its full blocks names nothing."""
    p = engines("P", {**BIDIRECTIONAL, "lookup_timeout_ms": 100, "kv_recompute_threshold": 16})
    prompt = prompt_tokens(70)
    prefill(p, "p1", prompt)
    handed = PromptFingerprints(prompt, BLOCK_SIZE, request_salt(None, None, None))
    hand_off = {"do_remote_decode": True}
    p.add("p2", prompt + prompt_tokens(60, start=900), params=hand_off)
    p.add("p3", prompt[:64] + prompt_tokens(60, start=900), params=hand_off)
    lookups = {spec.request_id: spec for spec in p.step().meta.lookups}
    assert lookups["p2"].continues == handed.end
    assert lookups["p3"].continues is None
    # P's transfer core knows which D it granted that prompt to by the hold's last fingerprint.
    (hold,) = [h for step in p.steps for h in step.meta.holds if h.request_id == "p1"]
    assert hold.fingerprints[-1] == handed.end


def test_a_lookup_continuing_a_turn_in_flight_waits_for_its_hold(tiny_config_dir):
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
    end, gone = f"{0xD0:016x}", f"{0xD1:016x}"
    try:
        owner.begin_step(DuplexConnectorMetadata(expected=[ExpectedTurn("turn", end)]))
        hold = HoldSpec("turn", time.time() + 60, 4, tuple(fps[:4]), turn=True, offer=b"{}")

        def finish_late() -> None:
            time.sleep(0.3)
            owner.begin_step(DuplexConnectorMetadata(holds=[hold], settled=["turn"]))

        finisher = threading.Thread(target=finish_late)
        asked_at = time.monotonic()
        finisher.start()
        match = look_up(reader, "next-turn", fps, timeout_s=5.0, continues=end)
        finisher.join()
        assert match is not None and match.owner_request_id == "turn", match
        assert match.matched_blocks == 4 and time.monotonic() - asked_at >= 0.3
        owner.get_transfer_results()
        assert owner.get_kv_connector_stats().data["lookups_awaited"] >= 1
        # Settled without a hold: the lookup gets its answer (none) then, not at its deadline.
        owner.begin_step(DuplexConnectorMetadata(expected=[ExpectedTurn("gone", gone)]))
        threading.Timer(
            0.3, owner.begin_step, [DuplexConnectorMetadata(settled=["gone"])]
        ).start()
        asked_at = time.monotonic()
        assert look_up(reader, "after-abort", [fps[4]], timeout_s=5.0, continues=gone) is None
        assert 0.3 <= time.monotonic() - asked_at < 5.0
    finally:
        reader.shutdown()
        owner.shutdown()
