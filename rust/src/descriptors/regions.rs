//! Registered memory regions and the index that finds the region holding a range: the check
//! every planned read passes before it is posted with a peer's keys.

use super::{Descriptor, PlanError};

/// A registered memory region `[addr, addr+len)`; a read must stay inside a single region
/// because each region has its own remote key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionBounds {
    pub addr: u64,
    pub len: u64,
}

impl RegionBounds {
    /// Whether `[addr, addr+len)` lies entirely inside this region (overflow counts as outside).
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        let (Some(end), Some(region_end)) =
            (addr.checked_add(len), self.addr.checked_add(self.len))
        else {
            return false;
        };
        addr >= self.addr && end <= region_end
    }
}

/// The region of `remote` that holds each remote range of `plan`, by the regions' order in
/// [`RegionIndex::new`]; fails unless every range lies entirely inside one region.
///
/// This is the last line of defence before posting reads with a peer's keys, so it checks the
/// plan actually built rather than trusting the layout it was built from.
pub fn check_remote_bounds(
    plan: &[Descriptor],
    remote: &RegionIndex,
) -> Result<Vec<usize>, PlanError> {
    // Plans are segment-major, so consecutive ranges nearly always hit the same region;
    // trying the previous hit first skips most binary searches.
    let mut hint = None;
    plan.iter()
        .map(|d| {
            let len = u128::from(d.len);
            let outside =
                || PlanError::RemoteRangeOutsideRegions { addr: d.remote_addr, len: d.len };
            let i = match hint.filter(|&i| remote.covers(i, d.remote_addr, len)) {
                Some(i) => i,
                None => remote.find(d.remote_addr, len).ok_or_else(outside)?,
            };
            hint = Some(i);
            Ok(remote.reacher[i])
        })
        .collect()
}

/// Answers "which region holds `[addr, addr+len)` whole?" in `O(log regions)`, for regions
/// that may overlap and arrive unsorted. Built once per peer.
///
/// Regions are sorted by start, and `reach[i]` is the furthest end among the first `i+1` of
/// them, reached by region `reacher[i]`: a range starting at `addr` fits in some region iff,
/// among the regions starting at or before `addr`, the furthest-reaching one ends at or after
/// the range does, and then that region holds it. Ends are `u128` so that regions and ranges
/// reaching the top of the address space need no special cases.
pub struct RegionIndex {
    starts: Vec<u64>,
    reach: Vec<u128>,
    /// Position in the regions given to [`RegionIndex::new`].
    reacher: Vec<usize>,
}

impl RegionIndex {
    pub fn new(regions: &[RegionBounds]) -> Self {
        let mut sorted: Vec<(u64, u128, usize)> = regions
            .iter()
            .enumerate()
            .map(|(i, r)| (r.addr, u128::from(r.addr) + u128::from(r.len), i))
            .collect();
        sorted.sort_unstable();
        let mut reach = Vec::with_capacity(sorted.len());
        let mut reacher = Vec::with_capacity(sorted.len());
        for (k, &(_, end, i)) in sorted.iter().enumerate() {
            if k == 0 || end > reach[k - 1] {
                reach.push(end);
                reacher.push(i);
            } else {
                reach.push(reach[k - 1]);
                reacher.push(reacher[k - 1]);
            }
        }
        RegionIndex {
            starts: sorted.into_iter().map(|(start, _, _)| start).collect(),
            reach,
            reacher,
        }
    }

    /// Where no `len`-byte range can start, as sorted, disjoint `[start, end)` intervals
    /// covering the rest of the address space: at most one per region, plus one.
    pub(super) fn block_start_gaps(&self, len: u64) -> Vec<(u128, u128)> {
        let top = 1u128 << 64;
        let mut gaps = Vec::new();
        // Start of the stretch not known to be a valid start yet.
        let mut open = 0u128;
        for (k, &start) in self.starts.iter().enumerate() {
            // Between this start and the next, the furthest-reaching region ends at reach[k].
            let next = self.starts.get(k + 1).map_or(top, |&s| u128::from(s));
            let fits_until = (self.reach[k] + 1).saturating_sub(u128::from(len)).min(next);
            let start = u128::from(start);
            if start < fits_until {
                if open < start {
                    gaps.push((open, start));
                }
                open = fits_until;
            }
        }
        if open < top {
            gaps.push((open, top));
        }
        gaps
    }

    /// The index that witnesses the range fitting, usable later as a hint for [`Self::covers`].
    fn find(&self, addr: u64, len: u128) -> Option<usize> {
        let i = self.starts.partition_point(|&start| start <= addr).checked_sub(1)?;
        self.covers(i, addr, len).then_some(i)
    }

    /// Valid for any `i` whose region starts at or before `addr`, not just the last such one,
    /// which is what makes a stale hint safe to try.
    fn covers(&self, i: usize, addr: u64, len: u128) -> bool {
        self.starts[i] <= addr && self.reach[i] >= u128::from(addr) + len
    }
}
