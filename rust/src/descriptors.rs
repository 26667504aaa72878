//! Turns "copy remote block `r` into local block `l`" requests into the fewest one-sided reads.
//!
//! Every read posted to UCX costs a work request and a completion, so a batch of blocks is
//! planned as a list of [`Descriptor`]s in which byte ranges that are contiguous on *both*
//! sides are merged. vLLM hands out block ids in ascending runs, so a typical request of `n`
//! blocks collapses to about one read per run per segment.
//!
//! Ids arrive as `i64` from Python/JSON and name memory on a machine we do not control, so
//! every id is range-checked against its own layout before any address is formed: a bad id
//! must become an error, never a read of (or into) foreign memory.
//!
//! # Block-size ratio
//!
//! Engines may use different block sizes (e.g. a prefill engine with 32-token blocks feeding
//! a decode engine with 16-token blocks). Blocks are token-major, so a block `k` times larger
//! is exactly `k` smaller blocks laid end to end. Planning therefore works on *units* of the
//! smaller `block_len`: unit `u` is sub-block `u % k` of the `u / k`-th id on the larger
//! side, and the `u`-th id on the smaller side. For a remote side `k` times larger this
//! means `local_ids.len() == k * remote_ids.len()` and `local_ids[k*i + j]` receives bytes
//! `[j*local.block_len, (j+1)*local.block_len)` of remote block `remote_ids[i]`; a larger
//! local side is the mirror image. Block sizes that are not whole multiples of each other
//! are rejected rather than split, since no block boundary would line up.
//!
//! # Block slices
//!
//! With a [`BlockSlice`] every block pair moves only a sub-range of its page: `len` bytes from
//! `remote_offset` into the remote block go to `local_offset` into the local block. This is
//! what a reader needs when the two engines split the KV heads differently (heterogeneous
//! tensor parallelism): a page is heads-outermost, so one rank's heads are one contiguous
//! byte range of another rank's page. Ids then pair one to one whatever the two block sizes
//! are, since only the slice has to fit each side's `block_len`. A slice that covers both
//! pages whole is the same as no slice; any other slice gets one read per (segment, block):
//! no two sliced reads are ever merged.
//!
//! # Output order
//!
//! The plan is segment-major and, within a segment, follows the id lists: the pairing of
//! ids is the caller's decision, so ids are never reordered, only adjacent pairs merged.

use std::fmt;

use serde::{Deserialize, Serialize};

mod regions;
pub use regions::{check_remote_bounds, RegionBounds, RegionIndex};

/// Where one engine's KV blocks live. A *segment* is one layer's KV tensor (or a layer's K or V
/// tensor when they are separate); block `b` of segment `s` occupies
/// `[segment_bases[s] + b*block_stride, +block_len)`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockLayout {
    pub segment_bases: Vec<u64>,
    /// Bytes from block `b` to block `b+1`.
    pub block_stride: u64,
    /// Bytes of one block that are transferred (`<= block_stride`); the rest of the stride is
    /// padding that is never read or written.
    pub block_len: u64,
    pub num_blocks: u64,
}

/// The part of every block a batch reads: `len` bytes at `remote_offset` into each remote
/// block go to `local_offset` into its local block (see the [module docs](self#block-slices)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockSlice {
    pub remote_offset: u64,
    pub local_offset: u64,
    pub len: u64,
}

impl BlockSlice {
    /// Checks that the slice is non-empty and lies inside one block on each side (with
    /// `offset + len` computed without overflow).
    fn validate(&self, local: &BlockLayout, remote: &BlockLayout) -> Result<(), PlanError> {
        if self.len == 0 {
            return Err(PlanError::EmptySlice);
        }
        for (side, offset, block_len) in [
            (Side::Remote, self.remote_offset, remote.block_len),
            (Side::Local, self.local_offset, local.block_len),
        ] {
            if offset.checked_add(self.len).is_none_or(|end| end > block_len) {
                return Err(PlanError::SliceOutsideBlock {
                    side,
                    offset,
                    len: self.len,
                    block_len,
                });
            }
        }
        Ok(())
    }

    /// Whether the slice is both sides' whole block, i.e. no slice at all.
    fn is_whole(&self, local: &BlockLayout, remote: &BlockLayout) -> bool {
        self.remote_offset == 0
            && self.local_offset == 0
            && self.len == local.block_len
            && self.len == remote.block_len
    }
}

/// One one-sided read: `len` bytes from the peer's `remote_addr` into our `local_addr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Descriptor {
    pub local_addr: u64,
    pub remote_addr: u64,
    pub len: u64,
}

/// Which engine an id or layout belongs to, so that errors say whose data was wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Local,
    Remote,
}

impl Side {
    fn owner(self) -> &'static str {
        match self {
            Side::Local => "this engine",
            Side::Remote => "peer",
        }
    }
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Local => "local",
            Side::Remote => "remote",
        })
    }
}

/// A layout that cannot describe real memory. Kept apart from [`PlanError`] so the same
/// reason can be reported with or without knowing which engine the layout came from.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    #[error("block_len is 0")]
    ZeroBlockLen,
    #[error("block_len {block_len} exceeds block_stride {block_stride}, so blocks would overlap")]
    BlockLenExceedsStride { block_len: u64, block_stride: u64 },
    #[error(
        "layout overflows u64: segment {segment} at {base:#x} holds {num_blocks} blocks of stride {block_stride}"
    )]
    Overflow { segment: usize, base: u64, num_blocks: u64, block_stride: u64 },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlanError {
    /// From [`BlockLayout::validate_within`], whose caller knows whose layout it checked.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// From [`plan_reads`], which names the engine whose layout is malformed.
    #[error("{side} layout: {reason}")]
    SideLayout { side: Side, reason: LayoutError },
    #[error("segment count differs: local {local}, remote {remote}")]
    SegmentCountMismatch { local: usize, remote: usize },
    #[error("segments {start}..{end} are not a non-empty range of the {segments} segments")]
    SegmentRange { start: usize, end: usize, segments: usize },
    #[error(
        "block sizes are not whole multiples of each other: local block_len {local}, remote block_len {remote}"
    )]
    UnsupportedBlockRatio { local: u64, remote: u64 },
    #[error(
        "block id lists differ in length: {local} local ids, {remote} remote ids \
         (block_len local {local_block_len}, remote {remote_block_len})"
    )]
    IdCountMismatch { local: usize, remote: usize, local_block_len: u64, remote_block_len: u64 },
    #[error("block slice len is 0")]
    EmptySlice,
    #[error("block slice {offset}+{len} does not fit in a {side} block of block_len {block_len}")]
    SliceOutsideBlock { side: Side, offset: u64, len: u64, block_len: u64 },
    #[error(
        "a block slice pairs block ids one to one, but there are {local} local ids and {remote} remote ids"
    )]
    SliceIdCountMismatch { local: usize, remote: usize },
    #[error("negative {side} block id {id}")]
    NegativeBlockId { side: Side, id: i64 },
    #[error("{side} block id {id} out of range ({owner} has {num_blocks} blocks)", owner = .side.owner())]
    BlockIdOutOfRange { side: Side, id: i64, num_blocks: u64 },
    #[error(
        "segment {segment} block {block} at {addr:#x}+{len} is outside the registered regions"
    )]
    BlockOutsideRegions { segment: usize, block: u64, addr: u64, len: u64 },
    #[error("range {addr:#x}+{len} is outside the peer's registered regions")]
    RemoteRangeOutsideRegions { addr: u64, len: u64 },
    #[error(
        "the layout's {segments} segments cross the boundaries of its {regions} regions too often \
         to check (over {max} per segment and region)",
        max = MAX_GAP_CHECKS_PER_ENTRY
    )]
    LayoutTooFragmented { segments: usize, regions: usize },
}

/// What [`BlockLayout::validate_within`] may spend per segment and region: one check per
/// segment that sits in a single region, one more per region boundary inside a segment. Real
/// layouts (disjoint segments, or interleaved K/V or cross-layer segments over one region)
/// stay far below; only segments piled over many boundaries reach it.
pub const MAX_GAP_CHECKS_PER_ENTRY: u32 = 64;

impl BlockLayout {
    /// Checks that the layout describes non-overlapping blocks whose every address fits in a
    /// `u64`; once this holds, address arithmetic on in-range ids cannot overflow.
    pub fn validate(&self) -> Result<(), LayoutError> {
        if self.block_len == 0 {
            return Err(LayoutError::ZeroBlockLen);
        }
        if self.block_len > self.block_stride {
            return Err(LayoutError::BlockLenExceedsStride {
                block_len: self.block_len,
                block_stride: self.block_stride,
            });
        }
        let Some(span) = self.span() else {
            return Ok(());
        };
        for (segment, &base) in self.segment_bases.iter().enumerate() {
            if u128::from(base) + span > u128::from(u64::MAX) {
                return Err(LayoutError::Overflow {
                    segment,
                    base,
                    num_blocks: self.num_blocks,
                    block_stride: self.block_stride,
                });
            }
        }
        Ok(())
    }

    /// Checks that every block of every segment lies inside one of `regions` (and no u64 overflow).
    ///
    /// A segment may span several registrations as long as no single block straddles two of
    /// them, so blocks are what is checked, but never one by one: the addresses where no
    /// block can start (the gaps between what the regions cover, less a block's length) are
    /// at most one more than the regions, and each segment's blocks are an arithmetic
    /// progression, so a gap holds one of them iff the first block at or after the gap's
    /// start lies before its end. The work is bounded by the layout's and the regions' sizes,
    /// never by the block count or the addresses in them (both come from peers):
    /// [`PlanError::LayoutTooFragmented`] past [`MAX_GAP_CHECKS_PER_ENTRY`] checks per
    /// segment and region.
    pub fn validate_within(&self, regions: &[RegionBounds]) -> Result<(), PlanError> {
        self.validate()?;
        let Some(span) = self.span() else {
            return Ok(());
        };
        let gaps = RegionIndex::new(regions).block_start_gaps(self.block_len);
        let entries = self.segment_bases.len() as u128 + regions.len() as u128;
        let limit = entries
            .saturating_mul(MAX_GAP_CHECKS_PER_ENTRY.into())
            .max(MAX_GAP_CHECKS_PER_ENTRY.into());
        let mut checks = 0u128;
        let stride = u128::from(self.block_stride);
        for (segment, &base) in self.segment_bases.iter().enumerate() {
            let first = u128::from(base);
            // `validate` put every block's end inside u64.
            let last = first + span - u128::from(self.block_len);
            let from = gaps.partition_point(|&(_, end)| end <= first);
            for &(start, end) in gaps[from..].iter().take_while(|&&(start, _)| start <= last) {
                checks += 1;
                if checks > limit {
                    return Err(PlanError::LayoutTooFragmented {
                        segments: self.segment_bases.len(),
                        regions: regions.len(),
                    });
                }
                let block = start.saturating_sub(first).div_ceil(stride);
                let addr = first + block * stride;
                if addr < end && addr <= last {
                    return Err(PlanError::BlockOutsideRegions {
                        segment,
                        block: block as u64,
                        addr: addr as u64,
                        len: self.block_len,
                    });
                }
            }
        }
        Ok(())
    }

    /// Bytes from a segment's base to the end of its last block; `None` without blocks.
    fn span(&self) -> Option<u128> {
        let last = self.num_blocks.checked_sub(1)?;
        Some(u128::from(last) * u128::from(self.block_stride) + u128::from(self.block_len))
    }

    /// Byte offset of block `id` from its segment's base, once `id` is known to exist.
    fn block_offset(&self, id: i64, side: Side) -> Result<u64, PlanError> {
        let block = u64::try_from(id).map_err(|_| PlanError::NegativeBlockId { side, id })?;
        if block >= self.num_blocks {
            return Err(PlanError::BlockIdOutOfRange { side, id, num_blocks: self.num_blocks });
        }
        Ok(block * self.block_stride)
    }
}

/// Plans the reads that copy remote blocks `remote_ids[i]` into local blocks `local_ids[i]`.
///
/// See the [module docs](self) for how differing block sizes pair ids up, and for what
/// `slice` (a sub-range of every block; `None` for whole blocks) changes.
///
/// Every segment shares the same block pattern, so the id lists are turned into merged runs
/// of segment-relative offsets once, and each segment then only adds its bases: the cost per
/// segment is a copy of the runs, not a pass over the ids.
///
/// A read may continue from one segment into the next when the two touch in memory on both
/// sides. Such a read needs a single region covering both segments; a peer that registers
/// touching segments separately gets a plan that [`check_remote_bounds`] rejects.
pub fn plan_reads(
    local: &BlockLayout,
    remote: &BlockLayout,
    local_ids: &[i64],
    remote_ids: &[i64],
    slice: Option<BlockSlice>,
) -> Result<Vec<Descriptor>, PlanError> {
    plan_segment_reads(local, remote, local_ids, remote_ids, 0..local.segment_bases.len(), slice)
}

/// [`plan_reads`] restricted to the segments `segments` (e.g. one layer's KV cache, for a
/// reader that starts computing a layer as soon as its blocks arrived).
pub fn plan_segment_reads(
    local: &BlockLayout,
    remote: &BlockLayout,
    local_ids: &[i64],
    remote_ids: &[i64],
    segments: std::ops::Range<usize>,
    slice: Option<BlockSlice>,
) -> Result<Vec<Descriptor>, PlanError> {
    if local.segment_bases.len() != remote.segment_bases.len() {
        return Err(PlanError::SegmentCountMismatch {
            local: local.segment_bases.len(),
            remote: remote.segment_bases.len(),
        });
    }
    local.validate().map_err(|reason| PlanError::SideLayout { side: Side::Local, reason })?;
    remote.validate().map_err(|reason| PlanError::SideLayout { side: Side::Remote, reason })?;

    // Checked before any id is looked at. A slice of both whole blocks reads what no slice
    // reads, so it is planned (and merged) the same way.
    let partial = match slice {
        Some(slice) => {
            slice.validate(local, remote)?;
            Some(slice).filter(|s| !s.is_whole(local, remote))
        }
        None => None,
    };
    let runs = match partial {
        None => whole_block_runs(local, remote, local_ids, remote_ids)?,
        Some(slice) => sliced_runs(local, remote, local_ids, remote_ids, slice)?,
    };

    if segments.start >= segments.end || segments.end > local.segment_bases.len() {
        return Err(PlanError::SegmentRange {
            start: segments.start,
            end: segments.end,
            segments: local.segment_bases.len(),
        });
    }
    let mut plan = Vec::with_capacity(runs.len() * segments.len());
    let bases = local.segment_bases[segments.clone()].iter().zip(&remote.segment_bases[segments]);
    for (&local_base, &remote_base) in bases {
        let mut segment = runs.iter().map(|run| Descriptor {
            local_addr: local_base + run.local_addr,
            remote_addr: remote_base + run.remote_addr,
            len: run.len,
        });
        // Runs are already maximal within a segment, so only a segment's first run can
        // continue the previous segment's last one (when the segments are adjacent).
        // A partial slice is never merged, not even across touching segments.
        if let Some(first) = segment.next() {
            if partial.is_none() {
                push_merged(&mut plan, first);
            } else {
                plan.push(first);
            }
        }
        plan.extend(segment);
    }
    Ok(plan)
}

/// Whole blocks, paired by the block-size ratio: segment-relative reads, merged wherever
/// adjacent ones continue each other on both sides.
fn whole_block_runs(
    local: &BlockLayout,
    remote: &BlockLayout,
    local_ids: &[i64],
    remote_ids: &[i64],
) -> Result<Vec<Descriptor>, PlanError> {
    let unit = local.block_len.min(remote.block_len);
    if local.block_len % unit != 0 || remote.block_len % unit != 0 {
        return Err(PlanError::UnsupportedBlockRatio {
            local: local.block_len,
            remote: remote.block_len,
        });
    }
    // Units per block on each side; at least one of the two is 1.
    let (local_k, remote_k) = (local.block_len / unit, remote.block_len / unit);
    let local_units = local_ids.len() as u128 * u128::from(local_k);
    if local_units != remote_ids.len() as u128 * u128::from(remote_k) {
        return Err(PlanError::IdCountMismatch {
            local: local_ids.len(),
            remote: remote_ids.len(),
            local_block_len: local.block_len,
            remote_block_len: remote.block_len,
        });
    }
    // Equals the longer list's length, so it fits in usize; and whenever there are units,
    // each side's units per block are at most that length, so they fit too.
    let units = local_ids.len().max(remote_ids.len());
    let local_k = usize::try_from(local_k).unwrap_or(usize::MAX);
    let remote_k = usize::try_from(remote_k).unwrap_or(usize::MAX);

    let mut runs = Vec::with_capacity(units);
    for u in 0..units {
        let (local_idx, local_sub) = split_unit(u, local_k, unit);
        let (remote_idx, remote_sub) = split_unit(u, remote_k, unit);
        push_merged(
            &mut runs,
            Descriptor {
                local_addr: local.block_offset(local_ids[local_idx], Side::Local)? + local_sub,
                remote_addr: remote.block_offset(remote_ids[remote_idx], Side::Remote)?
                    + remote_sub,
                len: unit,
            },
        );
    }
    Ok(runs)
}

/// `slice` of every block, ids paired one to one: one segment-relative read per pair, never
/// merged (a partial slice of the next block never continues this block's slice anyway,
/// unless `block_stride == len` on both sides, which makes the slice whole).
fn sliced_runs(
    local: &BlockLayout,
    remote: &BlockLayout,
    local_ids: &[i64],
    remote_ids: &[i64],
    slice: BlockSlice,
) -> Result<Vec<Descriptor>, PlanError> {
    if local_ids.len() != remote_ids.len() {
        return Err(PlanError::SliceIdCountMismatch {
            local: local_ids.len(),
            remote: remote_ids.len(),
        });
    }
    // `validate` put the slice inside a block on each side, and the layouts' validation put
    // every in-range block's end inside u64, so these sums cannot overflow.
    local_ids
        .iter()
        .zip(remote_ids)
        .map(|(&l, &r)| {
            Ok(Descriptor {
                local_addr: local.block_offset(l, Side::Local)? + slice.local_offset,
                remote_addr: remote.block_offset(r, Side::Remote)? + slice.remote_offset,
                len: slice.len,
            })
        })
        .collect()
}

/// Splits unit `u` into (index into the id list, byte offset within that id's block) for a
/// side whose blocks hold `k` units of `unit` bytes.
fn split_unit(u: usize, k: usize, unit: u64) -> (usize, u64) {
    (u / k, (u % k) as u64 * unit)
}

/// Appends `next`, extending the last descriptor instead when both of its ranges continue
/// exactly where the last one's ended.
fn push_merged(plan: &mut Vec<Descriptor>, next: Descriptor) {
    if let Some(last) = plan.last_mut() {
        if last.local_addr + last.len == next.local_addr
            && last.remote_addr + last.len == next.remote_addr
        {
            last.len += next.len;
            return;
        }
    }
    plan.push(next);
}
