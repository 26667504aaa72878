//! Layout validation and read planning with raw numbers (what a decoded metadata frame would
//! carry, reached without msgpack): `validate_within` must answer in time bounded by the
//! input's size whatever the block counts and addresses, and agree with a block-by-block check
//! where that check is small enough to run.
#![no_main]

use kvduplex::descriptors::{check_remote_bounds, plan_reads, BlockLayout, PlanError, RegionBounds, RegionIndex};
use libfuzzer_sys::fuzz_target;

fn words(data: &[u8]) -> impl Iterator<Item = u64> + '_ {
    data.chunks(8).map(|c| {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        u64::from_le_bytes(w)
    })
}

/// Small numbers are what finds bugs; large ones what hangs: take both.
fn shape(w: u64) -> u64 {
    if w & 1 == 0 { (w >> 1) % 64 } else { w >> 1 }
}

fuzz_target!(|data: &[u8]| {
    let mut w = words(data);
    let (Some(counts), Some(stride), Some(len), Some(blocks)) = (w.next(), w.next(), w.next(), w.next()) else { return };
    let segments = (counts % 8) as usize;
    let num_regions = ((counts >> 8) % 8) as usize;
    let layout = BlockLayout {
        segment_bases: w.by_ref().take(segments).map(shape).collect(),
        block_stride: shape(stride),
        block_len: shape(len),
        num_blocks: shape(blocks),
    };
    let regions: Vec<RegionBounds> = (0..num_regions).filter_map(|_| Some(RegionBounds { addr: shape(w.next()?), len: shape(w.next()?) })).collect();
    let verdict = layout.validate_within(&regions);
    let small = layout.num_blocks <= 64 && layout.validate().is_ok();
    if small {
        let mut first_bad = None;
        'outer: for (s, &base) in layout.segment_bases.iter().enumerate() {
            for b in 0..layout.num_blocks {
                let addr = base + b * layout.block_stride;
                if !regions.iter().any(|r| r.contains(addr, layout.block_len)) {
                    first_bad = Some((s, b));
                    break 'outer;
                }
            }
        }
        match (&verdict, first_bad) {
            (Ok(()), None) => {}
            (Err(PlanError::BlockOutsideRegions { segment, block, .. }), Some(bad)) => assert_eq!((*segment, *block), bad),
            (Err(PlanError::LayoutTooFragmented { .. }), _) => {}
            (v, bad) => panic!("validate_within said {v:?}, block by block {bad:?}"),
        }
    }
    // A valid layout plans reads for any ids, and every planned range is checked.
    if verdict.is_ok() && layout.num_blocks > 0 {
        let ids: Vec<i64> = w.take(16).map(|x| (x % (layout.num_blocks + 2)) as i64 - 1).collect();
        if let Ok(plan) = plan_reads(&layout, &layout, &ids, &ids, None) {
            let _ = check_remote_bounds(&plan, &RegionIndex::new(&regions));
        }
    }
});
