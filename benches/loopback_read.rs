//! One-sided READ through the engine between two engines in this process (UCX picks cma or
//! tcp from UCX_TLS): 16×4 KiB and 1000×16 KiB scattered blocks. The cross-process,
//! side-by-side comparison with NIXL and raw UCX is benches/compare_transfer.py.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};

mod common;

/// Every other block, so no two reads coalesce.
fn scattered(count: usize) -> Vec<i64> {
    (0..count as i64).map(|i| 1 + 2 * i).collect()
}

fn bench_reads(c: &mut Criterion) {
    for (name, block, count) in [("16x4K", 4096usize, 16usize), ("1000x16K", 16384, 1000)] {
        let mut owned = vec![7u8; block * (2 * count + 2)];
        let mut local = vec![0u8; owned.len()];
        // SAFETY: each engine is declared after the buffer it registers, in this scope, so it is
        // dropped (closed) before its buffer is freed; nothing else touches the buffers. Both
        // read through UCX (same_host_reads off): the bench measures UCX's own same-host
        // transports (cma).
        let owner = unsafe {
            common::engine("owner", owned.as_mut_ptr() as u64, owned.len(), block, false)
        };
        let reader = unsafe {
            common::engine("reader", local.as_mut_ptr() as u64, local.len(), block, false)
        };
        let addr = owner.side_channel_addr().unwrap();
        let peer =
            reader.connect(&addr.ip().to_string(), addr.port(), Duration::from_secs(5)).unwrap();
        let ids = scattered(count);
        let mut group = c.benchmark_group("loopback_read");
        group.throughput(Throughput::Bytes((block * count) as u64));
        group.bench_function(name, |b| {
            b.iter(|| {
                let t = reader
                    .read_blocks(&peer, &ids, &ids, None, Duration::from_secs(10), None, None)
                    .unwrap();
                t.wait(Some(Duration::from_secs(10))).unwrap();
            })
        });
        group.finish();
    }
}

criterion_group!(benches, bench_reads);
criterion_main!(benches);
