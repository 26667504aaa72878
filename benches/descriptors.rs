//! Planning cost for a full-size request: 64 segments (32 layers × K/V) × 4096 blocks.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use kvduplex::descriptors::{
    check_remote_bounds, plan_reads, BlockLayout, RegionBounds, RegionIndex,
};

const SEGMENTS: u64 = 64;
const BLOCKS: u64 = 4096;
/// 16 tokens × 8 KV heads × 128 dims × 2 bytes.
const BLOCK_LEN: u64 = 32 * 1024;

/// Segments are separate allocations with a gap, as separately allocated tensors would be.
fn layout(first_base: u64) -> BlockLayout {
    let segment_bytes = BLOCKS * BLOCK_LEN + 2 * 1024 * 1024;
    BlockLayout {
        segment_bases: (0..SEGMENTS).map(|s| first_base + s * segment_bytes).collect(),
        block_stride: BLOCK_LEN,
        block_len: BLOCK_LEN,
        num_blocks: BLOCKS,
    }
}

fn regions(layout: &BlockLayout) -> Vec<RegionBounds> {
    let len = layout.num_blocks * layout.block_stride;
    layout.segment_bases.iter().map(|&addr| RegionBounds { addr, len }).collect()
}

/// splitmix64: a fixed-seed generator so every run benches the same ids.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, (self.next() % (i as u64 + 1)) as usize);
        }
    }
}

/// All block ids, grouped into ascending runs of `run` ids whose order is then shuffled.
fn shuffled_runs(rng: &mut SplitMix, run: usize) -> Vec<i64> {
    let ids: Vec<i64> = (0..BLOCKS as i64).collect();
    let mut runs: Vec<&[i64]> = ids.chunks(run).collect();
    rng.shuffle(&mut runs);
    runs.concat()
}

fn bench_plan(c: &mut Criterion) {
    let local = layout(0x7f00_0000_0000);
    let remote = layout(0x5500_0000_0000);
    let mut rng = SplitMix(42);
    let cases = [
        ("scattered", shuffled_runs(&mut rng, 1), shuffled_runs(&mut rng, 1)),
        ("runs_of_50", shuffled_runs(&mut rng, 50), shuffled_runs(&mut rng, 50)),
        (
            "contiguous",
            shuffled_runs(&mut rng, BLOCKS as usize),
            shuffled_runs(&mut rng, BLOCKS as usize),
        ),
    ];
    let mut group = c.benchmark_group("plan_reads_64x4096");
    for (name, local_ids, remote_ids) in &cases {
        group.bench_function(*name, |b| {
            b.iter(|| {
                plan_reads(
                    black_box(&local),
                    black_box(&remote),
                    black_box(local_ids),
                    black_box(remote_ids),
                    None,
                )
                .unwrap()
            })
        });
    }
    group.finish();

    let (_, local_ids, remote_ids) = &cases[0];
    let plan = plan_reads(&local, &remote, local_ids, remote_ids, None).unwrap();
    let remote_regions = regions(&remote);
    c.bench_function("check_remote_bounds_scattered_64x4096", |b| {
        let index = RegionIndex::new(&remote_regions);
        b.iter(|| check_remote_bounds(black_box(&plan), black_box(&index)).unwrap())
    });
}

criterion_group!(benches, bench_plan);
criterion_main!(benches);
