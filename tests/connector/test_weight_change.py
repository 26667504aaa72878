"""Weights changed in place (RL rollouts, vLLM's weight updates, sleep and wake): held KV was
computed with the old weights, under the same model path and revision. vLLM's cache reset,
which it does (or its callers must) for every such change, ends every hold: a grant of a hold
taken before is refused and the reader recomputes. vLLM 0.33's sleep-mode hooks also stop
peers' reads of the memory it unmaps, and offer it again after wake-up."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
import torch

from duplex_harness import decode, make_kv_caches, make_worker, prefill, prompt_tokens, running
from kvduplex.connector.metadata import DuplexConnectorMetadata
from test_worker_transfer import (
    NUM_BLOCKS,
    PROMPT_FINGERPRINTS,
    OwnerProcess,
    grant,
    load,
    release,
    run_until_received,
)

LOOKUP = {"bidirectional_kv_xfer": True, "lookup_timeout_ms": 100, "kv_recompute_threshold": 16}
RESETS = {
    "plain": {},
    "external": {"reset_connector": True},
    "running": {"reset_running_requests": True, "reset_connector": True},
}


def _held_turn(engines):
    """D holds a finished turn; returns D and its held blocks."""
    p = engines("P", {"bidirectional_kv_xfer": True})
    d = engines("D", LOOKUP)
    turn1 = prompt_tokens(100)
    _, params = decode(d, "d1", turn1, prefill(p, "p1", turn1), max_tokens=80)
    step = d.step()
    assert [hold.request_id for hold in step.meta.holds] == ["d1"]
    held = params["remote_block_ids"]
    assert all(d.ref_count(block) == 1 for block in held)
    assert not d.connector.has_pending_push_work()
    return d, held


@pytest.mark.parametrize("how", RESETS)
def test_vllm_s_cache_reset_drops_every_hold_and_succeeds(engines, connector_log, how):
    """Through vLLM's real scheduler, with a turn held: its reset (plain, with the connector's,
    and with running requests, the reset of its sleep and pause) succeeds; the hold's blocks
    went back before vLLM's own reset, and the next step (due at once on an idle engine) orders
    TP rank 0 to end every hold, whose report of it is expected."""
    d, held = _held_turn(engines)
    if how == "running":
        d.add("r1", prompt_tokens(40, start=500), max_tokens=50)
        d.step()
        assert running(d) == ["r1"]
    assert d.scheduler.reset_prefix_cache(**RESETS[how]) is True
    assert all(d.ref_count(block) == 0 for block in held)
    assert d.connector.has_pending_push_work()
    step = d.step()
    assert step.meta.end_holds
    assert not d.connector.has_pending_push_work()
    d.step(freed_holds=["d1"])
    # Freed once: only a request running again may have taken some of its blocks.
    computing = set(d.block_ids("r1")) if how == "running" else set()
    assert all(d.ref_count(block) == (block in computing) for block in held)
    assert connector_log.messages() == []
    if how == "running":
        assert running(d) == ["r1"]  # resumed, computing again
    # Nothing held: nothing to end, no step asked for.
    assert d.scheduler.reset_prefix_cache(**RESETS[how]) is True
    assert not d.connector.has_pending_push_work()
    assert not d.step().meta.end_holds


def test_a_reset_that_fails_for_running_requests_keeps_the_holds_unless_the_connector_resets(
    engines,
):
    """A plain reset with a request running fails in vLLM whatever is held: the hold stays.
    With `reset_connector`, the connector's own reset drops it anyway."""
    d, held = _held_turn(engines)
    d.add("r1", prompt_tokens(40, start=500), max_tokens=50)
    d.step()
    assert d.scheduler.reset_prefix_cache() is False
    assert all(d.ref_count(block) == 1 for block in held)
    assert not d.step().meta.end_holds
    assert d.scheduler.reset_prefix_cache(reset_connector=True) is False  # vLLM's own
    assert all(d.ref_count(block) == 0 for block in held)
    assert d.step().meta.end_holds


@pytest.fixture(scope="module")
def owner(tiny_config_dir: Path):
    # Claims last 3 s: a claim its reader never releases ends then.
    process = OwnerProcess(
        tiny_config_dir, engine_id="weights-owner", extra_config={"kv_lease_ttl_s": CLAIM_S}
    )
    yield process
    process.stop()


CLAIM_S = 3.0
# A bound so a broken drain fails the test instead of hanging it; not a speed check.
SLACK_S = 10.0


def test_a_hold_taken_before_the_weights_changed_is_not_granted_nor_written_under_a_read(
    owner, tiny_config_dir
):
    """The owner's worker told to end its holds, as its scheduler orders after vLLM's reset:
    nothing taken before is granted again, and that step does not go on (to write KV into the
    blocks the scheduler gave back) while a reader still reads one: it waits for the read's
    release."""
    worker = make_worker(tiny_config_dir, "weights-reader", make_kv_caches(8))
    try:
        owner.reset()
        owner.hold("w-read", ttl_s=30)
        owner.hold("w-idle", ttl_s=30)
        reading = grant(worker, owner, "w-read", PROMPT_FINGERPRINTS)
        assert reading is not None
        owner.end_holds()
        # The step waits under the read: nothing granted meanwhile, nothing reported yet.
        assert grant(worker, owner, "w-idle", PROMPT_FINGERPRINTS) is None
        assert grant(worker, owner, "w-read", PROMPT_FINGERPRINTS) is None
        owner.poll(0.5)
        assert owner.ended_holds_at == [] and owner.freed_holds == []
        # The read ends: the step goes on, each hold freed once.
        released_at = time.monotonic()
        worker.begin_step(DuplexConnectorMetadata(releases=[release(owner, reading)]))
        owner.collect(until=2)
        assert len(owner.ended_holds_at) == 1 and owner.ended_holds_at[0] >= released_at
        assert owner.ended_holds_at[0] < released_at + SLACK_S
        assert sorted(owner.freed_holds) == ["w-idle", "w-read"]
        # A hold taken after the change is granted as any.
        owner.hold("w-new", ttl_s=30)
        newer = grant(worker, owner, "w-new", PROMPT_FINGERPRINTS)
        assert newer is not None
        worker.begin_step(DuplexConnectorMetadata(releases=[release(owner, newer)]))
        owner.collect(until=3)
        assert owner.freed_holds[2:] == ["w-new"]
    finally:
        worker.shutdown()


def test_a_step_that_ends_holds_waits_for_an_unreleased_read_until_its_claims_deadline(
    owner, tiny_config_dir
):
    """A reader that never releases its claim (it died, say) holds the step up until the
    claim's deadline, by which its reads fail, and no longer."""
    worker = make_worker(tiny_config_dir, "weights-silent-reader", make_kv_caches(8))
    try:
        owner.reset()
        owner.hold("w-silent", ttl_s=30)
        claimed_at = time.monotonic()
        assert grant(worker, owner, "w-silent", PROMPT_FINGERPRINTS) is not None
        owner.end_holds()
        owner.collect(until=1)
        assert owner.freed_holds == ["w-silent"]
        (ended_at,) = owner.ended_holds_at
        assert claimed_at + CLAIM_S - 0.1 <= ended_at < claimed_at + CLAIM_S + SLACK_S
    finally:
        worker.shutdown()


def _until(attempt, what: str):
    """`attempt()` again until it returns something true (a reader's backoff after its owner
    went away may refuse the first tries); a bound, not a speed check."""
    deadline = time.monotonic() + SLACK_S
    while not (result := attempt()):
        assert time.monotonic() < deadline, what
        time.sleep(0.2)
    return result


def test_sleep_mode_hooks_stop_peers_reads_and_wake_up_offers_the_caches_again(
    owner, tiny_config_dir
):
    """vLLM 0.33's sleep-mode hooks on the owner's real worker, a reader in this process:
    before sleep every hold ends and a connected reader's read fails cleanly (its connection
    ends; a new one finds nothing to read) instead of reaching memory about to be unmapped;
    after wake-up a new hold is granted and read value for value. Each hook is idempotent."""
    caches = make_kv_caches(NUM_BLOCKS)
    worker = make_worker(tiny_config_dir, "sleep-reader", caches, {"handshake_timeout_s": 2})
    try:
        owner.reset()
        owner.hold("s-read", ttl_s=30)
        match = grant(worker, owner, "s-read", PROMPT_FINGERPRINTS)  # connected
        worker.begin_step(DuplexConnectorMetadata(releases=[release(owner, match)]))
        owner.collect(until=1)
        owner.hold("s-asleep", ttl_s=30)
        owner.sleep(True)
        owner.sleep(True)
        owner.collect(until=2)
        assert owner.freed_holds == ["s-read", "s-asleep"]
        assert grant(worker, owner, "s-asleep", PROMPT_FINGERPRINTS) is None
        failed = run_until_received(worker, load(owner, "s-asleep-read", [1, 2], [3, 4]))
        assert failed == {1, 2} and not any(t.any() for t in caches.values())

        owner.sleep(False)
        owner.sleep(False)
        owner.hold("s-awake", ttl_s=30)
        _until(lambda: grant(worker, owner, "s-awake", PROMPT_FINGERPRINTS), "no grant")
        attempts = itertools.count()
        _until(
            lambda: not run_until_received(
                worker, load(owner, f"s-awake-read-{next(attempts)}", [5, 6], [7, 8])
            ),
            "no read after wake-up",
        )
        for name, tensor in caches.items():
            for lid, rid in zip([5, 6], [7, 8]):
                assert torch.equal(tensor[lid], owner.expected[name][rid]), (name, lid, rid)
    finally:
        worker.shutdown()
