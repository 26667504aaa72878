//! What the side-channel test binaries share: a server on 127.0.0.1 and clients of it.
#![allow(dead_code)] // each binary uses a different part

use std::thread;
use std::time::{Duration, Instant};

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
    PeerLink::connect("127.0.0.1", port, engine_id, None, fp, secret, timeout, HEARTBEAT)
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
