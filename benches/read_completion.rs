//! What a batch costs the engine's bookkeeping with n batches in flight: n one-block (4 KiB)
//! reads are posted before the first is waited for, then each is waited for in turn; the time
//! per batch at n = 1, 64 and 1,024 (`read_completion/n`). Both engines share this process and
//! the batches are same-host reads (the peer's copy thread copies them, so they stay in flight
//! while the next are posted), whose copy is cheap beside UCX's: what grows with n is the
//! engine's tracking (posting, delivering completions, deadlines), which should not.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvduplex::descriptors::BlockLayout;
use kvduplex::engine::{Engine, EngineConfig, RegionMemory};
use kvduplex::handshake::Fingerprint;

const BLOCK: usize = 4096;
const MAX_IN_FLIGHT: usize = 1024;

fn engine(id: &str, buf: &mut [u8]) -> Engine {
    let engine = Engine::start(EngineConfig {
        engine_id: id.into(),
        fingerprint: Fingerprint(BTreeMap::new()),
        host: "127.0.0.1".into(),
        port: 0,
        secret: None,
        ucx_lib_dir: None,
        heartbeat: Duration::from_secs(1),
        peer_error_handling: false,
        lookup_claim: Duration::from_secs(30),
        allow_unauthenticated: false,
        same_host_reads: true,
    })
    .expect("engine starts (is KVDUPLEX_UCX_LIB_DIR set?)");
    let base = buf.as_mut_ptr() as u64;
    // SAFETY: each engine is declared after the buffer it registers, in the same scope
    // (`bench_completion`), so it is dropped (closed) before its buffer is freed; nothing else
    // touches the buffers meanwhile.
    let memory = unsafe { RegionMemory::new(base, buf.len() as u64) };
    engine.register_region(memory).unwrap();
    let layout = BlockLayout {
        segment_bases: vec![base],
        block_stride: BLOCK as u64,
        block_len: BLOCK as u64,
        num_blocks: (buf.len() / BLOCK) as u64,
    };
    engine.set_layout(layout).unwrap();
    engine
}

fn bench_completion(c: &mut Criterion) {
    let mut owned = vec![7u8; BLOCK * MAX_IN_FLIGHT];
    let mut local = vec![0u8; owned.len()];
    let owner = engine("owner", &mut owned);
    let reader = engine("reader", &mut local);
    let addr = owner.side_channel_addr().unwrap();
    let peer = reader.connect(&addr.ip().to_string(), addr.port(), Duration::from_secs(5)).unwrap();
    let mut group = c.benchmark_group("read_completion");
    for n in [1usize, 64, MAX_IN_FLIGHT] {
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, &n| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    let transfers: Vec<_> = (0..n as i64)
                        .map(|i| {
                            reader
                                .read_blocks(
                                    &peer,
                                    &[i],
                                    &[i],
                                    None,
                                    Duration::from_secs(10),
                                    None,
                                    None,
                                )
                                .unwrap()
                        })
                        .collect();
                    for t in &transfers {
                        assert!(t.same_host());
                        t.wait(Some(Duration::from_secs(10))).unwrap();
                    }
                }
                // Per batch.
                start.elapsed() / n as u32
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_completion);
criterion_main!(benches);
