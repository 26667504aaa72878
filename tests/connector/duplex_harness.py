"""Harness driving vLLM's real `Scheduler` with DuplexConnector on the CPU, no model weights.

`engine(...)` builds a scheduler-side engine: a VllmConfig over a tiny local Llama config (no
hub access), a KV cache of `num_blocks` blocks and vLLM's `Scheduler`, whose connector is a real
`DuplexConnector`. `Engine.step(...)` runs one `schedule()` / `update_from_output()` round in
which every request that completes its prompt samples `token`; what the workers would report
(finished sending / receiving, failed blocks) is passed in explicitly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvduplex.connector import DuplexConnector
from kvduplex.connector.metadata import (
    DuplexConnectorMetadata,
    DuplexHandshakeMetadata,
    DuplexWorkerMetadata,
    LoadSpec,
    LookupMatch,
    LookupSpec,
)
from kvduplex.connector.scheduler import DuplexScheduler
from kvduplex.connector.stats import DuplexConnectorStats
from kvduplex_testing.kv_caches import vllm_kv_caches

BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_SIZE = 64
EOS_TOKEN_ID = 2
# The longest a test steps a worker for its lookup's report.
LOOKUP_WAIT_S = 60.0
SIDE_CHANNEL_PORT = {"P": 41001, "D": 41002}

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": NUM_KV_HEADS,
    "head_dim": HEAD_SIZE,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": EOS_TOKEN_ID,
    "torch_dtype": "float32",
}


def make_vllm_config(
    model_dir: Path,
    engine_id: str,
    extra_config: dict[str, Any] | None = None,
    num_blocks: int = 64,
    tp_size: int = 1,
    mamba: bool = False,
    tokenizer: bool = False,
    kv_role: str = "kv_both",
    scheduler: dict[str, Any] | None = None,
) -> VllmConfig:
    """`tokenizer`: load the tokenizer in `model_dir` (the tiny config alone has none);
    `scheduler`: SchedulerConfig fields to change (a token budget below the prompts, ...)."""
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir),
            skip_tokenizer_init=not tokenizer,
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            seed=0,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            **{
                "max_num_batched_tokens": MAX_MODEL_LEN,
                "max_num_seqs": 16,
                "max_model_len": MAX_MODEL_LEN,
                "is_encoder_decoder": False,
                **(scheduler or {}),
            }
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="DuplexConnector",
            kv_connector_module_path="kvduplex.connector",
            kv_role=kv_role,
            kv_load_failure_policy="recompute",
            engine_id=engine_id,
            # Lookups are tested where a test turns them on; elsewhere the params path alone.
            kv_connector_extra_config={"lookup_timeout_ms": 0, **(extra_config or {})},
        ),
        device_config=DeviceConfig("cpu"),
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    if mamba:
        # What vLLM sets for a Mamba hybrid with prefix caching on.
        vllm_config.cache_config.mamba_cache_mode = "align"
    # Only the scheduler runs here: it reads the TP size, no process group is made.
    vllm_config.parallel_config.tensor_parallel_size = tp_size
    return vllm_config


@dataclass
class Step:
    output: SchedulerOutput
    outputs: list[EngineCoreOutput]

    @property
    def meta(self) -> DuplexConnectorMetadata:
        meta = self.output.kv_connector_metadata
        assert isinstance(meta, DuplexConnectorMetadata)
        return meta

    def finished(self, request_id: str) -> EngineCoreOutput | None:
        for out in self.outputs:
            if out.request_id == request_id and out.finish_reason is not None:
                return out
        return None


@dataclass
class Engine:
    """A real vLLM Scheduler with DuplexConnector; workers are played by the test."""

    name: str
    scheduler: Scheduler
    steps: list[Step] = field(default_factory=list)
    stats: DuplexConnectorStats = field(default_factory=DuplexConnectorStats)
    """Connector stats of every step so far, as vLLM reported them to its stats loggers."""

    @property
    def connector(self) -> DuplexConnector:
        connector = self.scheduler.connector
        assert isinstance(connector, DuplexConnector)
        return connector

    @property
    def duplex(self) -> DuplexScheduler:
        return self.connector._scheduler

    def add(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int = 1,
        params: dict[str, Any] | None = None,
        stop_token_ids: list[int] | None = None,
        stop: list[str] | None = None,
        min_tokens: int = 0,
    ) -> Request:
        extra_args = {"kv_transfer_params": params} if params is not None else None
        sampling = SamplingParams(
            max_tokens=max_tokens,
            stop_token_ids=stop_token_ids,
            stop=stop,
            min_tokens=min_tokens,
            extra_args=extra_args,
        )
        request = Request(
            request_id,
            list(prompt),
            sampling,
            None,
            block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
        )
        self.scheduler.add_request(request)
        return request

    def step(
        self,
        token: int = 7,
        freed_holds: Iterable[str] = (),
        finished_recving: Iterable[str] = (),
        failed_recving: Iterable[str] = (),
        invalid_block_ids: Iterable[int] = (),
        worker_stats: DuplexConnectorStats | None = None,
        worker_meta: DuplexWorkerMetadata | None = None,
        rank0: Callable[[DuplexConnectorMetadata], DuplexWorkerMetadata | None] | None = None,
    ) -> Step:
        """One engine step; the test plays the workers: `freed_holds` are holds that ended
        (as TP rank 0 reports them; the step's report settles its eviction order),
        `finished_recving` reads that completed (every TP rank reports their loads
        done, as the workers do). `rank0`, given this step's metadata, answers as TP rank 0
        does in this step's output (an eviction it carries out during the step)."""
        done = [*finished_recving, *failed_recving]
        if freed_holds or done:
            tp_size = self.scheduler.vllm_config.parallel_config.tensor_parallel_size
            worker_meta = DuplexWorkerMetadata(
                lookups=worker_meta.lookups if worker_meta is not None else {},
                freed_holds=list(freed_holds),
                loads_done=done * tp_size,
            )
        output = self.scheduler.schedule()
        if rank0 is not None:
            worker_meta = rank0(output.kv_connector_metadata)
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for request_id in req_ids:
            request = self.scheduler.requests[request_id]
            sampled.append([token] if request.num_computed_tokens >= request.num_tokens else [])
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            kv_connector_output=KVConnectorOutput(
                finished_recving=set(finished_recving),
                failed_recving=set(failed_recving),
                invalid_block_ids=set(invalid_block_ids),
                kv_connector_stats=worker_stats,
                kv_connector_worker_meta=worker_meta,
            ),
        )
        engine_outputs = self.scheduler.update_from_output(output, runner_output)
        outputs = [o for eco in engine_outputs.values() for o in eco.outputs]
        for eco in engine_outputs.values():
            if eco.scheduler_stats is not None and eco.scheduler_stats.kv_connector_stats:
                self.stats.aggregate(
                    DuplexConnector.build_kv_connector_stats(eco.scheduler_stats.kv_connector_stats)
                )
        step = Step(output=output, outputs=outputs)
        self.steps.append(step)
        return step

    def pull_step(self, held: dict, claim_id: int = 1) -> Step:
        """A scheduling round for requests whose params name a decode node's turn: P first
        looks the turn up there (the read must be claimed); the test answers as D's worker
        would from `held` (D's params). Returns the round in which P schedules."""
        step = self.step()
        if not step.meta.lookups:
            return step
        answers = {q.request_id: answer_lookup(q, held, claim_id) for q in step.meta.lookups}
        # The answers reach the scheduler at the end of this round; it schedules in the next.
        self.step(worker_meta=DuplexWorkerMetadata(lookups=answers))
        return self.step()

    def block_ids(self, request_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(request_id)[0])

    def ref_count(self, block_id: int) -> int:
        return self.scheduler.kv_cache_manager.block_pool.blocks[block_id].ref_cnt


def make_engine(
    model_dir: Path,
    name: str,
    extra_config: dict[str, Any] | None = None,
    num_blocks: int = 64,
    announce: bool = True,
    tp_size: int = 1,
    sliding_window: int | None = None,
    mamba: bool = False,
    tokenizer: bool = False,
    async_scheduling: bool = False,
    kv_role: str = "kv_both",
    scheduler: dict[str, Any] | None = None,
) -> Engine:
    """`async_scheduling`: vLLM's AsyncScheduler, which builds a step before the one before
    has reported (the test then schedules and reports steps itself: `Engine.step` reports
    each step at once)."""
    vllm_config = make_vllm_config(
        model_dir,
        name,
        extra_config,
        num_blocks,
        tp_size,
        mamba,
        tokenizer,
        kv_role,
        scheduler,
    )
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    kv_cache_config = make_kv_cache_config(num_blocks, sliding_window, mamba)
    scheduler = (AsyncScheduler if async_scheduling else Scheduler)(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )
    engine = Engine(name=name, scheduler=scheduler)
    if announce:
        engine.connector.set_xfer_handshake_metadata(
            {
                rank: DuplexHandshakeMetadata(
                    tp_rank=rank, host="127.0.0.1", port=SIDE_CHANNEL_PORT[name] + 100 * rank
                )
                for rank in range(tp_size)
            }
        )
    return engine


def make_kv_cache_config(
    num_blocks: int, sliding_window: int | None = None, mamba: bool = False
) -> KVCacheConfig:
    """One full-attention group of every layer; with `sliding_window`, a hybrid model as vLLM's
    hybrid KV-cache manager groups it (Gemma-2 style): layer 0 full attention, layer 1 a
    sliding window of that many tokens, one group each, sharing the block pool; with `mamba`,
    layer 1 is a Mamba-2 layer instead (Granite-4.0-H style, "align" mode)."""
    attention = dict(
        block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    if mamba:
        state = MambaSpec(
            block_size=BLOCK_SIZE,
            shapes=((3, 640), (8, 64, 64)),
            dtypes=(torch.float32, torch.float32),
            mamba_cache_mode="align",
        )
        groups = [
            KVCacheGroupSpec(layers[:1], FullAttentionSpec(**attention)),
            KVCacheGroupSpec(["model.layers.1.mixer"], state),
        ]
    elif sliding_window is None:
        groups = [KVCacheGroupSpec(layers, FullAttentionSpec(**attention))]
    else:
        groups = [
            KVCacheGroupSpec(layers[:1], FullAttentionSpec(**attention)),
            KVCacheGroupSpec(
                layers[1:], SlidingWindowSpec(**attention, sliding_window=sliding_window)
            ),
        ]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def prompt_tokens(num_tokens: int, start: int = 100) -> list[int]:
    """Distinct token ids, so no two test prompts share a prefix-cache block by accident."""
    return [start + i for i in range(num_tokens)]


def answer_lookup(lookup: LookupSpec, held: dict | None, claim_id: int = 1) -> list[LookupMatch]:
    """What the owner's worker answers a lookup or grant when it holds `held` (its params): a
    match of the leading blocks whose fingerprints agree, claimed, or nothing."""
    if not held or not held.get("remote_block_fingerprints"):
        return []
    if lookup.owner_request_id not in (None, held["remote_request_id"]):
        return []
    matched = 0
    for mine, theirs in zip(lookup.fingerprints, held["remote_block_fingerprints"]):
        if mine != theirs:
            break
        matched += 1
    if matched == 0:
        return []
    return [
        LookupMatch(
            owner_engine_id=f"{held['remote_engine_id']}/tp0",
            owner_address=f"{held['remote_host']}:{held['remote_ports'][0]}",
            owner_request_id=held["remote_request_id"],
            matched_blocks=matched,
            claim_id=claim_id,
            claim_expiry=held["remote_lease_expiry"],
            offer=json.dumps(held).encode(),
        )
    ]


def run(
    engine: Engine, request_id: str, prompt: list[int], params: dict, max_tokens: int
) -> tuple[LoadSpec | None, dict | None]:
    """Runs a request to its end, playing the workers: the owner that `params` name answers
    the grant (or lookup) from `params`, and a pull completes in the step after it was posted.
    Returns (the load, the finished request's params)."""
    engine.add(request_id, prompt, max_tokens=max_tokens, params=params)
    answer, load = None, None
    for _ in range(max_tokens + 10):
        step = engine.step(worker_meta=answer)
        answer = None
        finished = step.finished(request_id)
        if finished is not None:
            return load, finished.kv_transfer_params
        if step.meta.lookups:
            (lookup,) = step.meta.lookups
            answer = DuplexWorkerMetadata(lookups={request_id: answer_lookup(lookup, params)})
            continue
        if step.meta.loads and load is None:
            (load,) = step.meta.loads
            assert load.request_id == request_id
            if not step.output.num_scheduled_tokens:
                # An asynchronous pull: the test plays the worker and completes it.
                engine.step(finished_recving={request_id})
        # Else a chunk of the prompt ran (a Mamba model's prefill stops at block boundaries).
    raise AssertionError(f"{request_id} did not finish on {engine.name}")


def prefill(p: Engine, request_id: str, prompt: list[int], params: dict | None = None) -> dict:
    """Turn's prefill on P (max_tokens=1, as a P/D proxy sends it); returns P's params. The
    test plays the decode node that `params` name (see `run`)."""
    _, out = run(p, request_id, prompt, params or {"do_remote_decode": True}, max_tokens=1)
    assert out is not None
    return out


def decode(
    d: Engine, request_id: str, prompt: list[int], params: dict, max_tokens: int
) -> tuple[LoadSpec | None, dict | None]:
    """D pulls (granted from `params`, the test completes the read) and decodes; returns
    (load, D's params)."""
    return run(d, request_id, prompt, params, max_tokens)


def running(engine: Engine) -> list[str]:
    return [request.request_id for request in engine.scheduler.running]


def make_kv_caches(
    num_blocks: int, seed: int | None = None, kv_heads: int = NUM_KV_HEADS, layout: str = "LBHNC"
) -> dict[str, torch.Tensor]:
    """KV caches as vLLM allocates them: per layer a [blocks, kv_heads, block_size,
    2 * head_size] float32 view of one shared buffer in `layout`'s strides (vLLM's
    `KVCacheLayout` name; its CPU backend's LBHNC, layer after layer, head-major, by default;
    `kv_heads`: a TP rank's share). Filled from `seed` (the same values in any layout), or
    zeros when it is None."""
    return vllm_kv_caches(
        layout,
        num_layers=NUM_LAYERS,
        num_blocks=num_blocks,
        kv_heads=kv_heads,
        block_size=BLOCK_SIZE,
        head_size=HEAD_SIZE,
        seed=seed,
    )


def make_worker(
    model_dir: Path,
    engine_id: str,
    kv_caches: dict[str, torch.Tensor],
    extra_config: dict[str, Any] | None = None,
    sliding_window: int | None = None,
    tp_size: int = 1,
    tp_rank: int = 0,
):
    """A real DuplexWorker (transfer core included) with `kv_caches` registered; with
    `sliding_window`, the hybrid model's KV-cache groups (see `make_kv_cache_config`); as TP
    rank `tp_rank` of `tp_size` (its caches then hold its share of the KV heads)."""
    from kvduplex.connector.config import DuplexConfig
    from kvduplex.connector.worker import DuplexWorker

    num_blocks = next(iter(kv_caches.values())).shape[0]
    vllm_config = make_vllm_config(model_dir, engine_id, extra_config, num_blocks, tp_size)
    worker = DuplexWorker(
        vllm_config,
        make_kv_cache_config(num_blocks, sliding_window),
        DuplexConfig.from_extra_config(extra_config),
        engine_id,
        tp_rank=tp_rank,
    )
    worker.register_kv_caches(kv_caches)
    return worker


def look_up(
    worker,
    request_id: str,
    fingerprints: list[str],
    timeout_s: float = 2.0,
    owner: str | None = None,
    owner_request_id: str | None = None,
    continues: str | None = None,
):
    """Step the reader like vLLM does until its lookup (or grant), asked now with `timeout_s`
    to its deadline, is reported; returns the longest match (None: no owner holds any of the
    blocks, or the grant was refused)."""
    spec = LookupSpec(
        request_id,
        tuple(fingerprints),
        time.monotonic() + timeout_s,
        owner,
        owner_request_id,
        continues=continues,
    )
    worker.begin_step(DuplexConnectorMetadata(lookups=[spec]))
    deadline = time.monotonic() + LOOKUP_WAIT_S
    while time.monotonic() < deadline:
        worker.get_transfer_results()
        meta = worker.build_connector_worker_meta()
        if meta is not None and request_id in meta.lookups:
            matches = meta.lookups[request_id]
            return matches[0] if matches else None
        time.sleep(0.002)
    raise AssertionError(f"lookup {request_id} was never reported")
