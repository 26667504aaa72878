//! A peer's layout is checked against its regions in time bounded by how many segments and
//! regions it sends, never by the block counts or addresses in them, and the fast check
//! accepts exactly the layouts a block-by-block check accepts.

use std::sync::mpsc;
use std::time::Duration;

use kvduplex::descriptors::*;
use proptest::prelude::*;

/// `validate_within` on its own thread: the verdict, or `None` when it took over `limit`
/// (a check that hangs fails the test instead of hanging it).
fn validate_within_bounded(
    layout: BlockLayout,
    regions: Vec<RegionBounds>,
    limit: Duration,
) -> Option<Result<(), PlanError>> {
    let (sender, verdict) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(layout.validate_within(&regions));
    });
    verdict.recv_timeout(limit).ok()
}

#[test]
fn two_adjacent_huge_regions_and_a_segment_of_one_byte_blocks_are_checked_at_once() {
    // The reproduction: 2^41 one-byte blocks over two adjacent 2^40-byte regions.
    let regions = vec![
        RegionBounds { addr: 1 << 40, len: 1 << 40 },
        RegionBounds { addr: 2 << 40, len: 1 << 40 },
    ];
    let layout = BlockLayout {
        segment_bases: vec![1 << 40],
        block_stride: 1,
        block_len: 1,
        num_blocks: 2 << 40,
    };
    let verdict = validate_within_bounded(layout.clone(), regions.clone(), Duration::from_secs(5));
    assert_eq!(verdict, Some(Ok(())), "every block lies in one of the two regions");
    // One byte past the second region: the very last block is outside.
    let over = BlockLayout { num_blocks: (2 << 40) + 1, ..layout };
    let verdict = validate_within_bounded(over, regions, Duration::from_secs(5));
    assert_eq!(
        verdict,
        Some(Err(PlanError::BlockOutsideRegions {
            segment: 0,
            block: 2 << 40,
            addr: 3 << 40,
            len: 1
        }))
    );
}

#[test]
fn segments_piled_over_many_region_boundaries_are_refused_not_walked() {
    // 2,000 one-block-apart regions and 2,000 segments spanning all of them: four million
    // boundary checks, over the per-entry budget.
    let regions: Vec<RegionBounds> =
        (0..2000u64).map(|i| RegionBounds { addr: 0x1000 + i * 64, len: 64 }).collect();
    let layout = BlockLayout {
        segment_bases: vec![0x1000; 2000],
        block_stride: 64,
        block_len: 64,
        num_blocks: 2000,
    };
    let verdict = validate_within_bounded(layout.clone(), regions.clone(), Duration::from_secs(5));
    assert_eq!(
        verdict,
        Some(Err(PlanError::LayoutTooFragmented { segments: 2000, regions: 2000 }))
    );
    // The same regions with a few segments are fine: the budget grows with the input.
    let few = BlockLayout { segment_bases: vec![0x1000; 8], ..layout };
    assert_eq!(validate_within_bounded(few, regions, Duration::from_secs(5)), Some(Ok(())));
}

/// The definition: every block of every segment inside a single region.
fn block_by_block(layout: &BlockLayout, regions: &[RegionBounds]) -> Option<(usize, u64)> {
    for (segment, &base) in layout.segment_bases.iter().enumerate() {
        for block in 0..layout.num_blocks {
            let addr = base + block * layout.block_stride;
            if !regions.iter().any(|r| r.contains(addr, layout.block_len)) {
                return Some((segment, block));
            }
        }
    }
    None
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn the_fast_check_agrees_with_the_block_by_block_one(
        bases in prop::collection::vec(0u64..600, 1..4),
        block_len in 1u64..24,
        padding in 0u64..16,
        num_blocks in 0u64..20,
        regions in prop::collection::vec((0u64..700, 0u64..200), 0..6),
    ) {
        let layout = BlockLayout { segment_bases: bases, block_stride: block_len + padding, block_len, num_blocks };
        let regions: Vec<RegionBounds> = regions.into_iter().map(|(addr, len)| RegionBounds { addr, len }).collect();
        let expected = block_by_block(&layout, &regions);
        match layout.validate_within(&regions) {
            Ok(()) => prop_assert_eq!(expected, None),
            Err(PlanError::BlockOutsideRegions { segment, block, addr, len }) => {
                prop_assert_eq!(expected, Some((segment, block)));
                prop_assert_eq!(addr, layout.segment_bases[segment] + block * layout.block_stride);
                prop_assert_eq!(len, block_len);
            }
            Err(other) => prop_assert!(false, "unexpected {other}"),
        }
    }

    #[test]
    fn regions_at_the_top_of_the_address_space_are_checked_without_overflow(
        block_len in 1u64..64,
        num_blocks in 1u64..8,
        tail in 0u64..512,
    ) {
        let top = u64::MAX - tail;
        let layout = BlockLayout { segment_bases: vec![top - 1024], block_stride: block_len, block_len, num_blocks };
        let regions = [RegionBounds { addr: top - 1024, len: 1024 + tail }];
        let expected = block_by_block(&layout, &regions).is_none();
        prop_assert_eq!(layout.validate_within(&regions).is_ok(), expected);
    }
}
