"""A decode node whose queue is longer than the prefill node's lease still pulls the prompt: its
scheduler renews the owner's hold from the moment it sees the request until it asks for the
grant (`renewals.py`, `rust/src/holds/renew.rs`). vLLM's real Scheduler and a real DuplexWorker
on the decode side, the owner's worker in its own process (duplex_owner.py), real UCX and side
channels between them."""

from __future__ import annotations

import json
import time

import pytest
import torch
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus

from duplex_harness import (
    BLOCK_SIZE,
    Engine,
    make_engine,
    make_kv_caches,
    make_worker,
    prompt_tokens,
)
from kvduplex import protocol
from kvduplex.connector.metadata import (
    DuplexConnectorMetadata,
    LoadSpec,
    PeerAddress,
    RenewSpec,
)
from kvduplex.connector.renewals import MIN_INTERVAL_S, Renewals
from kvduplex.connector.token_fingerprint import PromptFingerprints, request_salt
from test_worker_transfer import OwnerProcess

LEASE_S = 2.0
NUM_BLOCKS = 64
READER = {"kv_recompute_threshold": 16, "handshake_timeout_s": 2}


def step(d: Engine, worker, transfers: list[int]) -> DuplexConnectorMetadata:
    """One engine step as vLLM takes it: the scheduler's metadata to the real worker, the
    worker's results and report back to the scheduler. Every request that completes its prompt
    samples a token; `transfers` counts the worker's completed reads."""
    output = d.scheduler.schedule()
    meta = output.kv_connector_metadata
    assert isinstance(meta, DuplexConnectorMetadata)
    worker.begin_step(meta)
    results = worker.get_transfer_results()
    report = worker.build_connector_worker_meta()
    errors = worker.get_block_ids_with_load_errors()
    stats = worker.get_kv_connector_stats()
    transfers.append(stats.data["transfers"] if stats is not None else 0)
    req_ids = list(output.num_scheduled_tokens)
    requests = [d.scheduler.requests[rid] for rid in req_ids]
    runner_output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=[[7] if r.num_computed_tokens >= r.num_tokens else [] for r in requests],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
        kv_connector_output=KVConnectorOutput(
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            invalid_block_ids=errors,
            kv_connector_worker_meta=report,
        ),
    )
    d.scheduler.update_from_output(output, runner_output)
    return meta


@pytest.mark.slow
def test_a_request_queued_longer_than_the_lease_still_pulls_the_prompt(tiny_config_dir):
    owner = OwnerProcess(tiny_config_dir, engine_id="lease-owner")
    caches = make_kv_caches(NUM_BLOCKS)
    worker = make_worker(tiny_config_dir, "D", caches, READER)
    try:
        d = make_engine(tiny_config_dir, "D", READER, num_blocks=NUM_BLOCKS, announce=False)
        d.connector.set_xfer_handshake_metadata({0: worker.get_handshake_metadata()})
        # One seat: a second request waits in the queue (vLLM admits up to the "active" count
        # where it has one).
        d.scheduler.max_num_running_reqs = d.scheduler.max_num_active_reqs = 1
        transfers: list[int] = []
        d.add("long", prompt_tokens(20, start=500), max_tokens=900)
        while "long" not in [r.request_id for r in d.scheduler.running]:
            step(d, worker, transfers)

        # P holds the prompt for its decode node for LEASE_S, as P's scheduler hands it off.
        prompt = prompt_tokens(40)
        fingerprints = PromptFingerprints(prompt, BLOCK_SIZE, request_salt(None, None, None))
        remote_blocks = [3, 4, 10]
        params = {
            protocol.DO_REMOTE_PREFILL: True,
            protocol.DO_REMOTE_DECODE: False,
            protocol.REMOTE_ENGINE_ID: owner.peer.engine_id,
            protocol.REMOTE_REQUEST_ID: "p1",
            protocol.REMOTE_HOST: owner.peer.host,
            protocol.REMOTE_PORT: owner.peer.ports[0],
            protocol.REMOTE_PORTS: list(owner.peer.ports),
            protocol.TP_SIZE: 1,
            protocol.REMOTE_BLOCK_IDS: remote_blocks,
            protocol.REMOTE_NUM_TOKENS: len(prompt),
            protocol.REMOTE_BLOCK_SIZE: BLOCK_SIZE,
            protocol.REMOTE_BLOCK_FINGERPRINTS: fingerprints.of_prefix(len(prompt)),
            protocol.REMOTE_LEASE_EXPIRY: time.time() + LEASE_S,
            protocol.PROTOCOL_KEY: protocol.PROTOCOL_VERSION,
        }
        owner.hold(
            "p1",
            ttl_s=LEASE_S,
            fingerprints=fingerprints.of_prefix(len(prompt)),
            num_blocks=len(remote_blocks),
            offer=json.dumps(params),
        )
        # D sees the request at once; vLLM's waiting loop does not reach it for 2.5 leases.
        d.add("r1", prompt, max_tokens=2, params=params)
        queued_until = time.monotonic() + 2.5 * LEASE_S
        while time.monotonic() < queued_until:
            meta = step(d, worker, transfers)
            assert d.scheduler.requests["r1"].status == RequestStatus.WAITING
            assert not meta.lookups, "its grant is asked only once the waiting loop reaches it"
            owner.poll(0.02)
        assert not owner.freed_holds, "the hold outlived its lease"

        d.scheduler.finish_requests("long", RequestStatus.FINISHED_ABORTED)
        loads: list[LoadSpec] = []
        deadline = time.monotonic() + 10
        while "r1" in d.scheduler.requests and time.monotonic() < deadline:
            meta = step(d, worker, transfers)
            loads += [load for load in meta.loads if load.request_id == "r1"]
            time.sleep(0.005)
        assert "r1" not in d.scheduler.requests, "r1 did not finish"
        # Pulled from P, not recomputed: every block byte for byte.
        (load,) = loads
        assert load.failure is None and sum(transfers) == 1
        assert list(load.remote_block_ids) == remote_blocks
        for name, tensor in caches.items():
            for lid, rid in zip(load.local_block_ids, load.remote_block_ids):
                assert torch.equal(tensor[lid], owner.expected[name][rid]), (name, lid, rid)
        # P renewed the lease while r1 waited, and freed the prompt once it was read (D's
        # release goes with its next step).
        while not owner.freed_holds and time.monotonic() < deadline:
            step(d, worker, transfers)
            owner.poll(0.01)
        owner.collect(until=1)
        assert owner.freed_holds == ["p1"]
        assert owner.stats.get("leases_renewed", 0) >= 2, owner.stats
        assert owner.stats.get("leases_released") == 1 and not owner.stats.get("lease_expiries")
    finally:
        worker.shutdown()
        owner.stop()


def test_renewals_are_due_from_the_first_step_then_every_quarter_lease_until_removed():
    spec = RenewSpec(PeerAddress("P", "127.0.0.1", (41001,)), "p1", "0" * 16)
    renewals = Renewals()
    renewals.add("r1", spec, lease_left_s=2.0, now=10.0)
    renewals.add("r2", spec, lease_left_s=0.1, now=10.0)
    renewals.add("r3", spec, lease_left_s=0.0, now=10.0)
    assert renewals.take(9.9) == []
    assert renewals.take(10.0) == [spec, spec], "r3's lease had ended: nothing to renew"
    assert renewals.take(10.0 + MIN_INTERVAL_S) == [spec], "r2 at the shortest interval"
    renewals.remove("r2")
    assert renewals.take(10.4) == []
    assert renewals.take(10.5) == [spec], "r1 a quarter of its 2 s later"
    # Added again (a new entry): the old schedule is dropped, the new one starts now.
    renewals.add("r1", spec, lease_left_s=2.0, now=10.6)
    assert renewals.take(10.6) == [spec]
    assert renewals.take(11.0) == [] and renewals.take(11.1) == [spec]
    renewals.remove("r1")
    assert renewals.take(100.0) == []


def test_a_renewal_notification_round_trips_and_anything_else_is_refused():
    payload = protocol.encode_renewal("p1", "00000000000000b1")
    assert protocol.decode_notification(payload) == protocol.Renewal("p1", "00000000000000b1")
    release = protocol.encode_release("p1", 3)
    assert protocol.decode_notification(release) == protocol.Release("p1", 3)
    other_version = {"v": protocol.PROTOCOL_VERSION - 1, "renew": "p1", "first": "0" * 16}
    for refused in (
        json.dumps(other_version).encode(),
        json.dumps({"v": protocol.PROTOCOL_VERSION, "renew": "p1", "first": 7}).encode(),
        json.dumps({"v": protocol.PROTOCOL_VERSION, "renew": ["p1"], "first": "0" * 16}).encode(),
        b"\xff",
    ):
        assert protocol.decode_notification(refused) is None, refused
