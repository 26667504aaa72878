//! A fake owner that speaks the side channel hands a real reader engine a worker address or
//! remote keys that UCX would parse past their end (or abort on): the reader refuses them at
//! the handshake, naming the field, and never hands them to UCX. Each case runs in a child
//! process, so a UCX abort fails the test instead of killing the test runner; the real owner
//! whose bytes the fake serves runs in a process of its own (a reader refuses a peer that hands
//! it the worker address of an engine of its own process).

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read as _};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::TestEngine;
use kvduplex::handshake::{EngineMetadata, Fingerprint};
use kvduplex::side_channel::{SideChannelConfig, SideChannelServer};

const BLOCK: usize = 4096;
const BLOCKS: usize = 16;
const CASE_VAR: &str = "KVDUPLEX_HOSTILE_UCX_CASE";
const OWNER_VAR: &str = "KVDUPLEX_HOSTILE_UCX_OWNER";

fn fingerprint() -> Fingerprint {
    Fingerprint(BTreeMap::from([("model".to_string(), "tiny".to_string())]))
}

fn engine(id: &str, buf: Vec<u8>) -> TestEngine {
    common::test_engine(id, fingerprint(), buf, false, BLOCK, 0)
}

/// Runs `case` in a child process (this test binary, this one test) and fails with the
/// child's output unless it exits successfully.
fn in_child(test: &str, case: fn()) {
    if std::env::var_os(CASE_VAR).is_some() {
        return case();
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CASE_VAR, test)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the reader's process ended with {:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Not a case: in the process `owner_process` starts, an owner engine that prints its side
/// channel's port and serves until its stdin closes.
#[test]
fn serve_as_owner() {
    if std::env::var_os(OWNER_VAR).is_none() {
        return;
    }
    let owner = engine("owner", (0..BLOCK * BLOCKS).map(|i| (i % 251) as u8).collect());
    println!("port {}", owner.side_channel_addr().unwrap().port());
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
}

/// An owner engine in a process of its own, and its side channel's port.
fn owner_process() -> (Child, u16) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["serve_as_owner", "--exact", "--nocapture", "--test-threads=1"])
        .env(OWNER_VAR, "1")
        .env_remove(CASE_VAR)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // The test harness may print "test serve_as_owner ... " first on the same line.
    let port = lines
        .find_map(|line| line.ok()?.rsplit_once("port ")?.1.trim().parse().ok())
        .expect("the owner's port");
    (child, port)
}

/// A real owner's metadata changed by `tamper`, served by a fake owner; a real reader
/// connects to it and reads. Returns the error the reader got, from connect or the read.
fn read_through_a_fake_owner(tamper: impl FnOnce(&mut EngineMetadata)) -> String {
    let (_owner, owner_port) = owner_process();
    let reader = engine("reader", vec![0u8; BLOCK * BLOCKS]);
    let (link, mut meta) =
        common::connect_to(owner_port, "probe", &fingerprint(), None, common::TIMEOUT).unwrap();
    drop(link);
    tamper(&mut meta);
    let fake = SideChannelServer::start(
        SideChannelConfig { host: "127.0.0.1".into(), ..SideChannelConfig::default() },
        meta,
    )
    .unwrap();
    let port = fake.local_addr().port();
    let peer = match reader.connect("127.0.0.1", port, Duration::from_secs(5)) {
        Ok(peer) => peer,
        Err(e) => return e.to_string(),
    };
    let read =
        reader.read_blocks(&peer, &[0, 1], &[2, 3], None, Duration::from_secs(5), None, None);
    match read.and_then(|transfer| transfer.wait(Some(Duration::from_secs(5)))) {
        Ok(()) => panic!(
            "the reader read through a tampered {peer}: {} bytes copied",
            reader.buf().iter().filter(|&&b| b != 0).count()
        ),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_full_length_garbage_worker_address_is_refused_without_reaching_ucx() {
    in_child("a_full_length_garbage_worker_address_is_refused_without_reaching_ucx", || {
        let error = read_through_a_fake_owner(|meta| {
            meta.worker_address = vec![0xff; meta.worker_address.len()]
        });
        assert!(error.contains("worker_address") && error.contains("version 15"), "{error}");
    });
}

#[test]
fn a_remote_key_cut_to_four_bytes_is_refused_without_reaching_ucx() {
    in_child("a_remote_key_cut_to_four_bytes_is_refused_without_reaching_ucx", || {
        let error = read_through_a_fake_owner(|meta| meta.regions[0].rkey.truncate(4));
        assert!(error.contains("rkey for regions[0]") && error.contains("ends inside"), "{error}");
    });
}

#[test]
fn a_worker_address_or_remote_key_cut_by_one_byte_is_refused() {
    in_child("a_worker_address_or_remote_key_cut_by_one_byte_is_refused", || {
        let error = read_through_a_fake_owner(|meta| {
            meta.worker_address.pop();
        });
        assert!(error.contains("worker_address"), "{error}");
        let error = read_through_a_fake_owner(|meta| {
            meta.regions[0].rkey.pop();
        });
        assert!(error.contains("rkey for regions[0]"), "{error}");
    });
}

#[test]
fn the_untampered_owner_reads_through_the_fake_one() {
    // The control: the same path with the owner's own bytes reads (so the cases above fail
    // for their tampering, not for the fake owner).
    in_child("the_untampered_owner_reads_through_the_fake_one", || {
        let result = std::panic::catch_unwind(|| read_through_a_fake_owner(|_| {}));
        let message =
            result.err().and_then(|p| p.downcast_ref::<String>().cloned()).unwrap_or_default();
        assert!(message.contains("the reader read through"), "{message}");
    });
}
