//! One-sided READ through the engine between two engines in this process (UCX picks cma or
//! tcp from UCX_TLS): 16×4 KiB and 1000×16 KiB scattered blocks. The cross-process,
//! side-by-side comparison with NIXL and raw UCX is benches/compare_transfer.py.

use std::collections::BTreeMap;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvduplex::descriptors::BlockLayout;
use kvduplex::engine::{Engine, EngineConfig, RegionMemory};
use kvduplex::handshake::Fingerprint;

fn engine(id: &str, buf: &mut [u8], block: usize) -> Engine {
    let engine = Engine::start(EngineConfig {
        engine_id: id.into(),
        fingerprint: Fingerprint(BTreeMap::new()),
        host: "127.0.0.1".into(),
        port: 0,
        secret: None,
        ucx_lib_dir: None,
        heartbeat: Duration::from_secs(1),
        // Both engines share this process, which same-host reads would read directly: the
        // bench measures UCX's own same-host transports (cma), which peer error handling
        // would trade for tcp.
        peer_error_handling: false,
        lookup_claim: Duration::from_secs(30),
        allow_unauthenticated: false,
        same_host_reads: false,
    })
    .expect("engine starts (is KVDUPLEX_UCX_LIB_DIR set?)");
    let base = buf.as_mut_ptr() as u64;
    // SAFETY: each engine is declared after the buffer it registers, in the same scope
    // (`bench_reads`), so it is dropped (closed) before its buffer is freed; nothing else
    // touches the buffers meanwhile.
    let memory = unsafe { RegionMemory::new(base, buf.len() as u64) };
    engine.register_region(memory).unwrap();
    let layout = BlockLayout {
        segment_bases: vec![base],
        block_stride: block as u64,
        block_len: block as u64,
        num_blocks: (buf.len() / block) as u64,
    };
    engine.set_layout(layout).unwrap();
    engine
}

/// Every other block, so no two reads coalesce.
fn scattered(count: usize) -> Vec<i64> {
    (0..count as i64).map(|i| 1 + 2 * i).collect()
}

fn bench_reads(c: &mut Criterion) {
    for (name, block, count) in [("16x4K", 4096usize, 16usize), ("1000x16K", 16384, 1000)] {
        let mut owned = vec![7u8; block * (2 * count + 2)];
        let mut local = vec![0u8; owned.len()];
        let owner = engine("owner", &mut owned, block);
        let reader = engine("reader", &mut local, block);
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
