//! What the Rust integration tests share: a transfer engine over a test buffer.

use std::time::Duration;

use kvduplex::descriptors::BlockLayout;
use kvduplex::engine::{Engine, EngineConfig};
use kvduplex::handshake::Fingerprint;

/// An engine on loopback (side channel on `port`, 0: a free one, no secret, 200 ms heartbeats)
/// over `buf`, registered and cut into `buf.len() / block` blocks of `block` bytes.
pub fn test_engine(
    id: &str,
    fingerprint: Fingerprint,
    buf: &mut [u8],
    same_host_reads: bool,
    block: usize,
    port: u16,
) -> Engine {
    let engine = Engine::start(EngineConfig {
        engine_id: id.into(),
        fingerprint,
        host: "127.0.0.1".into(),
        port,
        secret: None,
        ucx_lib_dir: None,
        heartbeat: Duration::from_millis(200),
        peer_error_handling: false,
        lookup_claim: Duration::from_secs(30),
        allow_unauthenticated: false,
        same_host_reads,
    })
    .expect("engine starts (is KVDUPLEX_UCX_LIB_DIR set?)");
    let base = buf.as_mut_ptr() as u64;
    engine.register_region(base, buf.len() as u64).unwrap();
    engine
        .set_layout(BlockLayout {
            segment_bases: vec![base],
            block_stride: block as u64,
            block_len: block as u64,
            num_blocks: (buf.len() / block) as u64,
        })
        .unwrap();
    engine
}
