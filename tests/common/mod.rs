//! What the Rust integration tests share: a side-channel server on 127.0.0.1 and clients of
//! it, and a transfer engine over a test buffer.
#![allow(dead_code)] // each binary uses a different part

use std::thread;
use std::time::{Duration, Instant};

use kvduplex::descriptors::BlockLayout;
use kvduplex::engine::{Engine, EngineConfig, RegionMemory};
use kvduplex::handshake::{EngineMetadata, Fingerprint, HandshakeError};
use kvduplex::side_channel::{PeerLink, SideChannelConfig, SideChannelServer};

pub const HEARTBEAT: Duration = Duration::from_millis(100);
pub const TIMEOUT: Duration = Duration::from_secs(5);

pub fn fingerprint(dtype: &str) -> Fingerprint {
    Fingerprint(
        [("model", "llama"), ("dtype", dtype), ("block_size", "16")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
    )
}

pub fn metadata(engine_id: &str) -> EngineMetadata {
    EngineMetadata {
        engine_id: engine_id.to_owned(),
        generation: 42,
        worker_address: vec![1, 2, 3, 4],
        regions: vec![],
        layout: None,
        fingerprint: fingerprint("bf16"),
        same_host: None,
    }
}

pub fn start(secret: Option<&[u8]>) -> SideChannelServer {
    let config = SideChannelConfig {
        host: "127.0.0.1".to_owned(),
        port: 0,
        secret: secret.map(<[u8]>::to_vec),
        heartbeat: HEARTBEAT,
        allow_unauthenticated: false,
        same_host_key: None,
    };
    SideChannelServer::start(config, metadata("owner")).unwrap()
}

pub fn connect_as(
    server: &SideChannelServer,
    engine_id: &str,
    fp: &Fingerprint,
    secret: Option<&[u8]>,
) -> Result<(PeerLink, EngineMetadata), HandshakeError> {
    connect_to(server.local_addr().port(), engine_id, fp, secret, TIMEOUT)
}

/// Connects to whatever listens on `port` of 127.0.0.1: a real server or a hand-made peer.
pub fn connect_to(
    port: u16,
    engine_id: &str,
    fp: &Fingerprint,
    secret: Option<&[u8]>,
    timeout: Duration,
) -> Result<(PeerLink, EngineMetadata), HandshakeError> {
    PeerLink::connect("127.0.0.1", port, engine_id, None, fp, secret, timeout, HEARTBEAT, None)
}

pub fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if done() {
            return true;
        }
        thread::sleep(Duration::from_millis(5));
    }
    done()
}

/// An engine on loopback (side channel on `port`, 0: a free one, no secret, 200 ms heartbeats)
/// over `buf`, registered and cut into `buf.len() / block` blocks of `block` bytes.
pub fn test_engine(
    id: &str,
    fingerprint: Fingerprint,
    buf: Vec<u8>,
    same_host_reads: bool,
    block: usize,
    port: u16,
) -> TestEngine {
    let engine = Engine::start(EngineConfig {
        engine_id: id.into(),
        fingerprint,
        host: "127.0.0.1".into(),
        port,
        secret: None,
        ucx_lib_dir: None,
        heartbeat: Duration::from_millis(200),
        peer_error_handling: true,
        lookup_claim: Duration::from_secs(30),
        allow_unauthenticated: false,
        same_host_reads,
    })
    .expect("engine starts (is KVDUPLEX_UCX_LIB_DIR set?)");
    let mut buf = buf.into_boxed_slice();
    let base = buf.as_mut_ptr() as u64;
    // SAFETY: the engine and the buffer go together into a TestEngine, which drops (closes)
    // the engine before the buffer and never reallocates it; tests read it only between
    // settled batches.
    let memory = unsafe { RegionMemory::new(base, buf.len() as u64) };
    engine.register_region(memory).unwrap();
    engine
        .set_layout(BlockLayout {
            segment_bases: vec![base],
            block_stride: block as u64,
            block_len: block as u64,
            num_blocks: (buf.len() / block) as u64,
        })
        .unwrap();
    TestEngine { engine, buf }
}

/// An engine with the buffer it registered: the engine is dropped first (fields drop in
/// order), so the memory outlives every read into it, and the buffer cannot be resized.
pub struct TestEngine {
    engine: Engine,
    buf: Box<[u8]>,
}

impl TestEngine {
    /// The registered buffer, as the engine's reads left it.
    pub fn buf(&self) -> &[u8] {
        &self.buf
    }
}

impl std::ops::Deref for TestEngine {
    type Target = Engine;
    fn deref(&self) -> &Engine {
        &self.engine
    }
}

impl std::ops::DerefMut for TestEngine {
    fn deref_mut(&mut self) -> &mut Engine {
        &mut self.engine
    }
}
