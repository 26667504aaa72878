"""`DuplexConnector`: vLLM's KVConnectorBase_V1 facade.

vLLM builds one instance per role: in the EngineCore process (SCHEDULER) it forwards to
`DuplexScheduler`, in each worker (WORKER) to `DuplexWorker`. Nothing else happens here.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvduplex.connector.config import DuplexConfig
from kvduplex.connector.kv_layout import HEAD_MAJOR_LAYOUT
from kvduplex.connector.metadata import DuplexConnectorMetadata
from kvduplex.connector.scheduler import DuplexScheduler
from kvduplex.connector.stats import DuplexConnectorStats, DuplexPromMetrics

if TYPE_CHECKING:
    import torch
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvduplex.connector.worker import DuplexWorker


def _log_core_under_vllm() -> None:
    """The transfer core logs through pyo3-log to Python loggers named `kvduplex.*`, outside
    vLLM's logger tree: with no handler of their own only warnings would show, unformatted.
    Give them vLLM's handlers and level, unless the user configured them (e.g. through
    VLLM_LOGGING_CONFIG_PATH)."""
    core = logging.getLogger("kvduplex")
    if core.handlers or core.level != logging.NOTSET:
        return
    vllm_logger = logging.getLogger("vllm")
    for handler in vllm_logger.handlers:
        core.addHandler(handler)
    core.setLevel(vllm_logger.getEffectiveLevel())
    core.propagate = not vllm_logger.handlers


class DuplexConnector(KVConnectorBase_V1, SupportsHMA):
    """Supports vLLM's hybrid KV-cache manager: full-attention and sliding-window groups
    (see `kvduplex.connector.groups`)."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_core_under_vllm()
        transfer_config = vllm_config.kv_transfer_config
        config = DuplexConfig.from_transfer_config(transfer_config)
        engine_id = transfer_config.engine_id
        self._scheduler: DuplexScheduler | None = None
        self._worker: DuplexWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = DuplexScheduler(vllm_config, kv_cache_config, config, engine_id)
        else:
            # Only workers load the transfer core.
            from vllm.distributed.parallel_state import get_tp_group

            from kvduplex.connector.worker import DuplexWorker

            self._worker = DuplexWorker(
                vllm_config, kv_cache_config, config, engine_id, get_tp_group().rank_in_group
            )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """vLLM lays the KV cache out head-major (LBHNC) for us where every attention backend
        of the model takes it (else it warns and keeps its own choice; `VLLM_KV_CACHE_LAYOUT`
        overrides both), so that engines at different TP sizes can pair (`tp.py`), and every
        engine of a fleet lays its pages out alike whatever its backend prefers (pages laid out
        differently never pair: `compatibility.py`). Not for MLA: one latent "head" per
        token, replicated on every rank, is head-major in any layout."""
        model = vllm_config.model_config
        if model is None or model.use_mla:
            return None
        return HEAD_MAJOR_LAYOUT

    @property
    def requires_kv_delivery(self) -> bool:
        """False: nothing is handed off through vLLM's delayed frees (`request_finished` never
        returns True; a hold takes block references of its own as the request finishes), so a
        request preempted with output in flight has nothing pending to protect, and vLLM
        delivers that output instead of dropping and recomputing it (its default for a
        `kv_both` connector)."""
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """`layerwise_load` pulls wait in the forward pass's layer hooks
        (`wait_for_layer_load`, `save_kv_layer`), which a full CUDA graph's replay skips: vLLM
        then captures piecewise graphs, with the hooks between the pieces."""
        config = DuplexConfig.from_extra_config(extra_config)
        return config.layerwise_load and config.bidirectional_kv_xfer

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """vLLM 0.33 asks before it allows sleep mode: it resets the caches first (every hold
        is dropped: `holds.py`) and calls `unregister_kv_caches` / `restore_kv_caches`
        around the sleep. vLLM 0.32 never asks."""
        return True

    # ------------------------------------------------------------- scheduler

    def on_new_request(self, request: Request) -> None:
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._kv_cache_config.transfer_group_ids

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM calls `request_finished_all_groups` on this connector; vLLM's MultiConnector
        calls this one when a sibling connector lacks hybrid-manager support (one group)."""
        return self._scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._scheduler.bind_kv_cache_manager(kv_cache_manager)

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self._scheduler.set_xfer_handshake_metadata(metadata)

    def reset_cache(self) -> bool | None:
        """vLLM resets its caches (new weights): every hold ends (`DuplexScheduler.reset_cache`)."""
        return self._scheduler.reset_cache() if self._scheduler is not None else None

    def has_pending_block_frees(self) -> bool:
        """Held blocks are being given up: vLLM waits for them instead of preempting."""
        return self._scheduler.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        """An idle engine steps while a hold is due to end (`holds.py`)."""
        return self._scheduler.has_pending_push_work()

    # ---------------------------------------------------------------- worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33, before sleep (and before discarding the KV cache): holds end, reads of
        this memory stop (`DuplexWorker.unregister_kv_caches`). Not called by 0.32."""
        self._worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """vLLM 0.33, after wake-up: the KV caches are offered to peers again."""
        self._worker.restore_kv_caches()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker.get_handshake_metadata()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """vLLM hands each step's metadata to the workers here, before the step's forward
        pass (or the step without one): the step begins (`DuplexWorker.begin_step`)."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            assert isinstance(connector_metadata, DuplexConnectorMetadata)
            self._worker.begin_step(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Reads were posted as the step began (`bind_connector_metadata`), before the forward
        pass, whether vLLM calls this before it (synchronous loads) or after it."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """With `layerwise_load`, a pull of a decode node's turn runs within the forward pass;
        its blocks of this layer have arrived already (see `save_kv_layer`)."""
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Nothing is saved (peers read blocks in place). With `layerwise_load`, the next
        layer's pulled blocks are waited for here, before that layer writes its new tokens'
        KV into the same blocks."""
        self._worker.layer_done(layer_name)

    def wait_for_save(self) -> None:
        """Peers read blocks in place; nothing is saved."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker.get_transfer_results()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.build_connector_worker_meta()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # ----------------------------------------------------------------- stats

    def get_kv_connector_stats(self) -> DuplexConnectorStats | None:
        if self._worker is not None:
            return self._worker.get_kv_connector_stats()
        return self._scheduler.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> DuplexConnectorStats:
        return DuplexConnectorStats(data=data) if data is not None else DuplexConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls, vllm_config, metric_types, labelnames, per_engine_labelvalues
    ) -> DuplexPromMetrics:
        return DuplexPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _register_by_name() -> None:
    """Inside vLLM's `MultiConnector`, the API server rebuilds each child's stats by the child's
    class name (`KVConnectorFactory.get_connector_class_by_name`), which knows only registered
    connectors; ours is loaded by module path, so it registers itself when first loaded."""
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, __name__, CONNECTOR_NAME)
    except ValueError:  # "already registered": by an earlier load of this module
        pass


CONNECTOR_NAME = DuplexConnector.__name__
_register_by_name()
