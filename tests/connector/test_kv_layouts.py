"""vLLM 0.32's KV cache layouts: one logical shape, different strides. An owner and a reader
pair only where their pages match byte for byte, heterogeneous TP reads by head only where the
strides make each head one run, and the connector asks vLLM for the head-major layout.

The caches are built by `kvduplex_testing.kv_caches` (checked here against vLLM's own
allocation); the two-process tests reuse the owner process of test_worker_transfer.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

try:  # vLLM 0.33 moved it
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
except ImportError:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups

from duplex_harness import (
    BLOCK_SIZE,
    HEAD_SIZE,
    NUM_KV_HEADS,
    make_kv_cache_config,
    make_kv_caches,
    make_vllm_config,
    make_worker,
)
from kvduplex.connector import DuplexConnector
from kvduplex.connector.compatibility import compatibility_fingerprint
from kvduplex.connector.groups import TransferGroups
from kvduplex.connector.kv_layout import describe_kv_caches, head_major_bytes
from kvduplex_testing.kv_caches import LAYOUTS
from test_worker_transfer import (
    NUM_BLOCKS,
    OwnerProcess,
    assert_holds_its_heads,
    load,
    run_until_received,
)

# Each block page of one layer is one byte range: the transfer core can read these.
DENSE = ["LBHNC", "LBNHC", "BLHNC", "BLNHC"]
HEAD_MAJOR = ["LBHNC", "BLHNC"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_test_caches_are_laid_out_as_vllm_allocates_them(tiny_config_dir: Path, layout):
    vllm_config = make_vllm_config(tiny_config_dir, "x", num_blocks=8)
    vllm_config.cache_config.kv_cache_layout = layout
    vllm_config.cache_config.num_gpu_blocks_override = 8
    groups = make_kv_cache_config(8).kv_cache_groups
    kv_cache_config = get_kv_cache_config_from_groups(vllm_config, groups, 1 << 30)
    theirs = allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout[layout])
    ours = make_kv_caches(8, layout=layout)
    assert list(ours) == list(theirs)
    base, their_base = next(iter(ours.values())).data_ptr(), next(iter(theirs.values())).data_ptr()
    for name, tensor in ours.items():
        assert (tensor.shape, tensor.stride(), tensor.dtype) == (
            theirs[name].shape, theirs[name].stride(), theirs[name].dtype
        )
        assert tensor.data_ptr() - base == theirs[name].data_ptr() - their_base


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kv_heads", [NUM_KV_HEADS, 1])
def test_head_major_pages_are_told_by_their_strides(layout, kv_heads):
    """Every layout has the same logical shape; only LBHNC and BLHNC keep each of several heads
    one run of the page, and LHBNC and BHLNC split a page into runs apart. With one head, any
    layout's page is that head's run."""
    caches = make_kv_caches(NUM_BLOCKS, kv_heads=kv_heads, layout=layout)
    assert {tuple(t.shape) for t in caches.values()} == {
        (NUM_BLOCKS, kv_heads, BLOCK_SIZE, 2 * HEAD_SIZE)
    }
    if layout not in DENSE and kv_heads > 1:
        with pytest.raises(ValueError, match="not one contiguous byte range.*VLLM_KV_CACHE_LAYOUT"):
            describe_kv_caches(caches, NUM_BLOCKS)
        return
    layout_of = describe_kv_caches(caches, NUM_BLOCKS)
    head_bytes = BLOCK_SIZE * 2 * HEAD_SIZE * 4
    expected = head_bytes if layout in HEAD_MAJOR or kv_heads == 1 else None
    assert head_major_bytes(caches, layout_of, kv_heads) == expected


def _fingerprint(tiny_config_dir: Path, layout: str, kv_heads: int, tp_size: int) -> dict:
    vllm_config = make_vllm_config(tiny_config_dir, "x", num_blocks=NUM_BLOCKS, tp_size=tp_size)
    caches = make_kv_caches(NUM_BLOCKS, kv_heads=kv_heads, layout=layout)
    layout_of = describe_kv_caches(caches, NUM_BLOCKS)
    groups = TransferGroups.from_kv_cache_config(make_kv_cache_config(NUM_BLOCKS))
    head_bytes = head_major_bytes(caches, layout_of, kv_heads)
    return compatibility_fingerprint(vllm_config, caches, layout_of, groups, head_bytes)


def test_the_fingerprint_carries_the_physical_layout_and_the_backend(tiny_config_dir):
    hnd = _fingerprint(tiny_config_dir, "LBHNC", NUM_KV_HEADS, 1)
    nhd = _fingerprint(tiny_config_dir, "LBNHC", NUM_KV_HEADS, 1)
    assert hnd["attention_backend"] == "CPU_ATTN"
    assert {key for key in hnd if hnd[key] != nhd.get(key)} == {"page_layout"}
    # Layers interleaved per block: other segments, the same pages.
    interleaved = _fingerprint(tiny_config_dir, "BLHNC", NUM_KV_HEADS, 1)
    assert interleaved["page_layout"] == hnd["page_layout"]
    # Head-major at TP 1 and one head per rank at TP 2 (any layout): the same head runs.
    for layout in DENSE:
        assert _fingerprint(tiny_config_dir, layout, 1, 2)["page_layout"] == hnd["page_layout"]


def test_the_connector_has_vllm_lay_the_cache_out_head_major(tiny_config_dir, monkeypatch):
    """vLLM asks the connector class for its layout when it resolves one; with backends of no
    preference (FlashAttention, Triton: vLLM's default order, NHD first) it takes ours."""
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    vllm_config = make_vllm_config(tiny_config_dir, "x")
    assert DuplexConnector.get_required_kvcache_layout(vllm_config) == "LBHNC"
    no_preference = [["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]]
    assert resolve_kv_cache_layout(vllm_config, no_preference) == KVCacheLayout.LBHNC


# --------------------------------------------------------------- two processes, real reads

@pytest.fixture(scope="module")
def owners(tiny_config_dir: Path):
    """Owner processes at TP 1 by layout, started on first use."""
    started: dict[str, OwnerProcess] = {}

    def get(layout: str) -> OwnerProcess:
        if layout not in started:
            started[layout] = OwnerProcess(tiny_config_dir, layout, f"owner-{layout}")
        return started[layout]

    yield get
    for process in started.values():
        process.stop()


def _reader(tiny_config_dir, layout: str, tp_size: int = 1, tp_rank: int = 0):
    caches = make_kv_caches(NUM_BLOCKS, kv_heads=NUM_KV_HEADS // tp_size, layout=layout)
    worker = make_worker(
        tiny_config_dir, f"reader-{layout}-tp{tp_size}", caches, {"handshake_timeout_s": 2},
        tp_size=tp_size, tp_rank=tp_rank,
    )
    return worker, caches


@pytest.mark.slow
def test_a_token_major_owner_and_a_head_major_reader_never_pair(
    owners, tiny_config_dir, connector_log
):
    """Same model, same logical page shape, other strides: refused at the handshake, the
    request recomputes, no byte is written."""
    owner = owners("LBNHC")
    worker, caches = _reader(tiny_config_dir, "LBHNC")
    try:
        failed = run_until_received(worker, load(owner, "p-nhd", [1, 2], [3, 4]))
    finally:
        worker.shutdown()
    assert failed == {1, 2}
    assert not any(t.any() for t in caches.values())
    assert any("`page_layout`" in m for m in connector_log.messages()), connector_log.text


@pytest.mark.parametrize(
    "owner_layout,reader_layout",
    [
        ("LBHNC", "LBHNC"),
        ("BLHNC", "LBHNC"),
        ("LBHNC", "BLHNC"),
        # One head per reader rank: a token-major page is that head's run.
        ("LBHNC", "LBNHC"),
        ("LBHNC", "BLNHC"),
    ],
)
@pytest.mark.slow
def test_reader_ranks_at_tp2_read_their_heads_byte_for_byte_in_every_layout_that_pairs(
    owners, tiny_config_dir, owner_layout, reader_layout
):
    owner = owners(owner_layout)
    local, remote = [1, 5, 6], [7, 2, 3]
    for rank in range(2):
        worker, caches = _reader(tiny_config_dir, reader_layout, tp_size=2, tp_rank=rank)
        try:
            assert run_until_received(worker, load(owner, f"p-tp2-{rank}", local, remote)) == set()
        finally:
            worker.shutdown()
        assert_holds_its_heads(caches, owner, local, remote, rank)


@pytest.mark.slow
def test_a_token_major_owner_at_another_tp_size_is_refused(owners, tiny_config_dir, connector_log):
    """Its heads are not runs of its pages: reading a rank's share by head is impossible."""
    owner = owners("LBNHC")
    worker, caches = _reader(tiny_config_dir, "LBHNC", tp_size=2, tp_rank=1)
    try:
        assert run_until_received(worker, load(owner, "p-nhd-tp2", [1], [3])) == {1}
    finally:
        worker.shutdown()
    assert not any(t.any() for t in caches.values())
    assert any("`page_layout`" in m for m in connector_log.messages()), connector_log.text
