//! Fake owners that speak the side channel and try to make a reader copy memory that is not
//! theirs into its KV blocks: its own process's memory (named by pid, or by its own UCX worker
//! address and rkey). Each must be refused.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::TestEngine;
use kvduplex::descriptors::BlockLayout;
use kvduplex::handshake::{EngineMetadata, Fingerprint, MemoryType, RegionInfo, SameHostIdentity};
use kvduplex::side_channel::{SideChannelConfig, SideChannelServer};

const BLOCK: usize = 4096;
const BLOCKS: usize = 8;
const SECRET: u8 = 0x5a;

fn fingerprint() -> Fingerprint {
    Fingerprint(BTreeMap::from([("model".to_string(), "tiny".to_string())]))
}

fn reader(buf: Vec<u8>, same_host_reads: bool) -> TestEngine {
    common::test_engine("reader", fingerprint(), buf, same_host_reads, BLOCK, 0)
}

/// Metadata of a fake owner whose one "region" is `target` (memory of the reader's process
/// that nobody registered).
fn fake_metadata(target: &[u8], worker_address: Vec<u8>, rkey: Vec<u8>) -> EngineMetadata {
    let base = target.as_ptr() as u64;
    EngineMetadata {
        engine_id: "fake-owner".into(),
        generation: 7,
        worker_address,
        regions: vec![RegionInfo {
            addr: base,
            len: target.len() as u64,
            rkey,
            memory: MemoryType::Host,
        }],
        layout: Some(BlockLayout {
            segment_bases: vec![base],
            block_stride: BLOCK as u64,
            block_len: BLOCK as u64,
            num_blocks: BLOCKS as u64,
        }),
        fingerprint: fingerprint(),
        same_host: None,
    }
}

fn serve(meta: EngineMetadata, same_host_key: Option<[u8; 32]>) -> SideChannelServer {
    let config = SideChannelConfig {
        host: "127.0.0.1".into(),
        heartbeat: Duration::from_millis(200),
        same_host_key,
        ..SideChannelConfig::default()
    };
    SideChannelServer::start(config, meta).unwrap()
}

/// Connects `reader` to `server` and reads block 0 into its block 0, which must fail without
/// the fake's "region" (the reader's secret) landing there: the reader's error.
fn attack(reader: &TestEngine, server: &SideChannelServer) -> String {
    let outcome = read_block_0(reader, server);
    assert!(
        !matches!(&outcome, Ok(bytes) if bytes.iter().all(|&b| b == SECRET)),
        "the reader copied its own unregistered memory into its KV block"
    );
    outcome.expect_err("refused")
}

/// What landed in the reader's block 0 after reading the block 0 of `server`.
fn read_block_0(reader: &TestEngine, server: &SideChannelServer) -> Result<Vec<u8>, String> {
    let peer = reader
        .connect("127.0.0.1", server.local_addr().port(), Duration::from_secs(5))
        .map_err(|e| e.to_string())?;
    let transfer = reader
        .read_blocks(&peer, &[0], &[0], None, Duration::from_secs(5), None, None)
        .map_err(|e| e.to_string())?;
    transfer.wait(Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
    Ok(reader.buf()[..BLOCK].to_vec())
}

fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap().trim().to_owned()
}

#[test]
fn a_peer_cannot_point_same_host_reads_at_the_readers_own_memory() {
    let secret = vec![SECRET; BLOCK * BLOCKS];
    let reader = reader(vec![0u8; BLOCK * BLOCKS], true);
    // The fake owner got a "probe key" of its choosing into the reader's process at a known
    // address (here: the test allocates it; in the wild, any buffer the reader keeps of the
    // peer's input), names the reader's own pid, and proves each connection with that key.
    let planted = Box::new([9u8; 32]);
    let mut meta = fake_metadata(&secret, vec![1; 64], vec![1; 8]);
    meta.same_host = Some(SameHostIdentity {
        boot_id: boot_id(),
        pid: std::process::id(),
        probe_addr: planted.as_ptr() as u64,
        proof: [0; 32],
    });
    let server = serve(meta, Some(*planted));
    let refusal = attack(&reader, &server);
    assert!(refusal.contains("this very process"), "{refusal}");
}

#[test]
fn a_peer_cannot_hand_the_reader_its_own_worker_address_and_rkey() {
    let secret = vec![SECRET; BLOCK * BLOCKS];
    let reader = reader(vec![0u8; BLOCK * BLOCKS], false);
    // Anyone may fetch the reader's metadata from its side channel: its worker address and rkey.
    let reader_port = reader.side_channel_addr().unwrap().port();
    let (_link, theirs) =
        common::connect_to(reader_port, "fake-owner", &fingerprint(), None, common::TIMEOUT)
            .unwrap();
    let meta =
        fake_metadata(&secret, theirs.worker_address.clone(), theirs.regions[0].rkey.clone());
    let server = serve(meta, None);
    let refusal = attack(&reader, &server);
    assert!(refusal.contains("worker address of an engine of this very process"), "{refusal}");
}

#[test]
fn a_replayed_same_host_identity_cannot_bring_its_own_layout() {
    let owner = reader(vec![0x33u8; BLOCK * BLOCKS], true);
    let reader = reader(vec![0u8; BLOCK * BLOCKS], true);
    // The fake fetches the real owner's metadata, identity and proof included...
    let port = owner.side_channel_addr().unwrap().port();
    let (_link, mut meta) =
        common::connect_to(port, "fake", &fingerprint(), None, common::TIMEOUT).unwrap();
    assert!(meta.same_host.is_some());
    // ...and serves it with a layout of its own choosing over the same regions (blocks that
    // straddle the owner's, say).
    let layout = meta.layout.as_mut().unwrap();
    layout.segment_bases[0] += 100;
    layout.num_blocks -= 1;
    let server = serve(meta, None);
    let refused = reader
        .connect("127.0.0.1", server.local_addr().port(), Duration::from_secs(5))
        .expect_err("refused")
        .to_string();
    // Engines of one process: caught where the owner's worker address is checked, with the
    // same proof; across processes where the identity is.
    assert!(
        refused.contains("did not vouch") || refused.contains("without that engine's proof"),
        "{refused}"
    );
}
