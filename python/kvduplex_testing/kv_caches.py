"""KV caches shaped and laid out as vLLM 0.32 allocates them, without vLLM (GPU checks run where
it is not installed); `tests/connector/test_kv_layouts.py` checks them against vLLM's own
`allocate_kv_cache`.

vLLM allocates one byte buffer for all layers of a uniform model, views it as the logical
`[layers, blocks, kv_heads, block_size, C bytes]` (C: a token's K then V) with the strides of
the resolved `KVCacheLayout` (a permutation of those five axes, outermost first), and hands
each layer `[blocks, kv_heads, block_size, C / dtype size]` in the model's dtype.
"""

from __future__ import annotations

import torch

# vllm.v1.kv_cache_layout.KVCacheLayout: the axes [L, B, H, N, C] in memory order.
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),  # "HND": each layer's block is head after head
    "LBNHC": (0, 1, 3, 2, 4),  # "NHD": token after token
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),  # a block holds every layer's page, each head-major
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def layer_names(num_layers: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]


def vllm_kv_caches(
    layout: str,
    *,
    num_layers: int,
    num_blocks: int,
    kv_heads: int,
    block_size: int,
    head_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int | None = None,
) -> dict[str, torch.Tensor]:
    """Per layer the `[blocks, kv_heads, block_size, 2 * head_size]` view vLLM registers with
    a KV connector, in `layout`'s strides over one shared buffer. Zeros, or with `seed` the
    same logical values whatever the layout (drawn on the CPU, layer by layer), so that caches
    of two layouts compare by value."""
    order = LAYOUTS[layout]
    content = 2 * head_size * torch.tensor([], dtype=dtype).element_size()
    shape = (num_layers, num_blocks, kv_heads, block_size, content)
    strides = [0] * 5
    step = 1
    for axis in reversed(order):
        strides[axis] = step
        step *= shape[axis]
    buffer = torch.zeros(step, dtype=torch.int8, device=device)
    by_axes = torch.as_strided(buffer, shape, strides)
    caches = {name: by_axes[i].view(dtype) for i, name in enumerate(layer_names(num_layers))}
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        for cache in caches.values():
            values = torch.randn(cache.shape, generator=generator, dtype=torch.float32)
            cache.copy_(values.to(dtype))
    return caches
