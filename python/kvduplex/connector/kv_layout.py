"""The registered KV cache's physical layout: where each layer's block pages lie for the
transfer core, whether each KV head is one contiguous run of a page (what heterogeneous TP
reads by), and the page layout peers must share byte for byte.

vLLM 0.32 views every attention layer's cache as logical `[blocks, kv_heads, block_size, C]`
(C: a token's K and V side by side, `(head_size + head_size_v) * dtype size` bytes; FlashAttention
and Triton split it after transposing), and lays those four axes (with the layer axis, five) out
in one of the stride orders that `vllm.v1.kv_cache_layout.KVCacheLayout` names, the same logical
shape whatever the order: LBNHC ("NHD", token-major: FlashAttention's and Triton's default),
LBHNC ("HND", head-major: the CPU backend's, FlashInfer's on Blackwell, what NixlConnector and
DuplexConnector ask vLLM for), BLHNC/BLNHC (a block holds every layer's page), and LHBNC/BHLNC,
where a layer's page of one block is not one byte range (refused at start). So the logical
shape says nothing about the bytes: two engines agree only when their pages' strides do, and a
page is head-major only when its strides make each head one run. Everything here is read from
the tensors' strides.

Pure: torch only, no vLLM (`benches/gpu_check.py` runs it where vLLM is not installed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# vLLM's name of the layout DuplexConnector asks for (`get_required_kvcache_layout`): every
# layer's block page head after head, so engines at other TP sizes read a rank's heads as one
# byte range of each page (NixlConnector asks for it too).
HEAD_MAJOR_LAYOUT = "LBHNC"

# vLLM's remedy, quoted in the refusal of a page that is not one byte range.
_DENSE_LAYOUT_HINT = (
    "vLLM's KV cache layouts LHBNC and BHLNC split a block's page of a layer into one run per "
    "KV head; run with VLLM_KV_CACHE_LAYOUT=LBHNC (or LBNHC, BLHNC, BLNHC)"
)


@dataclass(frozen=True)
class KVLayout:
    """Where the blocks of the registered KV cache live, as the transfer core sees them."""

    regions: tuple[tuple[int, int], ...]
    segment_bases: tuple[int, ...]
    block_len: int
    block_stride: int
    num_blocks: int
    layer_segments: tuple[tuple[str, int], ...] = ()
    """(layer name, index of the segment holding its KV cache)."""


def describe_kv_caches(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> KVLayout:
    """Treat each layer's KV block as one opaque page of bytes.

    vLLM views every layer as [blocks, ...] (kernel blocks may split a cache block into
    several consecutive pages). A block must be one dense byte range at the same stride in
    every layer. Pages may be shorter than others (a state-space layer's state, padded by vLLM
    to the attention page): a block is read at the longest page's length, which must stay
    inside each layer's tensor storage. Each distinct storage is registered once.
    """
    regions: dict[int, int] = {}
    bases: list[int] = []
    layer_segments: list[tuple[str, int]] = []
    block_stride = None
    lengths: dict[str, int] = {}
    for name, tensor in kv_caches.items():
        if tensor.dim() < 2 or tensor.shape[0] % num_blocks:
            raise ValueError(
                f"DuplexConnector: KV cache of layer {name} has shape {tuple(tensor.shape)}, "
                f"not [{num_blocks} blocks, ...]"
            )
        pages_per_block = tensor.shape[0] // num_blocks
        page = tensor[0]
        page_bytes = page.numel() * tensor.element_size()
        page_stride = tensor.stride(0) * tensor.element_size()
        if not _is_dense(page) or (pages_per_block > 1 and page_stride != page_bytes):
            raise ValueError(
                f"DuplexConnector: a KV block of layer {name} is not one contiguous byte "
                f"range (shape {tuple(tensor.shape)}, strides {tensor.stride()}): "
                f"{_DENSE_LAYOUT_HINT}"
            )
        layer_len, layer_stride = pages_per_block * page_bytes, pages_per_block * page_stride
        if block_stride is None:
            block_stride = layer_stride
        elif layer_stride != block_stride:
            raise ValueError(
                f"DuplexConnector: layer {name} has block stride {layer_stride}, other layers "
                f"{block_stride}"
            )
        lengths[name] = layer_len
        storage = tensor.untyped_storage()
        regions[storage.data_ptr()] = storage.nbytes()
        if tensor.data_ptr() not in bases:
            bases.append(tensor.data_ptr())
        layer_segments.append((name, bases.index(tensor.data_ptr())))
    if block_stride is None:
        raise ValueError("DuplexConnector: no KV cache tensors to register")
    block_len = max(lengths.values())
    for name, tensor in kv_caches.items():
        storage = tensor.untyped_storage()
        end = tensor.data_ptr() + (num_blocks - 1) * block_stride + block_len
        if block_len > block_stride or end > storage.data_ptr() + storage.nbytes():
            raise ValueError(
                f"DuplexConnector: layer {name}'s last block, read at the longest layer's "
                f"{block_len} bytes (its own: {lengths[name]}), would end outside its storage"
            )
    return KVLayout(
        regions=tuple(regions.items()),
        segment_bases=tuple(bases),
        block_len=block_len,
        block_stride=block_stride,
        num_blocks=num_blocks,
        layer_segments=tuple(layer_segments),
    )


def _is_dense(page: torch.Tensor) -> bool:
    """True when the tensor's elements fill one byte range without gaps or overlap."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(page.shape, page.stride()))
    return all(stride > 0 for stride in page.stride()) and span == page.numel()


def head_major_bytes(
    kv_caches: dict[str, torch.Tensor], layout: KVLayout, local_heads: int
) -> int | None:
    """One KV head's bytes in a block page when, by the strides, every layer's page
    `[local_heads, ...]` holds each head as one contiguous run, head after head (vLLM's LBHNC
    and BLHNC layouts; any layout with one local head), so that engines at other TP sizes can
    be read by head (`tp.rank_reads`); else None (e.g. LBNHC with several heads: a head's
    tokens are `local_heads` runs apart). Only for one whole page per block; the caller rules
    out hybrid models, whose pages hold other things than heads."""
    if local_heads <= 0 or layout.block_len % local_heads:
        return None
    head_bytes = layout.block_len // local_heads
    for tensor in kv_caches.values():
        if tensor.shape[0] != layout.num_blocks or tensor.dim() < 3:
            return None
        page = tensor[0]
        page_bytes = page.numel() * tensor.element_size()
        if page.shape[0] != local_heads or page_bytes != head_bytes * local_heads:
            return None
        if local_heads > 1 and page.stride(0) * tensor.element_size() != head_bytes:
            return None
        if not _is_dense(page[0]):
            return None
    return head_bytes


def page_layout(
    kv_caches: dict[str, torch.Tensor], head_bytes: int | None, tp_size: int
) -> str:
    """The physical layout of every layer's block page, for the compatibility fingerprint:
    each distinct page's logical shape with its byte strides (size-1 axes' strides are shown
    as 0: they address nothing). Head-major pages (`head_bytes`) are described by one head's
    run, which engines at any TP size share; other pages by the whole page, and the TP size
    (a page's heads are the rank's share)."""
    pages = []
    for tensor in kv_caches.values():
        page = tensor[0][0] if head_bytes is not None else tensor[0]
        strides = (
            0 if size == 1 else stride * tensor.element_size()
            for size, stride in zip(page.shape, page.stride())
        )
        shape = "x".join(map(str, page.shape))
        described = f"{shape} at byte strides {','.join(map(str, strides))}"
        if described not in pages:
            pages.append(described)
    if head_bytes is not None:
        return f"head-major, each KV head's run {'; '.join(pages)}, at any TP size"
    return f"pages {'; '.join(pages)}, at TP size {tp_size}"
