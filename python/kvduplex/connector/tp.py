"""Tensor parallelism across engines: which owner ranks a reader's TP rank reads, and which
part of each block page.

vLLM shards the KV heads over TP ranks: rank r of an engine at TP size T holds heads
[r*H/T, (r+1)*H/T) of the model's H KV heads. Two engines at the same TP size pair rank r with
rank r, whole pages. At different sizes (heterogeneous TP: e.g. P at TP=1, D at TP=2) a reader
rank fills its heads from every owner rank that holds some of them: where a block page is laid
out head-major by its strides (vLLM's LBHNC and BLHNC layouts, `kv_layout.head_major_bytes`),
each head is one contiguous run of `head_bytes`, so the heads two ranks share are one byte range
of each page, read with a block slice. Not mappable, and refused with the reason: H not
divisible by both TP sizes (vLLM then replicates heads), pages that are not head-major (both
sides' page layouts are also compared at the handshake: `compatibility.py`).

Pure: no vLLM, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankRead:
    """One read of a reader rank's load: from the owner's TP rank `owner_rank`, the byte range
    `block_slice` = (offset in the owner's page, offset in ours, length) of every block, or
    whole pages (None)."""

    owner_rank: int
    block_slice: tuple[int, int, int] | None


def mappable(total_kv_heads: int, *tp_sizes: int) -> str | None:
    """Why engines at these TP sizes cannot pair their KV heads, or None when they can."""
    if len(set(tp_sizes)) <= 1:
        return None
    for tp in tp_sizes:
        if tp <= 0 or total_kv_heads % tp:
            return (
                f"the model's {total_kv_heads} KV heads do not split evenly over "
                f"tensor-parallel size {tp} (vLLM then replicates heads)"
            )
    return None


def rank_reads(
    total_kv_heads: int,
    reader_tp: int,
    reader_rank: int,
    owner_tp: int,
    head_bytes: int | None,
) -> list[RankRead]:
    """The reads that fill reader rank `reader_rank`'s KV heads from an owner at `owner_tp`;
    `head_bytes`: one head's run in a block page, None when pages are not head-major. Raises
    ValueError when the heads cannot be mapped."""
    if not 0 <= reader_rank < reader_tp:
        raise ValueError(f"TP rank {reader_rank} is outside tensor-parallel size {reader_tp}")
    if owner_tp == reader_tp:
        return [RankRead(reader_rank, None)]
    reason = mappable(total_kv_heads, reader_tp, owner_tp)
    if reason is None and head_bytes is None:
        reason = "this engine's KV-cache pages are not head-major"
    if reason is not None:
        raise ValueError(
            f"cannot read from an engine at tensor-parallel size {owner_tp} into one at "
            f"{reader_tp}: {reason}"
        )
    assert head_bytes is not None
    mine, theirs = total_kv_heads // reader_tp, total_kv_heads // owner_tp
    start, end = reader_rank * mine, (reader_rank + 1) * mine
    reads = []
    for owner_rank in range(start // theirs, (end - 1) // theirs + 1):
        first = max(start, owner_rank * theirs)
        last = min(end, (owner_rank + 1) * theirs)
        reads.append(
            RankRead(
                owner_rank,
                (
                    (first - owner_rank * theirs) * head_bytes,
                    (first - start) * head_bytes,
                    (last - first) * head_bytes,
                ),
            )
        )
    return reads
