//! What the engine benches share: an engine of this process over memory its caller owns.

use std::collections::BTreeMap;
use std::time::Duration;

use kvduplex::descriptors::BlockLayout;
use kvduplex::engine::{Engine, EngineConfig, RegionMemory};
use kvduplex::handshake::Fingerprint;

/// An engine named `id` with one region, `len` bytes at `base` in blocks of `block` bytes, and
/// no secret (both ends are this process). Peer error handling stays off: it would trade UCX's
/// same-host transports (cma) for tcp. `same_host_reads` picks the engine's own direct reads
/// over UCX's.
///
/// # Safety
/// `base .. base + len` must stay allocated, and be written by nothing but reads into it,
/// until the engine is dropped (declare the engine after the memory, in the same scope).
pub unsafe fn engine(
    id: &str,
    base: u64,
    len: usize,
    block: usize,
    same_host_reads: bool,
) -> Engine {
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
        same_host_reads,
    })
    .expect("engine starts (is KVDUPLEX_UCX_LIB_DIR set?)");
    // SAFETY: the caller keeps the memory alive and otherwise untouched while the engine lives.
    let memory = unsafe { RegionMemory::new(base, len as u64) };
    engine.register_region(memory).unwrap();
    let layout = BlockLayout {
        segment_bases: vec![base],
        block_stride: block as u64,
        block_len: block as u64,
        num_blocks: (len / block) as u64,
    };
    engine.set_layout(layout).unwrap();
    engine
}
