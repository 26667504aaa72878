"""Worker side of DuplexConnector: the KV cache on the transfer core, reads and holds.

One transfer-core `Engine` per vLLM worker (TP rank r of engine E is `E/tp<r>`); TP rank r
reads only from the peer's rank r. The transfer core owns every connection (`peer_status`:
handshakes on its own threads, once per peer address, backoff after a failure, the peer's
identity checked); reads are posted from the step hooks and polled every step, and each rank
reports every load it was given as done (read, or failed) in `DuplexWorkerMetadata.loads_done`.

Grants: nothing is read without the owner's grant, which TP rank 0 asks for
(`worker_lookup.py`, which also runs lookups). The scheduler names the hold (params from a
router or client: a hint, never a capability) or asks for the longest held turn (lookups,
bidirectional prefill side); the owner checks the reader's own token fingerprints against its
hold and answers with a claim and its own description of the blocks, which every rank then
reads. The scheduler releases the claim once every rank has reported the load done.

Owner side: TP rank 0's hold book (`worker_holds.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.logger import init_logger

from kvduplex import _core, protocol
from kvduplex.connector import metadata as md
from kvduplex.connector import tp
from kvduplex.connector.compatibility import compatibility_fingerprint
from kvduplex.connector.config import DuplexConfig
from kvduplex.connector.groups import TransferGroups
from kvduplex.connector.idle_steps import WorkerSpin
from kvduplex.connector.kv_layout import KVLayout, describe_kv_caches, head_major_bytes
from kvduplex.connector.stats import DuplexConnectorStats
from kvduplex.connector.worker_holds import WorkerHolds
from kvduplex.connector.worker_lookup import WorkerLookups

if TYPE_CHECKING:
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# Under vLLM's logger tree, so vLLM's handler, format and level apply.
logger = init_logger(f"vllm.{__name__}")

# How often a worker that waits for its own reads to be done before sleep looks again.
_DRAIN_POLL_S = 0.001


def side_channel_port(base: int, parallel: ParallelConfig, tp_rank: int) -> int:
    """The port this worker's side channel listens on: 0 (a free port) when `base` is 0, else
    `base` + the worker's index among the engines' workers on this host, i.e. its data-parallel
    rank on this host (vLLM's `data_parallel_rank_local`, or its data-parallel index where vLLM
    sets no local rank) times the TP size, plus its TP rank."""
    if not base:
        return 0
    dp_rank_local = parallel.data_parallel_rank_local
    if dp_rank_local is None:
        dp_rank_local = parallel.data_parallel_index
    port = base + dp_rank_local * parallel.tensor_parallel_size + tp_rank
    if port > 65535:
        raise ValueError(
            f"DuplexConnector: side_channel_port {base} + data-parallel rank {dp_rank_local} x "
            f"TP size {parallel.tensor_parallel_size} + TP rank {tp_rank} = {port} is past "
            "65535; lower side_channel_port (or set 0 for free ports)"
        )
    return port


@dataclass
class _Inflight:
    spec: md.LoadSpec
    transfers: list[_core.Transfer]
    """One per owner rank read (several with heterogeneous TP)."""
    posted_at: float
    failure: str | None = None


@dataclass
class _LayerwiseRead:
    """A pull read one segment (layer) at a time within this step's forward pass."""

    spec: md.LoadSpec
    peer_engine_id: str
    transfers: list[_core.Transfer]
    """One per segment, in segment order."""
    posted_at: float
    waited: set[int] = field(default_factory=set)
    failure: str | None = None


class DuplexWorker:
    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        config: DuplexConfig,
        engine_id: str,
        tp_rank: int,
    ) -> None:
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._groups = TransferGroups.from_kv_cache_config(kv_cache_config)
        self._config = config
        self._engine_id = engine_id
        self._tp_rank = tp_rank
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        # Set with the KV caches: how this rank's heads map onto other TP sizes.
        self._total_kv_heads = 0
        self._head_bytes: int | None = None
        self._engine: _core.Engine | None = None
        self._waiting_loads: list[md.LoadSpec] = []
        self._waiting_releases: list[md.ReleaseSpec] = []
        self._inflight: dict[str, _Inflight] = {}
        self._layerwise_reads: list[_LayerwiseRead] = []
        self._layer_segments: dict[str, int] = {}
        # Layer (in the forward pass's order) -> the segment of the layer after it.
        self._next_layer_segment: dict[str, int] = {}
        self._first_layer_segment: int | None = None
        self._num_segments = 0
        self._finished_recving: set[str] = set()
        # Failed pulls of a hybrid model: vLLM maps block-level errors to requests only with
        # one KV-cache group, so it is told the request (which then recomputes) instead.
        self._failed_recving: set[str] = set()
        self._loads_done: list[str] = []
        self._load_errors: set[int] = set()
        self._stats = DuplexConnectorStats()
        # Grants and lookups, TP rank 0's (`worker_lookup.py`).
        self._lookups = WorkerLookups(config, tp_rank, self._stats)
        # The hold book, TP rank 0's (`worker_holds.py`).
        self._holds = WorkerHolds(tp_rank, self._stats)
        self._idle_step = False
        self._spin = WorkerSpin()
        # What `register_kv_caches` registered, to register again after vLLM's sleep
        # (`restore_kv_caches`): the layout and the tensors that own its memory.
        self._layout: KVLayout | None = None
        self._owners: tuple[torch.Tensor, ...] = ()
        self._asleep = False

    # ------------------------------------------------------------- lifecycle

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = describe_kv_caches(kv_caches, self._kv_cache_config.num_blocks)
        model, parallel = self._vllm_config.model_config, self._vllm_config.parallel_config
        self._total_kv_heads = model.get_total_num_kv_heads()
        # A hybrid model's pages hold other things than heads.
        mixed = self._groups.hybrid or self._groups.has_state
        self._head_bytes = (
            None if mixed else head_major_bytes(kv_caches, layout, model.get_num_kv_heads(parallel))
        )
        fingerprint = compatibility_fingerprint(
            self._vllm_config, kv_caches, layout, self._groups, self._head_bytes
        )
        secret = self._config.auth_secret()
        engine = _core.Engine(
            md.rank_engine_id(self._engine_id, self._tp_rank),
            fingerprint,
            host=self._config.side_channel_host,
            port=side_channel_port(
                self._config.side_channel_port, self._vllm_config.parallel_config, self._tp_rank
            ),
            secret=secret,
            peer_error_handling=self._config.ucx_peer_error_handling,
            lookup_claim_s=self._config.kv_lease_ttl_s,
            heartbeat_s=self._config.peer_heartbeat_s,
            allow_unauthenticated=self._config.allow_unauthenticated_peers,
            same_host_reads=self._config.same_host_reads,
        )
        # The tensors own the regions' memory: the engine holds them while a read may still
        # write into it, past close (`_core.pyi`).
        self._layout, self._owners = layout, tuple(kv_caches.values())
        try:
            self._register(engine)
        except BaseException:
            engine.close()
            raise
        self._engine = self._holds.engine = engine
        self._lookups.join_fleet(engine, fingerprint, secret)
        self._layer_segments = dict(layout.layer_segments)
        # Forward order: by the layer numbers in the names ("model.layers.10..." after "2").
        in_order = sorted(
            layout.layer_segments,
            key=lambda item: [int(part) for part in item[0].split(".") if part.isdigit()],
        )
        self._first_layer_segment = in_order[0][1] if in_order else None
        self._next_layer_segment = {
            layer: segment for (layer, _), (_, segment) in zip(in_order, in_order[1:])
        }
        self._num_segments = len(layout.segment_bases)
        logger.info(
            "DuplexConnector worker %s: %d segments x %d blocks of %d bytes, side channel "
            "%s:%d, page layout %s",
            engine.engine_id,
            len(layout.segment_bases),
            layout.num_blocks,
            layout.block_len,
            engine.side_channel_host,
            engine.side_channel_port,
            fingerprint["page_layout"],
        )

    def _register(self, engine: _core.Engine) -> None:
        for addr, length in self._layout.regions:
            engine.register_region(addr, length, owner=self._owners)
        engine.set_layout(
            list(self._layout.segment_bases), self._layout.block_len, self._layout.block_stride,
            self._layout.num_blocks,
        )

    def unregister_kv_caches(self) -> None:
        """vLLM (0.33) is about to put the worker to sleep and unmap its KV cache; it has
        reset its caches (the scheduler dropped every hold) and drained its own transfers.
        TP rank 0 ends every hold and waits until no peer reads one (`WorkerHolds.end_all`); every rank
        lets its own reads settle (bounded by their deadlines: none writes into memory being
        unmapped), then stops offering its memory (`Engine.unregister_regions`: a peer's read
        fails and it recomputes; none reaches memory being unmapped). Idempotent."""
        if self._engine is None or self._asleep:
            return
        self._holds.end_all()
        self._finish_layerwise_reads()
        while self._inflight:  # reported as usual at the next step
            self._poll_reads()
            if self._inflight:
                time.sleep(_DRAIN_POLL_S)
        if self._tp_size > 1:
            _tp_barrier()
        regions = self._engine.unregister_regions()
        self._asleep = True
        logger.info(
            "DuplexConnector worker %s: %d KV-cache regions unregistered for sleep",
            self._engine.engine_id,
            regions,
        )

    def restore_kv_caches(self) -> None:
        """vLLM woke the worker: its KV-cache tensors (same addresses, new memory) are
        registered again and offered to peers. Idempotent."""
        if self._engine is None or not self._asleep:
            return
        self._register(self._engine)
        self._asleep = False
        logger.info(
            "DuplexConnector worker %s: KV-cache regions registered again after sleep",
            self._engine.engine_id,
        )

    def get_handshake_metadata(self) -> md.DuplexHandshakeMetadata | None:
        if self._engine is None:
            return None
        return md.DuplexHandshakeMetadata(
            tp_rank=self._tp_rank,
            host=self._engine.side_channel_host,
            port=self._engine.side_channel_port,
        )

    def shutdown(self) -> None:
        self._lookups.close()
        if self._engine is not None:
            self._engine.close()
            self._engine = self._holds.engine = None

    # ----------------------------------------------------------------- steps

    def begin_step(self, meta: md.DuplexConnectorMetadata) -> None:
        """The step's work as it begins, before its forward pass (vLLM's
        `bind_connector_metadata`): holds taken and ended, reads posted, lookups sent. Posting
        before the forward pass, not after it (vLLM's place for asynchronous loads), saves a
        busy engine one forward pass of waiting per pull and per lookup; it costs microseconds."""
        self._idle_step = meta.idle
        for turn in meta.expected:
            self._holds.expect(turn)
        for hold in meta.holds:
            self._holds.hold(hold)
        if meta.end_holds:
            self._holds.end_all()
            if self._tp_size > 1:
                # No rank writes KV in this step before rank 0 has no reader left.
                _tp_barrier()
        if meta.settled and self._engine is not None and self._tp_rank == 0:
            # After the holds: a reader is never told the turn's prompt gone before its hold.
            self._engine.settle_turns(meta.settled)
        if meta.evict is not None:
            self._holds.evict(meta.evict)
        for lookup in meta.lookups:
            self._lookups.start(self._engine, lookup)
        for spec in meta.loads:
            if spec.failure is not None:
                self._fail_load(spec, spec.failure)
            elif spec.layerwise:
                self._start_layerwise_read(spec)
            else:
                self._waiting_loads.append(spec)
        self._waiting_releases.extend(meta.releases)
        self._lookups.renew(self._engine, meta.renewals)
        self._advance()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return once this step's layer-by-layer pulls have the layer's blocks (or failed:
        the blocks are then reported as load errors at the end of the step)."""
        segment = self._layer_segments.get(layer_name)
        if segment is not None:
            self._wait_for_segment(segment)

    def layer_done(self, layer_name: str) -> None:
        """The forward pass left `layer_name`: wait for the next layer's blocks now. A layer
        writes its new tokens' KV (vLLM's KV-cache update, before attention) into the pulled
        turn's last, partial block, so that block's read must have landed before the layer
        starts, not merely before its attention."""
        following = self._next_layer_segment.get(layer_name)
        if following is not None:
            self._wait_for_segment(following)

    def _wait_for_segment(self, segment: int) -> None:
        for read in self._layerwise_reads:
            if read.failure is None and segment not in read.waited:
                read.waited.add(segment)
                try:
                    read.transfers[segment].wait()
                except _core.KvDuplexError as exc:
                    read.failure = f"read failed: {exc}"

    def get_transfer_results(self) -> KVConnectorTransferResults:
        self._finish_layerwise_reads()
        self._advance()
        self._poll_reads()
        self._holds.take_notifications()
        self._holds.expire()
        self._lookups.connect_ahead(self._engine)
        self._holds.record_occupancy()
        results = KVConnectorTransferResults(
            finished_recving=self._finished_recving, failed_recving=self._failed_recving
        )
        self._finished_recving, self._failed_recving = set(), set()
        return results

    def build_connector_worker_meta(self) -> md.DuplexWorkerMetadata | None:
        if self._idle_step and not self._inflight and not self._waiting_loads:
            # Nothing else to do or to notice: the step waits for its lookups' answers.
            self._lookups.wait_for_answers(self._engine)
        lookups, lookup_targets = self._lookups.take(self._engine)
        announced = self._lookups.announced(self._engine)
        if self._idle_step and not (self._inflight or self._waiting_loads or self._lookups.pending):
            self._spin.rest()  # (`idle_steps.py`)
        freed_holds = self._holds.take_report()
        if (
            self._tp_rank != 0
            and not lookups
            and not freed_holds
            and not self._loads_done
            and lookup_targets < 0
            and announced is None
        ):
            return None
        # TP rank 0 reports every step, even with nothing in it: vLLM hands the scheduler no
        # report of a step that computed nothing and whose workers returned nothing (its
        # single-process executor), and the scheduler counts reports per step (its lookups'
        # last report, `lookup.py`) and renews its copy of the announcements with each
        # (`held_mirror.py`; an idle engine steps to renew it).
        meta = md.DuplexWorkerMetadata(
            lookups=lookups,
            freed_holds=freed_holds,
            loads_done=self._loads_done,
            lookup_targets=lookup_targets,
            announced=announced,
        )
        self._loads_done = []
        return meta

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_layerwise_reads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> DuplexConnectorStats | None:
        return self._stats.take()

    # ------------------------------------------------------------ reader side

    def _peer_status(self, peer: md.PeerAddress, rank: int = 0) -> tuple[str, str | None]:
        """("ready", connection handle), ("connecting", None) or ("failed", why) for the peer's
        engine of TP rank `rank`: reads and releases go through the handle, so they reach the
        connection that was checked or fail. The transfer core owns the connection: it starts the handshake when
        none is under way, backs off after a failure, and refuses an engine other than the
        one the params named (e.g. restarted at the same address)."""
        if self._engine is None:
            return "failed", "no KV cache was registered with the transfer core"
        return self._engine.peer_status(
            peer.host,
            peer.ports[rank],
            expected_engine_id=peer.rank_engine_id(rank),
            timeout_s=self._config.handshake_timeout_s,
        )

    def _rank_reads(self, spec: md.LoadSpec) -> list[tp.RankRead]:
        """What this rank reads of the owner's ranks (see `tp.rank_reads`)."""
        return tp.rank_reads(
            self._total_kv_heads, self._tp_size, self._tp_rank, len(spec.peer.ports),
            self._head_bytes,
        )

    def _advance(self) -> None:
        """Post the reads and releases whose peers are connected."""
        waiting_loads, self._waiting_loads = self._waiting_loads, []
        for spec in waiting_loads:
            try:
                reads = self._rank_reads(spec)
            except ValueError as exc:
                self._fail_load(spec, str(exc))
                continue
            statuses = [self._peer_status(spec.peer, read.owner_rank) for read in reads]
            failed = [detail for state, detail in statuses if state == "failed"]
            if failed:
                self._fail_load(spec, f"no connection to the owner: {failed[0]}")
            elif any(state == "connecting" for state, _ in statuses):
                self._waiting_loads.append(spec)
            else:
                self._post_read(spec, [(detail, read) for (_, detail), read in zip(statuses, reads)])
        # Claims live on the owner's TP rank 0, asked for by ours.
        waiting_releases, self._waiting_releases = self._waiting_releases, []
        if self._tp_rank != 0:
            return
        for release in waiting_releases:
            state, detail = self._peer_status(release.peer)
            if state == "connecting":
                self._waiting_releases.append(release)
                continue
            undelivered = f"no connection: {detail}" if state == "failed" else None
            if undelivered is None:
                try:
                    self._engine.notify(
                        detail, protocol.encode_release(release.remote_request_id, release.claim_id)
                    )
                except _core.KvDuplexError as exc:
                    undelivered = str(exc)
            if undelivered is not None:  # the owner's lease frees the blocks instead
                logger.info(
                    "Could not tell engine %s to free request %s's blocks (%s); its lease "
                    "will free them",
                    release.peer.engine_id,
                    release.remote_request_id,
                    undelivered,
                )

    def _read_time_left(self, spec: md.LoadSpec) -> float | None:
        """Seconds a read may take before the owner's claim ends (less the margin); None, with
        the load failed, when there is no time left."""
        time_left = spec.lease_expiry - time.time() - self._config.read_deadline_margin_s
        if time_left > 0:
            return time_left
        self._fail_load(spec, "the owner's claim ends before the read could finish")
        return None

    def _post_read(self, spec: md.LoadSpec, reads: list[tuple[str, tp.RankRead]]) -> None:
        """Post one read per owner rank; a read not posted fails the load once the others
        posted have settled (no byte may land after vLLM recomputes into the blocks)."""
        time_left = self._read_time_left(spec)
        if time_left is None:
            return
        inflight = _Inflight(spec, [], time.perf_counter())
        for peer_engine_id, read in reads:
            try:
                inflight.transfers.append(
                    self._engine.read_blocks(
                        peer_engine_id,
                        list(spec.local_block_ids),
                        list(spec.remote_block_ids),
                        timeout_s=time_left,
                        block_slice=read.block_slice,
                    )
                )
            except (_core.KvDuplexError, ValueError) as exc:
                inflight.failure = f"read not posted: {exc}"
                break
        self._inflight[spec.request_id] = inflight

    def _start_layerwise_read(self, spec: md.LoadSpec) -> None:
        """Post one read per segment before the forward pass; each layer waits for its own
        (`wait_for_layer_load`). The owner is normally connected already (prefill nodes
        connect to announced decode nodes ahead of time); otherwise this waits for the
        handshake, at most `handshake_timeout_s`."""
        deadline = time.monotonic() + self._config.handshake_timeout_s
        state, detail = self._peer_status(spec.peer, self._tp_rank)
        while state == "connecting" and time.monotonic() < deadline:
            time.sleep(0.001)
            state, detail = self._peer_status(spec.peer, self._tp_rank)
        if state != "ready":
            self._fail_load(spec, f"no connection to the owner: {detail or 'handshake not done'}")
            return
        time_left = self._read_time_left(spec)
        if time_left is None:
            return
        read = _LayerwiseRead(spec, detail, [], time.perf_counter())
        self._layerwise_reads.append(read)
        for segment in range(self._num_segments):
            try:
                read.transfers.append(
                    self._engine.read_blocks(
                        detail,
                        list(spec.local_block_ids),
                        list(spec.remote_block_ids),
                        timeout_s=time_left,
                        segments=(segment, segment + 1),
                    )
                )
            except _core.KvDuplexError as exc:
                read.failure = f"read not posted: {exc}"
                break
        # The first layer's blocks before the forward pass starts (see `layer_done`).
        if self._first_layer_segment is not None:
            self._wait_for_segment(self._first_layer_segment)

    def _finish_layerwise_reads(self) -> None:
        """After the forward pass: every segment's read has settled (waiting out any that no
        layer waited for, so that no byte lands later); report failures as load errors
        (vLLM recomputes those tokens) and every load as done."""
        reads, self._layerwise_reads = self._layerwise_reads, []
        for read in reads:
            for transfer in read.transfers:
                try:
                    transfer.wait()
                except _core.KvDuplexError as exc:
                    read.failure = read.failure or f"read failed: {exc}"
            if read.failure is not None:
                self._fail_load(read.spec, read.failure)
                continue
            self._loads_done.append(read.spec.request_id)
            self._stats.record_transfer(
                time.perf_counter() - read.posted_at,
                self._groups.by_group_id(read.spec.blocks_per_group),
                sum(transfer.nbytes for transfer in read.transfers),
                read.spec.num_tokens,
            )

    def _poll_reads(self) -> None:
        """Report each load once all of its reads have settled."""
        for request_id, inflight in list(self._inflight.items()):
            settled = True
            for transfer in inflight.transfers:
                try:
                    settled = transfer.done() and settled
                except _core.KvDuplexError as exc:
                    inflight.failure = inflight.failure or f"read failed: {exc}"
            if not settled:
                continue
            del self._inflight[request_id]
            if inflight.failure is not None:
                self._fail_load(inflight.spec, inflight.failure)
                continue
            self._finished_recving.add(request_id)
            self._loads_done.append(request_id)
            self._stats.record_transfer(
                time.perf_counter() - inflight.posted_at,
                self._groups.by_group_id(inflight.spec.blocks_per_group),
                sum(transfer.nbytes for transfer in inflight.transfers),
                inflight.spec.num_tokens,
            )

    def _fail_load(self, spec: md.LoadSpec, reason: str) -> None:
        """The request recomputes the tokens it meant to pull; the load is done."""
        logger.warning(
            "Request %s recomputes %d tokens instead of pulling them from engine %s: %s",
            spec.request_id,
            spec.num_tokens,
            spec.peer.engine_id,
            reason,
        )
        if spec.layerwise:
            # A synchronous load (one KV-cache group): vLLM finds the request by its blocks.
            self._load_errors.update(spec.local_block_ids)
        else:
            self._finished_recving.add(spec.request_id)
            if self._groups.num_kv_cache_groups > 1:
                self._failed_recving.add(spec.request_id)
            else:
                self._load_errors.update(spec.local_block_ids)
        self._loads_done.append(spec.request_id)
        self._stats.add("failed_transfers")
        self._stats.add("fallbacks")
        self._stats.add("tokens_recomputed", spec.num_tokens)


def _tp_barrier() -> None:
    """Every TP rank of this engine is here (vLLM's TP group, over its CPU group)."""
    from vllm.distributed.parallel_state import get_tp_group

    torch.distributed.barrier(group=get_tp_group().cpu_group)
