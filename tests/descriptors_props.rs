//! The coalesced plan must move exactly the bytes the obvious one-read-per-block plan moves,
//! in the same order, while never leaving two mergeable reads side by side.

use kvduplex::descriptors::*;
use proptest::prelude::*;

/// [`check_remote_bounds`] over an index of `regions`; checks that every region it names
/// really holds its range.
fn holding_regions(plan: &[Descriptor], regions: &[RegionBounds]) -> Result<Vec<usize>, PlanError> {
    let found = check_remote_bounds(plan, &RegionIndex::new(regions))?;
    assert_eq!(found.len(), plan.len());
    for (d, &i) in plan.iter().zip(&found) {
        let r = regions[i];
        assert!(
            r.addr <= d.remote_addr
                && u128::from(d.remote_addr) + u128::from(d.len)
                    <= u128::from(r.addr) + u128::from(r.len),
            "{d:?} is not in region {i} {r:?}"
        );
    }
    Ok(found)
}

/// One read per block (per sub-block when block sizes differ) per segment, written straight
/// from the definition of the id pairing so it shares no logic with the planner.
fn naive_plan(
    local: &BlockLayout,
    remote: &BlockLayout,
    local_ids: &[i64],
    remote_ids: &[i64],
) -> Vec<Descriptor> {
    let (ll, rl) = (local.block_len, remote.block_len);
    let mut plan = Vec::new();
    for (&lb, &rb) in local.segment_bases.iter().zip(&remote.segment_bases) {
        let local_block = |id: i64| lb + id as u64 * local.block_stride;
        let remote_block = |id: i64| rb + id as u64 * remote.block_stride;
        if rl >= ll {
            let k = (rl / ll) as usize;
            for (i, &lid) in local_ids.iter().enumerate() {
                plan.push(Descriptor {
                    local_addr: local_block(lid),
                    remote_addr: remote_block(remote_ids[i / k]) + (i % k) as u64 * ll,
                    len: ll,
                });
            }
        } else {
            let k = (ll / rl) as usize;
            for (i, &rid) in remote_ids.iter().enumerate() {
                plan.push(Descriptor {
                    local_addr: local_block(local_ids[i / k]) + (i % k) as u64 * rl,
                    remote_addr: remote_block(rid),
                    len: rl,
                });
            }
        }
    }
    plan
}

/// The (local byte, remote byte) pairs a plan copies, in order.
fn byte_mapping(plan: &[Descriptor]) -> Vec<(u64, u64)> {
    plan.iter()
        .flat_map(|d| (0..d.len).map(move |o| (d.local_addr + o, d.remote_addr + o)))
        .collect()
}

fn mergeable(a: &Descriptor, b: &Descriptor) -> bool {
    a.local_addr + a.len == b.local_addr && a.remote_addr + a.len == b.remote_addr
}

/// The peer's registrations: one region per segment, except that touching segments share
/// one, because the planner merges reads across them and a read must fit in one region.
fn segment_regions(layout: &BlockLayout) -> Vec<RegionBounds> {
    let len = (layout.num_blocks - 1) * layout.block_stride + layout.block_len;
    let mut regions: Vec<RegionBounds> = Vec::new();
    for &addr in &layout.segment_bases {
        match regions.last_mut() {
            Some(last) if last.addr + last.len == addr => last.len += len,
            _ => regions.push(RegionBounds { addr, len }),
        }
    }
    regions
}

/// A layout of `segments` segments whose gaps are sometimes zero, so that merging across a
/// segment boundary gets exercised.
fn layout(segments: usize, block_len: u64) -> impl Strategy<Value = BlockLayout> {
    (
        prop_oneof![Just(0u64), 0..block_len + 3],
        1u64..24,
        0u64..1 << 20,
        prop::collection::vec(prop_oneof![Just(0u64), 1u64..64], segments),
    )
        .prop_map(move |(padding, num_blocks, first, gaps)| {
            let block_stride = block_len + padding;
            let mut base = first;
            let segment_bases = gaps
                .iter()
                .map(|gap| {
                    let this = base;
                    base += num_blocks * block_stride + gap;
                    this
                })
                .collect();
            BlockLayout { segment_bases, block_stride, block_len, num_blocks }
        })
}

/// Ids that mostly continue an ascending run and sometimes jump anywhere, so lists contain
/// vLLM-style runs, scattered ids and duplicates.
fn ids(len: usize, num_blocks: u64) -> impl Strategy<Value = Vec<i64>> {
    prop::collection::vec((prop::bool::weighted(0.7), 0..num_blocks), len).prop_map(move |steps| {
        let mut prev: Option<u64> = None;
        steps
            .into_iter()
            .map(|(continue_run, jump)| {
                let id = match prev {
                    Some(p) if continue_run => (p + 1) % num_blocks,
                    _ => jump,
                };
                prev = Some(id);
                id as i64
            })
            .collect()
    })
}

/// Two layouts with block lengths `unit*local_k` and `unit*remote_k`, and id lists whose
/// lengths match that ratio.
fn case(
    local_k: u64,
    remote_k: u64,
) -> impl Strategy<Value = (BlockLayout, BlockLayout, Vec<i64>, Vec<i64>)> {
    (1usize..8, 1u64..9, 0usize..40).prop_flat_map(move |(segments, unit, units)| {
        // Round the unit count to a multiple of the larger block's unit count.
        let units = units / (local_k * remote_k) as usize * (local_k * remote_k) as usize;
        (layout(segments, unit * local_k), layout(segments, unit * remote_k)).prop_flat_map(
            move |(local, remote)| {
                let local_ids = ids(units / local_k as usize, local.num_blocks);
                let remote_ids = ids(units / remote_k as usize, remote.num_blocks);
                (Just(local), Just(remote), local_ids, remote_ids)
            },
        )
    })
}

fn check_against_naive(
    local: &BlockLayout,
    remote: &BlockLayout,
    local_ids: &[i64],
    remote_ids: &[i64],
) -> Result<(), TestCaseError> {
    let plan = plan_reads(local, remote, local_ids, remote_ids, None).unwrap();
    let naive = naive_plan(local, remote, local_ids, remote_ids);
    prop_assert_eq!(byte_mapping(&plan), byte_mapping(&naive));
    prop_assert!(plan.iter().all(|d| d.len > 0));
    for pair in plan.windows(2) {
        prop_assert!(!mergeable(&pair[0], &pair[1]), "unmerged pair {:?}", pair);
    }
    let regions = segment_regions(remote);
    prop_assert_eq!(remote.validate_within(&regions), Ok(()));
    prop_assert!(holding_regions(&plan, &regions).is_ok());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn same_block_size_matches_naive_plan((local, remote, lids, rids) in case(1, 1)) {
        check_against_naive(&local, &remote, &lids, &rids)?;
    }

    #[test]
    fn remote_blocks_twice_as_large_match_naive_plan((local, remote, lids, rids) in case(1, 2)) {
        check_against_naive(&local, &remote, &lids, &rids)?;
    }

    #[test]
    fn remote_blocks_four_times_as_large_match_naive_plan((local, remote, lids, rids) in case(1, 4)) {
        check_against_naive(&local, &remote, &lids, &rids)?;
    }

    #[test]
    fn local_blocks_twice_as_large_match_naive_plan((local, remote, lids, rids) in case(2, 1)) {
        check_against_naive(&local, &remote, &lids, &rids)?;
    }

    #[test]
    fn local_blocks_four_times_as_large_match_naive_plan((local, remote, lids, rids) in case(4, 1)) {
        check_against_naive(&local, &remote, &lids, &rids)?;
    }

    /// One segment at a time (a layer-wise reader) moves exactly that segment's share of the
    /// whole plan's bytes, and the segments' plans together move all of them.
    #[test]
    fn segment_plans_partition_the_whole_plan((local, remote, lids, rids) in case(1, 2)) {
        let whole = byte_mapping(&plan_reads(&local, &remote, &lids, &rids, None).unwrap());
        let mut joined = Vec::new();
        for segment in 0..local.segment_bases.len() {
            let plan = plan_segment_reads(&local, &remote, &lids, &rids, segment..segment + 1, None).unwrap();
            let naive = naive_plan(
                &BlockLayout { segment_bases: vec![local.segment_bases[segment]], ..local.clone() },
                &BlockLayout { segment_bases: vec![remote.segment_bases[segment]], ..remote.clone() },
                &lids,
                &rids,
            );
            prop_assert_eq!(byte_mapping(&plan), byte_mapping(&naive));
            joined.extend(byte_mapping(&plan));
        }
        prop_assert_eq!(joined, whole);
        let n = local.segment_bases.len();
        for bad in [n..n + 1, 0..0, 1..n + 1] {
            prop_assert!(plan_segment_reads(&local, &remote, &lids, &rids, bad, None).is_err());
        }
    }

    /// Any id outside `0..num_blocks` on either side must fail the whole plan.
    #[test]
    fn any_bad_id_is_rejected(
        (local, remote) in (1usize..4).prop_flat_map(|s| (layout(s, 8), layout(s, 8))),
        raw in prop::collection::vec((-3i64..30, -3i64..30), 0..20),
    ) {
        let (lids, rids): (Vec<i64>, Vec<i64>) = raw.into_iter().unzip();
        let valid = |ids: &[i64], n: u64| ids.iter().all(|&id| (0..n as i64).contains(&id));
        let all_valid = valid(&lids, local.num_blocks) && valid(&rids, remote.num_blocks);
        prop_assert_eq!(plan_reads(&local, &remote, &lids, &rids, None).is_ok(), all_valid);
    }
}

fn contiguous(segment_bases: Vec<u64>, block_len: u64, num_blocks: u64) -> BlockLayout {
    BlockLayout { segment_bases, block_stride: block_len, block_len, num_blocks }
}

fn err_text(result: Result<Vec<Descriptor>, PlanError>) -> String {
    result.unwrap_err().to_string()
}

#[test]
fn negative_ids_are_rejected_on_both_sides() {
    let l = contiguous(vec![0], 64, 16);
    let r = contiguous(vec![1 << 20], 64, 16);
    assert_eq!(err_text(plan_reads(&l, &r, &[1, -3], &[1, 2], None)), "negative local block id -3");
    assert_eq!(
        err_text(plan_reads(&l, &r, &[1, 2], &[-7, 2], None)),
        "negative remote block id -7"
    );
    assert_eq!(
        plan_reads(&l, &r, &[i64::MIN], &[0], None),
        Err(PlanError::NegativeBlockId { side: Side::Local, id: i64::MIN })
    );
}

#[test]
fn out_of_range_ids_are_rejected_on_both_sides() {
    let l = contiguous(vec![0], 64, 1024);
    let r = contiguous(vec![1 << 30], 64, 4096);
    assert_eq!(
        err_text(plan_reads(&l, &r, &[0], &[9000], None)),
        "remote block id 9000 out of range (peer has 4096 blocks)"
    );
    assert_eq!(
        err_text(plan_reads(&l, &r, &[0], &[4096], None)),
        "remote block id 4096 out of range (peer has 4096 blocks)"
    );
    assert_eq!(
        err_text(plan_reads(&l, &r, &[1024], &[0], None)),
        "local block id 1024 out of range (this engine has 1024 blocks)"
    );
    assert_eq!(
        err_text(plan_reads(&l, &r, &[i64::MAX], &[0], None)),
        format!("local block id {} out of range (this engine has 1024 blocks)", i64::MAX)
    );
}

#[test]
fn segment_count_mismatch_is_rejected() {
    let l = contiguous((0..32).map(|s| s << 20).collect(), 64, 16);
    let r = contiguous((0..16).map(|s| s << 20).collect(), 64, 16);
    assert_eq!(
        err_text(plan_reads(&l, &r, &[], &[], None)),
        "segment count differs: local 32, remote 16"
    );
}

#[test]
fn id_list_length_mismatch_is_rejected() {
    let l = contiguous(vec![0], 64, 16);
    let r = contiguous(vec![1 << 20], 64, 16);
    assert_eq!(
        err_text(plan_reads(&l, &r, &[1, 2, 3], &[1, 2], None)),
        "block id lists differ in length: 3 local ids, 2 remote ids (block_len local 64, remote 64)"
    );
}

#[test]
fn id_list_length_must_follow_block_ratio() {
    let l = contiguous(vec![0], 64, 16);
    let r = contiguous(vec![1 << 20], 128, 16);
    // Two remote blocks of twice the size need exactly four local ids.
    assert_eq!(
        err_text(plan_reads(&l, &r, &[1, 2, 3], &[1, 2], None)),
        "block id lists differ in length: 3 local ids, 2 remote ids (block_len local 64, remote 128)"
    );
    assert!(plan_reads(&l, &r, &[1, 2], &[1, 2], None).is_err());
    assert!(plan_reads(&l, &r, &[1, 2, 3, 4], &[1, 2], None).is_ok());
    // And the mirror image.
    assert!(plan_reads(&r, &l, &[1, 2], &[1, 2], None).is_err());
    assert!(plan_reads(&r, &l, &[1, 2], &[1, 2, 3, 4], None).is_ok());
}

#[test]
fn non_integer_block_ratio_is_rejected() {
    let l = contiguous(vec![0], 48, 16);
    let r = contiguous(vec![1 << 20], 32, 16);
    assert_eq!(
        err_text(plan_reads(&l, &r, &[1], &[1], None)),
        "block sizes are not whole multiples of each other: local block_len 48, remote block_len 32"
    );
}

#[test]
fn malformed_layouts_are_rejected_naming_the_side() {
    let good = contiguous(vec![0], 64, 16);
    let mut overlapping = contiguous(vec![1 << 20], 64, 16);
    overlapping.block_stride = 48;
    assert_eq!(
        err_text(plan_reads(&good, &overlapping, &[], &[], None)),
        "remote layout: block_len 64 exceeds block_stride 48, so blocks would overlap"
    );
    let empty_blocks = contiguous(vec![0], 0, 16);
    assert_eq!(
        err_text(plan_reads(&empty_blocks, &good, &[], &[], None)),
        "local layout: block_len is 0"
    );
    let top = contiguous(vec![0, u64::MAX - 1000], 64, 16);
    assert_eq!(
        err_text(plan_reads(&good_with_segments(2), &top, &[], &[], None)),
        format!(
            "remote layout: layout overflows u64: segment 1 at {:#x} holds 16 blocks of stride 64",
            u64::MAX - 1000
        )
    );
}

fn good_with_segments(n: u64) -> BlockLayout {
    contiguous((0..n).map(|s| s << 20).collect(), 64, 16)
}

#[test]
fn layout_ending_at_u64_max_is_accepted() {
    // Ends (exclusive) must stay representable, so the last usable byte is u64::MAX - 1.
    let top = contiguous(vec![u64::MAX - 16 * 64], 64, 16);
    assert_eq!(top.validate(), Ok(()));
    let plan = plan_reads(&good_with_segments(1), &top, &[14, 15], &[14, 15], None).unwrap();
    assert_eq!(plan.len(), 1);
    assert_eq!(plan[0].remote_addr + plan[0].len, u64::MAX);
    let past = contiguous(vec![u64::MAX - 16 * 64 + 1], 64, 16);
    assert!(matches!(past.validate(), Err(LayoutError::Overflow { .. })));
}

#[test]
fn empty_request_gives_empty_plan() {
    let l = good_with_segments(4);
    assert_eq!(plan_reads(&l, &l, &[], &[], None), Ok(vec![]));
}

#[test]
fn vllm_style_runs_become_one_read_per_run_per_segment() {
    let l = contiguous((0..8).map(|s| s << 24).collect(), 4096, 1024);
    let r = contiguous((0..8).map(|s| (s << 24) + (1 << 40)).collect(), 4096, 1024);
    let lids: Vec<i64> = (100..150).chain(300..350).collect();
    let rids: Vec<i64> = (7..57).chain(500..550).collect();
    let plan = plan_reads(&l, &r, &lids, &rids, None).unwrap();
    assert_eq!(plan.len(), 2 * 8);
    assert_eq!(
        plan[0],
        Descriptor { local_addr: 100 * 4096, remote_addr: (1 << 40) + 7 * 4096, len: 50 * 4096 }
    );
    assert_eq!(plan[1].local_addr, 300 * 4096);
    assert_eq!(plan[2].local_addr, (1 << 24) + 100 * 4096);
}

#[test]
fn adjacent_segments_merge_into_one_read() {
    let whole = 1024 * 4096;
    let l = contiguous((0..4).map(|s| s * whole).collect(), 4096, 1024);
    let r = contiguous((0..4).map(|s| (1 << 40) + s * whole).collect(), 4096, 1024);
    let all: Vec<i64> = (0..1024).collect();
    assert_eq!(
        plan_reads(&l, &r, &all, &all, None),
        Ok(vec![Descriptor { local_addr: 0, remote_addr: 1 << 40, len: 4 * whole }])
    );
}

#[test]
fn reads_merged_across_touching_segments_need_one_region_for_both() {
    let l = contiguous(vec![0, 64], 64, 1);
    let r = contiguous(vec![1 << 30, (1 << 30) + 64], 64, 1);
    let plan = plan_reads(&l, &r, &[0], &[0], None).unwrap();
    assert_eq!(plan, vec![Descriptor { local_addr: 0, remote_addr: 1 << 30, len: 128 }]);
    let separate =
        [RegionBounds { addr: 1 << 30, len: 64 }, RegionBounds { addr: (1 << 30) + 64, len: 64 }];
    assert_eq!(r.validate_within(&separate), Ok(()));
    assert!(holding_regions(&plan, &separate).is_err());
    assert_eq!(holding_regions(&plan, &[RegionBounds { addr: 1 << 30, len: 128 }]), Ok(vec![0]));
}

#[test]
fn id_order_is_kept_even_when_sorting_would_merge() {
    let l = good_with_segments(1);
    let r = contiguous(vec![1 << 30], 64, 16);
    let plan = plan_reads(&l, &r, &[3, 2], &[3, 2], None).unwrap();
    assert_eq!(
        plan,
        vec![
            Descriptor { local_addr: 3 * 64, remote_addr: (1 << 30) + 3 * 64, len: 64 },
            Descriptor { local_addr: 2 * 64, remote_addr: (1 << 30) + 2 * 64, len: 64 },
        ]
    );
}

#[test]
fn larger_remote_block_is_split_across_consecutive_local_ids() {
    let l = contiguous(vec![0], 64, 16);
    let r = contiguous(vec![1 << 30], 256, 16);
    // Remote block 2 = local 5, 6 (contiguous, merged), then 9, 10 (merged).
    let plan = plan_reads(&l, &r, &[5, 6, 9, 10], &[2], None).unwrap();
    let rb = (1 << 30) + 2 * 256;
    assert_eq!(
        plan,
        vec![
            Descriptor { local_addr: 5 * 64, remote_addr: rb, len: 128 },
            Descriptor { local_addr: 9 * 64, remote_addr: rb + 128, len: 128 },
        ]
    );
}

#[test]
fn validate_within_accepts_exact_fit_and_rejects_one_byte_overrun() {
    // Padded stride: the last block ends block_len, not block_stride, past its start.
    let layout = BlockLayout {
        segment_bases: vec![0x1000, 0x10_0000],
        block_stride: 96,
        block_len: 64,
        num_blocks: 10,
    };
    let span = 9 * 96 + 64;
    let exact =
        [RegionBounds { addr: 0x10_0000, len: span }, RegionBounds { addr: 0x1000, len: span }];
    assert_eq!(layout.validate_within(&exact), Ok(()));

    let short = [exact[0], RegionBounds { addr: 0x1000, len: span - 1 }];
    assert_eq!(
        layout.validate_within(&short).unwrap_err().to_string(),
        format!("segment 0 block 9 at {:#x}+64 is outside the registered regions", 0x1000 + 9 * 96)
    );
    let late = [exact[0], RegionBounds { addr: 0x1001, len: span }];
    assert_eq!(
        layout.validate_within(&late),
        Err(PlanError::BlockOutsideRegions { segment: 0, block: 0, addr: 0x1000, len: 64 })
    );
    assert!(layout.validate_within(&[]).is_err());
}

#[test]
fn validate_within_allows_a_segment_split_between_regions_at_block_boundaries() {
    let layout = contiguous(vec![0x1000], 64, 10);
    let split = [
        RegionBounds { addr: 0x1000, len: 4 * 64 },
        RegionBounds { addr: 0x1000 + 4 * 64, len: 6 * 64 },
    ];
    assert_eq!(layout.validate_within(&split), Ok(()));
    // A block straddling the two regions is not readable with either key.
    let straddle = [
        RegionBounds { addr: 0x1000, len: 4 * 64 + 1 },
        RegionBounds { addr: 0x1000 + 4 * 64 + 1, len: 6 * 64 - 1 },
    ];
    assert_eq!(
        layout.validate_within(&straddle),
        Err(PlanError::BlockOutsideRegions {
            segment: 0,
            block: 4,
            addr: 0x1000 + 4 * 64,
            len: 64
        })
    );
}

#[test]
fn validate_within_reports_malformed_layouts() {
    let mut layout = contiguous(vec![0], 64, 10);
    layout.block_stride = 32;
    assert_eq!(
        layout.validate_within(&[RegionBounds { addr: 0, len: u64::MAX }]),
        Err(PlanError::Layout(LayoutError::BlockLenExceedsStride {
            block_len: 64,
            block_stride: 32
        }))
    );
}

#[test]
fn check_remote_bounds_accepts_exact_fit() {
    let regions =
        [RegionBounds { addr: 0x2000, len: 0x1000 }, RegionBounds { addr: 0x1000, len: 0x1000 }];
    let plan = [
        Descriptor { local_addr: 0, remote_addr: 0x1000, len: 0x1000 },
        Descriptor { local_addr: 0, remote_addr: 0x2000, len: 0x1000 },
        Descriptor { local_addr: 0, remote_addr: 0x1800, len: 0x800 },
    ];
    assert_eq!(holding_regions(&plan, &regions), Ok(vec![1, 0, 1]));
    assert_eq!(holding_regions(&[], &[]), Ok(vec![]));
}

#[test]
fn check_remote_bounds_rejects_range_straddling_two_regions() {
    let regions =
        [RegionBounds { addr: 0x1000, len: 0x1000 }, RegionBounds { addr: 0x2000, len: 0x1000 }];
    let plan = [
        Descriptor { local_addr: 0, remote_addr: 0x1000, len: 0x100 },
        Descriptor { local_addr: 0, remote_addr: 0x1f00, len: 0x200 },
    ];
    assert_eq!(
        holding_regions(&plan, &regions).unwrap_err().to_string(),
        "range 0x1f00+512 is outside the peer's registered regions"
    );
}

#[test]
fn check_remote_bounds_rejects_range_just_past_the_end() {
    let regions = [RegionBounds { addr: 0x1000, len: 0x1000 }];
    let plan = [Descriptor { local_addr: 0, remote_addr: 0x1f00, len: 0x101 }];
    assert_eq!(
        holding_regions(&plan, &regions),
        Err(PlanError::RemoteRangeOutsideRegions { addr: 0x1f00, len: 0x101 })
    );
    let before = [Descriptor { local_addr: 0, remote_addr: 0xfff, len: 1 }];
    assert!(holding_regions(&before, &regions).is_err());
}

#[test]
fn check_remote_bounds_handles_overlapping_regions_and_the_top_of_memory() {
    // A big region starting first still covers ranges past a small region nested inside it.
    let regions = [
        RegionBounds { addr: 0x1000, len: 0x10000 },
        RegionBounds { addr: 0x2000, len: 0x10 },
        RegionBounds { addr: u64::MAX - 0xff, len: 0x100 },
    ];
    let plan = [
        Descriptor { local_addr: 0, remote_addr: 0x2008, len: 0x100 },
        Descriptor { local_addr: 0, remote_addr: u64::MAX - 0xff, len: 0x100 },
    ];
    // The big region holds the range past the nested one's end.
    assert_eq!(holding_regions(&plan, &regions), Ok(vec![0, 2]));
    let wrap = [Descriptor { local_addr: 0, remote_addr: u64::MAX - 0xff, len: 0x101 }];
    assert!(holding_regions(&wrap, &regions).is_err());
}

// ---- Block slices -------------------------------------------------------------------------

/// One read of `slice` per id pair per segment, from the definition.
fn naive_sliced_plan(
    local: &BlockLayout,
    remote: &BlockLayout,
    local_ids: &[i64],
    remote_ids: &[i64],
    slice: BlockSlice,
) -> Vec<Descriptor> {
    let mut plan = Vec::new();
    for (&lb, &rb) in local.segment_bases.iter().zip(&remote.segment_bases) {
        for (&lid, &rid) in local_ids.iter().zip(remote_ids) {
            plan.push(Descriptor {
                local_addr: lb + lid as u64 * local.block_stride + slice.local_offset,
                remote_addr: rb + rid as u64 * remote.block_stride + slice.remote_offset,
                len: slice.len,
            });
        }
    }
    plan
}

/// Two layouts of independent block lengths, equally long id lists, and a slice that fits
/// both (sometimes touching a block's end, sometimes the whole of the smaller block).
fn sliced_case() -> impl Strategy<Value = (BlockLayout, BlockLayout, Vec<i64>, Vec<i64>, BlockSlice)>
{
    (1usize..6, 1u64..48, 1u64..48, 0usize..30).prop_flat_map(|(segments, ll, rl, n)| {
        let max_len = ll.min(rl);
        (layout(segments, ll), layout(segments, rl), prop_oneof![Just(max_len), 1..=max_len])
            .prop_flat_map(move |(local, remote, len)| {
                let slice =
                    (prop_oneof![Just(rl - len), 0..=rl - len], prop_oneof![Just(0), 0..=ll - len])
                        .prop_map(move |(remote_offset, local_offset)| BlockSlice {
                            remote_offset,
                            local_offset,
                            len,
                        });
                let local_ids = ids(n, local.num_blocks);
                let remote_ids = ids(n, remote.num_blocks);
                (Just(local), Just(remote), local_ids, remote_ids, slice)
            })
    })
}

fn whole(layout: &BlockLayout) -> BlockSlice {
    BlockSlice { remote_offset: 0, local_offset: 0, len: layout.block_len }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// A partial slice is one read per (segment, id pair), in order, each inside its block on
    /// both sides, and never merged; a slice of both whole blocks is planned as no slice.
    #[test]
    fn sliced_plan_is_one_read_per_block_inside_each_block(
        (local, remote, lids, rids, slice) in sliced_case(),
    ) {
        let plan = plan_reads(&local, &remote, &lids, &rids, Some(slice)).unwrap();
        if slice == whole(&local) && local.block_len == remote.block_len {
            prop_assert_eq!(plan, plan_reads(&local, &remote, &lids, &rids, None).unwrap());
            return Ok(());
        }
        prop_assert_eq!(&plan, &naive_sliced_plan(&local, &remote, &lids, &rids, slice));
        for (i, d) in plan.iter().enumerate() {
            let (segment, pair) = (i / lids.len(), i % lids.len());
            let local_block = local.segment_bases[segment] + lids[pair] as u64 * local.block_stride;
            let remote_block =
                remote.segment_bases[segment] + rids[pair] as u64 * remote.block_stride;
            prop_assert!(local_block <= d.local_addr);
            prop_assert!(d.local_addr + d.len <= local_block + local.block_len);
            prop_assert!(remote_block <= d.remote_addr);
            prop_assert!(d.remote_addr + d.len <= remote_block + remote.block_len);
        }
        let regions = segment_regions(&remote);
        prop_assert!(holding_regions(&plan, &regions).is_ok());
        // One segment at a time gives that segment's share of the whole plan.
        let mut joined = Vec::new();
        for segment in 0..local.segment_bases.len() {
            joined.extend(
                plan_segment_reads(&local, &remote, &lids, &rids, segment..segment + 1, Some(slice))
                    .unwrap(),
            );
        }
        prop_assert_eq!(joined, plan);
    }

    /// Same block sizes: a whole-block slice plans exactly what no slice does.
    #[test]
    fn whole_block_slice_equals_no_slice((local, remote, lids, rids) in case(1, 1)) {
        prop_assert_eq!(
            plan_reads(&local, &remote, &lids, &rids, Some(whole(&local))),
            plan_reads(&local, &remote, &lids, &rids, None)
        );
    }

    /// Any slice that does not fit either side, or is empty, fails before ids are looked at.
    #[test]
    fn any_slice_outside_a_block_is_rejected(
        (local, remote) in (1usize..4, 1u64..40, 1u64..40)
            .prop_flat_map(|(s, ll, rl)| (layout(s, ll), layout(s, rl))),
        remote_offset in prop_oneof![0u64..50, Just(u64::MAX), u64::MAX - 50..=u64::MAX],
        local_offset in prop_oneof![0u64..50, Just(u64::MAX), u64::MAX - 50..=u64::MAX],
        len in prop_oneof![0u64..50, Just(u64::MAX)],
    ) {
        let slice = BlockSlice { remote_offset, local_offset, len };
        let fits = |offset: u64, block_len: u64| {
            u128::from(offset) + u128::from(len) <= u128::from(block_len)
        };
        let valid = len > 0 && fits(remote_offset, remote.block_len) && fits(local_offset, local.block_len);
        // Valid ids, so only the slice decides.
        let result = plan_reads(&local, &remote, &[0], &[0], Some(slice));
        prop_assert_eq!(result.is_ok(), valid, "{:?}", result);
        if !valid {
            let slice_error = matches!(
                result,
                Err(PlanError::EmptySlice | PlanError::SliceOutsideBlock { .. })
            );
            prop_assert!(slice_error, "{:?}", result);
            // Bad ids too: the slice is still what is reported.
            let bad_ids = plan_reads(&local, &remote, &[-1], &[i64::MAX], Some(slice));
            let slice_error = matches!(
                bad_ids,
                Err(PlanError::EmptySlice | PlanError::SliceOutsideBlock { .. })
            );
            prop_assert!(slice_error, "{:?}", bad_ids);
        }
    }
}

fn half(remote_offset: u64, local_offset: u64, len: u64) -> Option<BlockSlice> {
    Some(BlockSlice { remote_offset, local_offset, len })
}

#[test]
fn slices_that_fit_exactly_are_accepted_and_one_byte_more_is_not() {
    let l = contiguous(vec![0], 64, 16);
    let r = contiguous(vec![1 << 20], 128, 16);
    // Remote ends at its block's end, local at its own.
    let plan = plan_reads(&l, &r, &[3], &[5], half(64, 0, 64)).unwrap();
    assert_eq!(
        plan,
        vec![Descriptor { local_addr: 3 * 64, remote_addr: (1 << 20) + 5 * 128 + 64, len: 64 }]
    );
    assert_eq!(
        plan_reads(&l, &r, &[3], &[5], half(65, 0, 64)),
        Err(PlanError::SliceOutsideBlock {
            side: Side::Remote,
            offset: 65,
            len: 64,
            block_len: 128
        })
    );
    assert_eq!(
        err_text(plan_reads(&l, &r, &[3], &[5], half(0, 1, 64))),
        "block slice 1+64 does not fit in a local block of block_len 64"
    );
    assert_eq!(err_text(plan_reads(&l, &r, &[3], &[5], half(0, 0, 0))), "block slice len is 0");
}

#[test]
fn slice_offsets_that_overflow_u64_are_rejected_not_wrapped() {
    let l = contiguous(vec![0], 64, 16);
    let r = contiguous(vec![1 << 20], 64, 16);
    // u64::MAX + 2 wraps to 1, which would "fit" without checked arithmetic.
    assert_eq!(
        plan_reads(&l, &r, &[0], &[0], half(u64::MAX, 0, 2)),
        Err(PlanError::SliceOutsideBlock {
            side: Side::Remote,
            offset: u64::MAX,
            len: 2,
            block_len: 64
        })
    );
    assert_eq!(
        plan_reads(&l, &r, &[0], &[0], half(0, u64::MAX - 1, 3)),
        Err(PlanError::SliceOutsideBlock {
            side: Side::Local,
            offset: u64::MAX - 1,
            len: 3,
            block_len: 64
        })
    );
    assert!(plan_reads(&l, &r, &[0], &[0], half(1, 1, u64::MAX)).is_err());
    assert!(plan_reads(&l, &r, &[0], &[0], half(u64::MAX, u64::MAX, u64::MAX)).is_err());
}

#[test]
fn a_slice_pairs_ids_one_to_one_whatever_the_block_sizes() {
    // TP=1 -> TP=2: rank 1 reads the second half of each 128-byte page into its 64-byte page.
    let l = contiguous(vec![0, 1 << 16], 64, 16);
    let r = contiguous(vec![1 << 20, (1 << 20) + (1 << 16)], 128, 16);
    let plan = plan_reads(&l, &r, &[1, 2], &[7, 8], half(64, 0, 64)).unwrap();
    assert_eq!(
        plan,
        vec![
            Descriptor { local_addr: 64, remote_addr: (1 << 20) + 7 * 128 + 64, len: 64 },
            Descriptor { local_addr: 128, remote_addr: (1 << 20) + 8 * 128 + 64, len: 64 },
            Descriptor {
                local_addr: (1 << 16) + 64,
                remote_addr: (1 << 20) + (1 << 16) + 7 * 128 + 64,
                len: 64
            },
            Descriptor {
                local_addr: (1 << 16) + 128,
                remote_addr: (1 << 20) + (1 << 16) + 8 * 128 + 64,
                len: 64
            },
        ]
    );
    // TP=2 -> TP=1: a whole 64-byte page into the second half of a 128-byte one.
    let plan = plan_reads(&r, &l, &[7], &[1], half(0, 64, 64)).unwrap();
    assert_eq!(
        plan[0],
        Descriptor { local_addr: (1 << 20) + 7 * 128 + 64, remote_addr: 64, len: 64 }
    );
    // Block sizes that are no multiple of each other are fine with a slice, not without.
    let odd = contiguous(vec![1 << 20, (1 << 20) + (1 << 16)], 48, 16);
    assert!(plan_reads(&l, &odd, &[1], &[1], None).is_err());
    assert!(plan_reads(&l, &odd, &[1], &[1], half(8, 24, 40)).is_ok());
    // Without the ratio the id lists must be equally long.
    assert_eq!(
        err_text(plan_reads(&l, &r, &[1, 2], &[7], half(0, 0, 64))),
        "a block slice pairs block ids one to one, but there are 2 local ids and 1 remote ids"
    );
    // Ids are still checked on both sides.
    assert_eq!(
        plan_reads(&l, &r, &[1], &[16], half(0, 0, 64)),
        Err(PlanError::BlockIdOutOfRange { side: Side::Remote, id: 16, num_blocks: 16 })
    );
    assert_eq!(
        plan_reads(&l, &r, &[-1], &[0], half(0, 0, 64)),
        Err(PlanError::NegativeBlockId { side: Side::Local, id: -1 })
    );
    assert!(plan_segment_reads(&l, &r, &[1], &[1], 2..3, half(0, 0, 64)).is_err());
}

#[test]
fn sliced_reads_are_never_coalesced() {
    // A vLLM-style run: whole blocks make one read per segment, a slice one read per block.
    let l = contiguous((0..4).map(|s| s << 24).collect(), 4096, 1024);
    let r = contiguous((0..4).map(|s| (s << 24) + (1 << 40)).collect(), 4096, 1024);
    let run: Vec<i64> = (100..150).collect();
    assert_eq!(plan_reads(&l, &r, &run, &run, None).unwrap().len(), 4);
    let plan = plan_reads(&l, &r, &run, &run, half(0, 0, 2048)).unwrap();
    assert_eq!(plan.len(), 4 * 50);
    assert!(plan.iter().all(|d| d.len == 2048));
    // A whole slice on one side only is still partial: the local pages are contiguous and
    // wholly written, but the remote halves are 2048 bytes apart.
    let half_local = contiguous((0..4).map(|s| s << 24).collect(), 2048, 1024);
    let plan = plan_reads(&half_local, &r, &run, &run, half(2048, 0, 2048)).unwrap();
    assert_eq!(plan.len(), 4 * 50);
    assert!(plan.windows(2).all(|p| !mergeable(&p[0], &p[1])));

    // Touching segments where two sliced reads do continue each other on both sides: the
    // local segments are adjacent 32-byte pages, the remote pages 64 bytes whose segments
    // start 32 bytes apart. Whole blocks would merge; a slice must not.
    let l = contiguous(vec![0, 32], 32, 1);
    let r = BlockLayout {
        segment_bases: vec![1 << 30, (1 << 30) + 32],
        block_stride: 64,
        block_len: 64,
        num_blocks: 1,
    };
    let plan = plan_reads(&l, &r, &[0], &[0], half(0, 0, 32)).unwrap();
    assert!(mergeable(&plan[0], &plan[1]));
    assert_eq!(
        plan,
        vec![
            Descriptor { local_addr: 0, remote_addr: 1 << 30, len: 32 },
            Descriptor { local_addr: 32, remote_addr: (1 << 30) + 32, len: 32 },
        ]
    );
    // The same shape with whole blocks does merge across the segments.
    let whole_l = contiguous(vec![0, 64], 64, 1);
    let whole_r = contiguous(vec![1 << 30, (1 << 30) + 64], 64, 1);
    let slice = whole(&whole_l);
    assert_eq!(plan_reads(&whole_l, &whole_r, &[0], &[0], Some(slice)).unwrap().len(), 1);
}
