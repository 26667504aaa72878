//! Bounds under hostile clients, measured on this process: its own test binary, each test
//! alone (a shared lock), so no other test's threads or memory are counted.

use std::io::Write;
use std::net::TcpStream;
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};

use kvduplex::handshake::wire::{self, FrameKind};
use kvduplex::handshake::PROTOCOL_VERSION;
use kvduplex::side_channel::{
    PeerLink, SideChannelConfig, SideChannelServer, MAX_CONNECTIONS_PER_ADDRESS,
    MAX_QUEUED_NOTIFICATION_BYTES,
};

mod common;
use common::*;

/// Held by every test here: each measures the whole process.
static ALONE: Mutex<()> = Mutex::new(());

fn threads_of_this_process() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("Threads:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn idle_sockets_keep_threads_bounded_and_never_lock_out_a_real_peer() {
    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
    let server = start(Some(b"s3cret"));
    let before = threads_of_this_process();
    // 2,000 sockets that never say hello (the process allows 20,000 descriptors here).
    let idle: Vec<TcpStream> =
        (0..2000).map(|_| TcpStream::connect(server.local_addr()).unwrap()).collect();
    thread::sleep(Duration::from_millis(500));
    let during = threads_of_this_process();
    assert!(
        during <= before + kvduplex::side_channel::MAX_PENDING_HANDSHAKES + 8,
        "{before} threads before, {during} with 2,000 idle sockets"
    );
    // A peer with the secret still connects (within the usual timeout) and is served.
    let (link, _) = connect_as(&server, "reader", &fingerprint("bf16"), Some(b"s3cret")).unwrap();
    link.notify(b"still served").unwrap();
    assert!(wait_until(TIMEOUT, || server.take_notifications().len() == 1));
    drop(idle);
}

fn resident_mib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() / 1024
}

#[test]
fn clients_that_never_finish_a_hello_keep_memory_and_threads_bounded() {
    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
    let server = start(Some(b"s3cret"));
    let (threads_before, rss_before) = (threads_of_this_process(), resident_mib());
    // 1,000 clients each send a hello header announcing the largest body allowed before
    // authentication, then all of it but the last byte: 63 MiB in all, none of it a frame.
    let body = wire::MAX_CONTROL_FRAME_LEN as usize;
    let mut header = Vec::from(wire::MAGIC);
    header.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    header.push(FrameKind::ClientHello as u8);
    header.extend_from_slice(&(body as u32).to_be_bytes());
    let partial = [header, vec![0xA5; body - 1]].concat();
    let mut clients = Vec::new();
    let (mut threads_peak, mut rss_peak) = (0, 0);
    for i in 0..1000 {
        let Ok(mut stream) = TcpStream::connect(server.local_addr()) else { continue };
        stream.set_write_timeout(Some(Duration::from_millis(200))).unwrap();
        // The server closes the oldest pending handshakes: a write may fail, which is fine.
        let _ = stream.write_all(&partial);
        clients.push(stream);
        if i % 100 == 99 {
            threads_peak = threads_peak.max(threads_of_this_process());
            rss_peak = rss_peak.max(resident_mib());
        }
    }
    let threads_growth = threads_peak.saturating_sub(threads_before);
    let rss_growth = rss_peak.saturating_sub(rss_before);
    println!(
        "1,000 unfinished hellos: +{threads_growth} threads, +{rss_growth} MiB resident at most"
    );
    // At most MAX_PENDING_HANDSHAKES connections wait, each with under one frame buffered.
    assert!(
        threads_growth <= kvduplex::side_channel::MAX_PENDING_HANDSHAKES + 8,
        "+{threads_growth} threads"
    );
    assert!(rss_growth <= 32, "+{rss_growth} MiB resident for clients that never said hello");
    // A real peer is still served.
    let (link, _) = connect_as(&server, "reader", &fingerprint("bf16"), Some(b"s3cret")).unwrap();
    link.notify(b"still served").unwrap();
    assert!(wait_until(TIMEOUT, || server.take_notifications().len() == 1));
    drop(clients);
}

/// A server and its clients with slow heartbeats: the links of the tests below stay alive on a
/// busy machine whatever they send or however long they idle.
const SLOW: Duration = Duration::from_secs(10);

fn slow_server() -> SideChannelServer {
    SideChannelServer::start(
        SideChannelConfig { heartbeat: SLOW, ..Default::default() },
        metadata("owner"),
    )
    .unwrap()
}

fn slow_connect(
    server: &SideChannelServer,
    id: &str,
) -> Result<PeerLink, kvduplex::handshake::HandshakeError> {
    PeerLink::connect(
        "127.0.0.1",
        server.local_addr().port(),
        id,
        None,
        &fingerprint("bf16"),
        None,
        TIMEOUT,
        SLOW,
        None,
    )
    .map(|(link, _)| link)
}

#[test]
fn a_flood_of_large_notifications_is_bounded_in_bytes_dropped_and_counted() {
    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
    let server = slow_server();
    let rss_before = resident_mib();
    // 500 notifications of 1 MiB (the frame cap) that nobody takes: 500 MiB without a bound.
    let link = slow_connect(&server, "flooder").unwrap();
    let payload = vec![7u8; wire::MAX_NOTIFY_FRAME_LEN as usize];
    for _ in 0..500 {
        // The link queues what the server has not read yet, up to its own bound.
        if link.notify(&payload).is_err() {
            assert!(link.flush(Instant::now() + TIMEOUT));
            link.notify(&payload).unwrap();
        }
    }
    let bound = MAX_QUEUED_NOTIFICATION_BYTES;
    let fits = (bound / payload.len()) as u64;
    assert!(
        wait_until(Duration::from_secs(30), || server.dropped_notifications() == 500 - fits),
        "{} dropped",
        server.dropped_notifications()
    );
    let grew = resident_mib().saturating_sub(rss_before);
    assert_eq!(server.queued_notification_bytes(), fits as usize * payload.len());
    assert!(
        grew < (bound >> 20) as u64 + 64,
        "the process grew by {grew} MiB with a {} MiB bound",
        bound >> 20
    );
    // Taking them frees the room: new ones are queued again.
    assert_eq!(server.take_notifications().len() as u64, fits);
    link.notify(b"req-1").unwrap();
    assert!(wait_until(TIMEOUT, || server.queued_notification_bytes() == 5));
}

#[test]
fn one_address_cannot_take_every_connection_slot() {
    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
    let server = slow_server();
    // Unauthenticated clients (no secret: loopback) that finish the handshake and then idle.
    let mut links: Vec<_> = (0..MAX_CONNECTIONS_PER_ADDRESS)
        .map(|i| slow_connect(&server, &format!("idler-{i}")).unwrap())
        .collect();
    let err = slow_connect(&server, "one-too-many").unwrap_err();
    assert!(err.to_string().contains("connections from one address"), "{err}");
    // One leaving frees its slot for the next.
    drop(links.pop());
    assert!(wait_until(TIMEOUT, || slow_connect(&server, "next").is_ok()));
}
