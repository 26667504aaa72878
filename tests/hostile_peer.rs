//! Fake owners that speak the side channel and lie about who they are, to make a reader copy
//! memory nobody registered into its KV blocks: another engine's process (named as their own
//! for same-host reads), or the reader's own process (named by pid, or by the reader's UCX
//! worker address, rewritten so that it is not the same bytes but reaches the same worker).
//! Each must be refused. A lie about a process only means something from another process, so
//! the fakes that claim one run in processes of their own (this test binary, run again).

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::TestEngine;
use kvduplex::descriptors::BlockLayout;
use kvduplex::handshake::wire::Frame;
use kvduplex::handshake::{
    decode_metadata, encode_metadata, EngineMetadata, Fingerprint, MemoryType, RegionInfo,
};
use kvduplex::side_channel::{SideChannelConfig, SideChannelServer};
use kvduplex::ucx_packed::{parse_worker_address, transport_checksum};

const BLOCK: usize = 4096;
const BLOCKS: usize = 8;
/// What nobody registered: the reader's (or the other engine's) unregistered memory.
const SECRET: u8 = 0x5a;
/// What the other engine registered.
const KV: u8 = 0x33;
/// Set in a child: which role it plays, and its argument.
const ROLE_VAR: &str = "KVDUPLEX_HOSTILE_PEER_ROLE";
const ARG_VAR: &str = "KVDUPLEX_HOSTILE_PEER_ARG";

fn fingerprint() -> Fingerprint {
    Fingerprint(BTreeMap::from([("model".to_string(), "tiny".to_string())]))
}

fn reader(same_host_reads: bool) -> TestEngine {
    common::test_engine(
        "reader",
        fingerprint(),
        vec![0u8; BLOCK * BLOCKS],
        same_host_reads,
        BLOCK,
        0,
    )
}

/// Metadata of a fake owner whose one region is `target` (`BLOCKS` blocks of memory it does not
/// own), with the given worker address and rkey, claiming no process.
fn fake_metadata(target: u64, worker_address: Vec<u8>, rkey: Vec<u8>) -> EngineMetadata {
    EngineMetadata {
        engine_id: "fake-owner".into(),
        generation: 7,
        worker_address,
        regions: vec![RegionInfo {
            addr: target,
            len: (BLOCK * BLOCKS) as u64,
            rkey,
            memory: MemoryType::Host,
        }],
        layout: Some(BlockLayout {
            segment_bases: vec![target],
            block_stride: BLOCK as u64,
            block_len: BLOCK as u64,
            num_blocks: BLOCKS as u64,
        }),
        fingerprint: fingerprint(),
        same_host: None,
    }
}

fn serve(meta: EngineMetadata) -> SideChannelServer {
    let config = SideChannelConfig {
        host: "127.0.0.1".into(),
        heartbeat: Duration::from_millis(200),
        ..SideChannelConfig::default()
    };
    SideChannelServer::start(config, meta).unwrap()
}

/// Connects `reader` to `port` and reads block 0 into its block 0: the reader's error, after
/// checking that no block of `forbidden` bytes landed there.
fn attack(reader: &TestEngine, port: u16, forbidden: u8) -> String {
    let outcome = (|| {
        let peer =
            reader.connect("127.0.0.1", port, Duration::from_secs(5)).map_err(|e| e.to_string())?;
        let transfer = reader
            .read_blocks(&peer, &[0], &[0], None, Duration::from_secs(5), None, None)
            .map_err(|e| e.to_string())?;
        transfer.wait(Some(Duration::from_secs(5))).map_err(|e| e.to_string())
    })();
    let landed = reader.buf()[..BLOCK].iter().filter(|&&b| b == forbidden).count();
    assert!(landed < BLOCK, "the reader copied memory nobody registered into its KV block");
    outcome.expect_err("refused")
}

/// A child process, which ends when this is dropped (its stdin closed), and is waited for.
struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        drop(self.0.stdin.take());
        let _ = self.0.wait();
    }
}

/// This test binary again, as `role` with `arg`: a process of its own, which prints
/// `ready <values>` and runs until its stdin closes. Returns it and its values.
fn spawn(role: &str, arg: &str) -> (Process, Vec<u64>) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["play_a_role", "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE_VAR, role)
        .env(ARG_VAR, arg)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // The test harness may print "test play_a_role ... " first on the same line.
    let values = lines
        .find_map(|line| {
            let line = line.ok()?;
            let values = line.rsplit_once("ready ")?.1;
            values.split(' ').map(|v| v.parse().ok()).collect::<Option<Vec<u64>>>()
        })
        .unwrap_or_else(|| panic!("the {role} started"));
    // Drained, so that the child's test harness can write its summary.
    std::thread::spawn(move || lines.for_each(drop));
    (Process(child), values)
}

/// Not a case: the role a child process plays (see `spawn`).
#[test]
fn play_a_role() {
    let (Ok(role), Ok(arg)) = (std::env::var(ROLE_VAR), std::env::var(ARG_VAR)) else { return };
    let secret = vec![SECRET; BLOCK * BLOCKS];
    let mut keep = Vec::new();
    let ready = match role.as_str() {
        // An honest engine with memory nobody registered: its port and that memory's address.
        "owner" => {
            let owner = common::test_engine(
                "owner",
                fingerprint(),
                vec![KV; BLOCK * BLOCKS],
                true,
                BLOCK,
                0,
            );
            let port = owner.side_channel_addr().unwrap().port();
            keep.push(Box::new(owner) as Box<dyn std::any::Any>);
            format!("{port} {}", secret.as_ptr() as u64)
        }
        // A fake owner serving the metadata `arg` encodes (hex); its side channel names this
        // process and its own end of each connection, truthfully, as every side channel does.
        "fake" => {
            let bytes: Vec<u8> = (0..arg.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&arg[i..i + 2], 16).unwrap())
                .collect();
            let server = serve(decode_metadata(&bytes).unwrap());
            let port = server.local_addr().port();
            keep.push(Box::new(server));
            port.to_string()
        }
        // A relay in front of the owner at port `arg`'s first value that rewrites the owner's
        // metadata to name, as its region, the memory at `arg`'s second value.
        "relay" => {
            let (owner_port, target) = arg.split_once(' ').unwrap();
            let (owner_port, target): (u16, u64) =
                (owner_port.parse().unwrap(), target.parse().unwrap());
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let port = listener.local_addr().unwrap().port();
            std::thread::spawn(move || {
                for client in listener.incoming() {
                    let client = client.unwrap();
                    let owner = TcpStream::connect(("127.0.0.1", owner_port)).unwrap();
                    let (c2, o2) = (client.try_clone().unwrap(), owner.try_clone().unwrap());
                    std::thread::spawn(move || common::pump(c2, o2, 0, |f| f));
                    std::thread::spawn(move || {
                        common::pump(owner, client, 2, move |f| point_at(f, target))
                    });
                }
            });
            port.to_string()
        }
        other => panic!("no role {other}"),
    };
    println!("ready {ready}");
    std::io::stdout().flush().unwrap();
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    drop(keep);
}

/// `frame`, if it is metadata, with its one region and layout moved to `target`.
fn point_at(frame: Frame, target: u64) -> Frame {
    match frame {
        Frame::Metadata(meta) => {
            let moved =
                fake_metadata(target, meta.worker_address.clone(), meta.regions[0].rkey.clone());
            Frame::Metadata(EngineMetadata { same_host: meta.same_host, ..moved })
        }
        other => other,
    }
}

#[test]
fn a_peer_cannot_name_another_engines_process_for_same_host_reads() {
    let (_owner, values) = spawn("owner", "");
    let (owner_port, owner_secret) = (values[0] as u16, values[1]);
    let reader = reader(true);
    // The owner itself is read directly: the kernel shows it on the other end.
    let peer = reader.connect("127.0.0.1", owner_port, Duration::from_secs(5)).unwrap();
    let transfer =
        reader.read_blocks(&peer, &[1], &[0], None, Duration::from_secs(5), None, None).unwrap();
    transfer.wait(Some(Duration::from_secs(5))).unwrap();
    assert!(transfer.same_host(), "an honest engine on this host is read directly");
    assert!(reader.buf()[BLOCK..2 * BLOCK].iter().all(|&b| b == KV));
    // A relay hands on the owner's metadata and its claim, true of the owner's connection to
    // the relay, with the owner's memory nobody registered as its region.
    let (_relay, values) = spawn("relay", &format!("{owner_port} {owner_secret}"));
    let refusal = attack(&reader, values[0] as u16, SECRET);
    assert!(refusal.contains("does not hold the other end of this connection"), "{refusal}");
}

#[test]
fn a_peer_cannot_name_the_readers_own_process() {
    let secret = vec![SECRET; BLOCK * BLOCKS];
    let reader = reader(true);
    // Anyone may fetch the reader's metadata from its side channel: its identity, worker
    // address and rkey. The fake names the reader's process as its own.
    let port = reader.side_channel_addr().unwrap().port();
    let (_link, theirs) =
        common::connect_to(port, "fake-owner", &fingerprint(), None, common::TIMEOUT).unwrap();
    let mut meta = fake_metadata(
        secret.as_ptr() as u64,
        theirs.worker_address.clone(),
        theirs.regions[0].rkey.clone(),
    );
    meta.same_host = theirs.same_host.clone();
    let hex: String = encode_metadata(&meta).iter().map(|b| format!("{b:02x}")).collect();
    let (_fake, values) = spawn("fake", &hex);
    let refusal = attack(&reader, values[0] as u16, SECRET);
    assert!(
        refusal.contains("does not hold the other end")
            || refusal.contains("reaches this very process"),
        "{refusal}"
    );
}

#[test]
fn a_peer_cannot_hand_the_reader_its_own_worker_address_and_rkey() {
    let refusal = hand_the_reader_its_own_address(&[], &[], false);
    assert!(refusal.contains("its self transport names our worker"), "{refusal}");
}

/// The reader's own worker address with a bit of its worker uuid flipped (if `uuid`), a bit of
/// the interface address of each transport in `interfaces` flipped (it then names another
/// interface, or none) and a bit of the device address of each in `devices` (unreachable),
/// served with the reader's rkey by a fake owner whose region is the reader's memory nobody
/// registered. The reader's error.
fn hand_the_reader_its_own_address(interfaces: &[&str], devices: &[&str], uuid: bool) -> String {
    let secret = vec![SECRET; BLOCK * BLOCKS];
    let reader = reader(false);
    let port = reader.side_channel_addr().unwrap().port();
    let (_link, theirs) =
        common::connect_to(port, "fake-owner", &fingerprint(), None, common::TIMEOUT).unwrap();
    let ours = &theirs.worker_address;
    let offset = |part: &[u8]| part.as_ptr() as usize - ours.as_ptr() as usize;
    let mut flip = std::collections::BTreeSet::new();
    for interface in parse_worker_address(ours, false).unwrap().interfaces.unwrap() {
        let name = ["self", "cma", "tcp", "sysv", "posix"]
            .into_iter()
            .find(|n| transport_checksum(n) == interface.transport)
            .unwrap_or("?");
        if interfaces.contains(&name) {
            flip.insert(offset(interface.address));
        }
        if devices.contains(&name) {
            // A tcp device address starts with its flags and family, then the host's id.
            flip.insert(offset(interface.device) + if name == "tcp" { 2 } else { 0 });
        }
    }
    let mut address = ours.clone();
    for at in flip {
        address[at] ^= 0x40;
    }
    if uuid {
        address[2] ^= 1; // address v2: header, flags, then the uuid
    }
    let server =
        serve(fake_metadata(secret.as_ptr() as u64, address, theirs.regions[0].rkey.clone()));
    attack(&reader, server.local_addr().port(), SECRET)
}

#[test]
fn a_bit_flipped_own_worker_address_is_refused() {
    // Another uuid: UCX takes it for another worker, and reaches this one over self.
    let refusal = hand_the_reader_its_own_address(&[], &[], true);
    assert!(refusal.contains("its self transport names our worker"), "{refusal}");
}

#[test]
fn an_own_worker_address_without_self_is_refused_for_each_transport_that_reaches_us() {
    // Without self, UCX asks our own worker for the bytes over shared memory (our FIFO
    // segments) or tcp (our listener), each enough alone (the others made unreachable). cma
    // (our pid) is never enough alone: UCX needs one of those for active messages too.
    for (only, why) in [
        ("sysv", "its sysv shared memory names segment"),
        ("posix", "its posix shared memory names a segment of ours"),
        ("tcp", "its tcp transport connects to 127.0.0.1"),
    ] {
        let others: Vec<&str> =
            ["cma", "sysv", "posix", "tcp"].into_iter().filter(|t| *t != only).collect();
        let refusal = hand_the_reader_its_own_address(&["self"], &others, true);
        assert!(refusal.contains(why), "{only}: {refusal}");
    }
}
