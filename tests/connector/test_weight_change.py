"""Weights changed in place (RL rollouts, vLLM's weight updates, sleep and wake): held KV was
computed with the old weights, under the same model path and revision. vLLM's cache reset,
which it does (or its callers must) for every such change, ends every hold: a grant of a hold
taken before is refused and the reader recomputes."""

from __future__ import annotations

from pathlib import Path

import pytest

from duplex_harness import make_kv_caches, make_worker, prefill, prompt_tokens
from kvduplex.connector.metadata import DuplexConnectorMetadata, DuplexWorkerMetadata
from test_worker_transfer import PROMPT_FINGERPRINTS, OwnerProcess, grant, release


def test_vllm_s_cache_reset_ends_every_hold_at_the_next_step(engines):
    """Through vLLM's real scheduler: its reset cannot free blocks that P holds for a decode
    node, but it tells the connector, whose next step (due at once on an idle engine) orders
    every hold ended; once the worker reports them freed, vLLM's reset succeeds."""
    p = engines("P")
    held = prefill(p, "p1", prompt_tokens(64))["remote_block_ids"]
    step = p.step()
    assert [hold.request_id for hold in step.meta.holds] == ["p1"] and not step.meta.end_holds
    assert all(p.ref_count(block) == 1 for block in held)
    assert not p.connector.has_pending_push_work()

    assert p.scheduler.reset_prefix_cache(reset_connector=True) is False  # blocks in use
    assert p.connector.has_pending_push_work()
    assert p.step().meta.end_holds
    assert not p.connector.has_pending_push_work()
    p.step(worker_meta=DuplexWorkerMetadata(), freed_holds=["p1"])
    assert all(p.ref_count(block) == 0 for block in held)
    # Nothing held: nothing to end, no step asked for.
    assert p.scheduler.reset_prefix_cache(reset_connector=True) is True
    assert not p.connector.has_pending_push_work()
    assert not p.step().meta.end_holds


@pytest.fixture(scope="module")
def owner(tiny_config_dir: Path):
    process = OwnerProcess(tiny_config_dir, engine_id="weights-owner")
    yield process
    process.stop()


def test_a_hold_taken_before_the_weights_changed_is_not_granted(owner, tiny_config_dir):
    """The owner's worker told to end its holds, as its scheduler orders after vLLM's reset."""
    worker = make_worker(tiny_config_dir, "weights-reader", make_kv_caches(8))
    try:
        owner.hold("w-read", ttl_s=30)
        owner.hold("w-idle", ttl_s=30)
        reading = grant(worker, owner, "w-read", PROMPT_FINGERPRINTS)
        assert reading is not None
        owner.end_holds()
        # The unclaimed hold is freed at once; the claimed one stays under its read.
        owner.collect(until=1)
        assert owner.freed_holds == ["w-idle"]
        assert grant(worker, owner, "w-idle", PROMPT_FINGERPRINTS) is None
        assert grant(worker, owner, "w-read", PROMPT_FINGERPRINTS) is None
        # The read ends: freed, once.
        worker.begin_step(DuplexConnectorMetadata(releases=[release(owner, reading)]))
        owner.collect(until=2)
        assert owner.freed_holds == ["w-idle", "w-read"]
        # A hold taken after the change is granted as any.
        owner.hold("w-new", ttl_s=30)
        assert grant(worker, owner, "w-new", PROMPT_FINGERPRINTS) is not None
    finally:
        worker.shutdown()
