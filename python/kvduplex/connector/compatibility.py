"""What must be equal on both sides for a block to mean the same KV: the compatibility
fingerprint each TP rank's transfer core presents at the handshake. A peer whose fingerprint
differs is refused there, with the first differing field named (in name order), and every
request that would have read from it recomputes.

Held KV is not bound to the weights by this: engines that change their weights in place keep
their path and revision; their holds end at vLLM's cache reset instead (`worker.py`).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

from kvduplex import protocol
from kvduplex.connector.kv_layout import KVLayout, page_layout

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from kvduplex.connector.groups import TransferGroups


def compatibility_fingerprint(
    vllm_config: VllmConfig,
    kv_caches: dict[str, torch.Tensor],
    layout: KVLayout,
    groups: TransferGroups,
    head_bytes: int | None,
) -> dict[str, str]:
    """Each KV-cache group has its own entry (`kv_cache_group<i>`), so a mismatch names the
    group. The pages' physical layout (`page_layout`: shapes and byte strides) is compared,
    not their logical shape, which vLLM keeps whatever the layout; with head-major pages one
    head's run stands for the page and the TP size is left out: engines at other TP sizes
    pair by head (`tp.rank_reads`). The attention backends too: two backends may fill the
    same bytes differently."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    first = next(iter(kv_caches.values()))
    hf = model.hf_config
    backends = sorted({backend.get_name() for backend in get_current_attn_backends(vllm_config)})
    fingerprint = {
        "kvduplex_protocol": str(protocol.PROTOCOL_VERSION),
        "vllm_version": vllm.__version__,
        # The weights and the code that computes with them (as vLLM's NixlConnector, by the
        # model's path or hub name: equal weights under two paths are refused too).
        "model": model.model,
        "revision": model.revision or "",
        "code_revision": model.code_revision or "",
        "quantization": model.quantization or "",
        "architectures": ",".join(getattr(hf, "architectures", None) or []),
        "model_type": str(getattr(hf, "model_type", "")),
        "vocab_size": str(model.get_vocab_size()),
        "hidden_size": str(model.get_hidden_size()),
        "num_kv_heads": str(model.get_total_num_kv_heads()),
        "head_size": str(model.get_head_size()),
        "num_layers": str(len(kv_caches)),
        "layer_names": hashlib.blake2b(
            "\n".join(kv_caches).encode(), digest_size=8
        ).hexdigest(),
        "block_size": str(vllm_config.cache_config.block_size),
        "cache_dtype": f"{vllm_config.cache_config.cache_dtype}/{first.dtype}",
        "attention_backend": ",".join(backends),
        "segments": str(len(layout.segment_bases)),
        "device_type": first.device.type,
        "kv_cache_groups": str(len(groups)),
        **groups.describe(),
        # Named after the KV-cache groups' entries, so that a mismatch names a group first.
        "page_layout": page_layout(kv_caches, head_bytes, parallel.tensor_parallel_size),
    }
    if first.device.type == "cpu":
        # The CPU attention kernels lay out a block's interior per instruction set.
        fingerprint["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return fingerprint
