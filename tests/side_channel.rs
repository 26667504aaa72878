//! The side channel over real TCP on 127.0.0.1.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, Once};
use std::thread;
use std::time::{Duration, Instant};

use kvduplex::handshake::auth::{self, Direction, FrameAuth, TAG_LEN};
use kvduplex::handshake::wire::{
    self, AuthProof, ClientHello, Frame, FrameBuffer, FrameKind, Refusal, ServerHello,
};
use kvduplex::handshake::{Fingerprint, HandshakeError, PROTOCOL_VERSION};
use kvduplex::holds::{LookupMatch, LookupReply, LookupRequest};
use kvduplex::side_channel::{LookupOutcome, PeerLink, SideChannelConfig, SideChannelServer};

mod common;
use common::*;

/// Captures log lines so tests can check what the server reported on its side.
struct Capture;
static LOGS: Mutex<Vec<String>> = Mutex::new(Vec::new());

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata) -> bool {
        true
    }
    fn log(&self, record: &log::Record) {
        LOGS.lock().unwrap().push(format!("{} {}", record.level(), record.args()));
    }
    fn flush(&self) {}
}

fn capture_logs() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        log::set_logger(&Capture).unwrap();
        log::set_max_level(log::LevelFilter::Info);
    });
}

/// Waits for a server log line containing every one of `parts`.
fn server_logged(parts: &[&str]) -> bool {
    wait_until(Duration::from_secs(2), || {
        LOGS.lock().unwrap().iter().any(|line| parts.iter().all(|part| line.contains(part)))
    })
}

/// A client speaking the protocol by hand, to see exactly what the server sends.
struct RawClient {
    stream: TcpStream,
    frames: FrameBuffer,
    /// Both hellos' hash, once the server answered ours.
    transcript: [u8; 32],
}

impl RawClient {
    fn connect(server: &SideChannelServer) -> Self {
        let stream = TcpStream::connect(server.local_addr()).unwrap();
        stream.set_read_timeout(Some(TIMEOUT)).unwrap();
        Self { stream, frames: FrameBuffer::new(), transcript: [0; 32] }
    }

    fn send(&mut self, frame: &Frame) {
        self.stream.write_all(&wire::encode_frame(frame).unwrap()).unwrap();
    }

    /// The next frame, or `None` once the server closed the connection.
    fn receive(&mut self) -> Option<Result<Frame, HandshakeError>> {
        let mut chunk = [0u8; 4096];
        loop {
            match self.frames.next_frame() {
                Ok(Some(frame)) => return Some(Ok(frame)),
                Ok(None) => {}
                Err(e) => return Some(Err(e)),
            }
            match self.stream.read(&mut chunk) {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.frames.extend(&chunk[..n]),
            }
        }
    }

    /// The whole handshake with `secret`, as a real client; from then on received frames must
    /// carry their tags. Returns the authenticator to tag our frames with.
    fn authenticate(&mut self, engine_id: &str, secret: &[u8]) -> FrameAuth {
        let nonce = [7; 32];
        self.hello(engine_id, fingerprint("bf16"), true, nonce);
        let mac = auth::prove(secret, Direction::ClientToServer, &self.transcript).unwrap();
        self.send(&Frame::AuthProof(AuthProof { mac }));
        assert!(matches!(self.receive(), Some(Ok(Frame::AuthProof(_)))));
        let ours = FrameAuth::new(secret, Direction::ClientToServer, &self.transcript).unwrap();
        let theirs = FrameAuth::new(secret, Direction::ServerToClient, &self.transcript).unwrap();
        // The metadata is the server's first tagged frame.
        self.frames.authenticate(theirs);
        assert!(matches!(self.receive(), Some(Ok(Frame::Metadata(_)))));
        ours
    }

    /// Sends `frame` followed by `tag` (raw bytes, possibly wrong).
    fn send_tagged(&mut self, frame: &Frame, tag: &[u8]) {
        let mut bytes = wire::encode_frame(frame).unwrap();
        bytes.extend_from_slice(tag);
        self.stream.write_all(&bytes).unwrap();
    }

    fn hello(
        &mut self,
        engine_id: &str,
        fp: Fingerprint,
        has_secret: bool,
        nonce: [u8; 32],
    ) -> ServerHello {
        let client_hello = ClientHello {
            engine_id: engine_id.to_owned(),
            fingerprint: fp,
            nonce,
            has_secret,
            heartbeat_ms: 50,
            side_channel: None,
        };
        self.send(&Frame::ClientHello(client_hello.clone()));
        match self.receive() {
            Some(Ok(Frame::ServerHello(hello))) => {
                self.transcript = wire::transcript(&client_hello, &hello);
                hello
            }
            other => panic!("expected a server hello, got {other:?}"),
        }
    }
}

#[test]
fn a_client_fetches_the_metadata() {
    let server = start(None);
    let (link, meta) = connect_as(&server, "reader", &fingerprint("bf16"), None).unwrap();
    assert_eq!(meta, metadata("owner"));
    assert!(link.is_alive());
}

#[test]
fn set_metadata_is_seen_by_later_clients() {
    let server = start(None);
    let (_early, before) = connect_as(&server, "early", &fingerprint("bf16"), None).unwrap();
    let mut updated = metadata("owner");
    updated.worker_address = vec![9; 1000];
    updated.generation = 43;
    server.set_metadata(updated.clone());
    let (_late, after) = connect_as(&server, "late", &fingerprint("bf16"), None).unwrap();
    assert_eq!(before, metadata("owner"));
    assert_eq!(after, updated);
}

#[test]
fn notifications_arrive_once_in_order_with_the_senders_id() {
    let server = start(None);
    let wakes = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&wakes);
    server.set_notification_waker(Box::new(move || {
        counter.fetch_add(1, Ordering::SeqCst);
    }));
    let (a, _) = connect_as(&server, "reader-a", &fingerprint("bf16"), None).unwrap();
    let (b, _) = connect_as(&server, "reader-b", &fingerprint("bf16"), None).unwrap();
    const EACH: usize = 200;
    let senders = [("reader-a", a), ("reader-b", b)].map(|(name, link)| {
        thread::spawn(move || {
            for i in 0..EACH {
                link.notify(format!("{name}:{i}").as_bytes()).unwrap();
            }
            link
        })
    });
    let _links: Vec<PeerLink> = senders.into_iter().map(|t| t.join().unwrap()).collect();

    let mut received = Vec::new();
    assert!(wait_until(TIMEOUT, || {
        received.extend(server.take_notifications());
        received.len() >= 2 * EACH
    }));
    thread::sleep(3 * HEARTBEAT);
    received.extend(server.take_notifications());
    assert_eq!(received.len(), 2 * EACH, "no duplicates");
    for name in ["reader-a", "reader-b"] {
        let payloads: Vec<String> = received
            .iter()
            .filter(|n| n.sender.starts_with(&format!("{name}#")))
            .map(|n| String::from_utf8(n.payload.clone()).unwrap())
            .collect();
        let expected: Vec<String> = (0..EACH).map(|i| format!("{name}:{i}")).collect();
        assert_eq!(payloads, expected);
    }
    assert_eq!(wakes.load(Ordering::SeqCst), 2 * EACH);
    assert!(server.take_notifications().is_empty());
}

#[test]
fn matching_secrets_authenticate() {
    let server = start(Some(b"s3cret"));
    let (link, meta) =
        connect_as(&server, "reader", &fingerprint("bf16"), Some(b"s3cret")).unwrap();
    assert_eq!(meta.engine_id, "owner");
    link.notify(b"hi").unwrap();
    assert!(wait_until(TIMEOUT, || !server.take_notifications().is_empty()));
}

#[test]
fn a_client_without_the_secret_gets_auth_required() {
    capture_logs();
    let server = start(Some(b"s3cret"));
    let err = connect_as(&server, "no-secret-reader", &fingerprint("bf16"), None).unwrap_err();
    assert!(matches!(err, HandshakeError::AuthRequired), "{err:?}");
    assert!(server_logged(&["WARN", "no-secret-reader", "has none"]));
}

#[test]
fn a_wrong_secret_fails_on_both_sides() {
    capture_logs();
    let server = start(Some(b"s3cret"));
    let err = connect_as(&server, "wrong-secret-reader", &fingerprint("bf16"), Some(b"guess"))
        .unwrap_err();
    assert!(matches!(err, HandshakeError::AuthFailed), "{err:?}");
    assert!(server_logged(&["WARN", "wrong-secret-reader", "authentication failed"]));

    // What the server sends a client with a wrong proof.
    let mut raw = RawClient::connect(&server);
    let nonce = [5; 32];
    raw.hello("raw", fingerprint("bf16"), true, nonce);
    let mac = auth::prove(b"guess", Direction::ClientToServer, &raw.transcript).unwrap();
    raw.send(&Frame::AuthProof(AuthProof { mac }));
    assert!(matches!(raw.receive(), Some(Ok(Frame::Refused(Refusal::AuthFailed)))));
}

#[test]
fn a_client_with_a_secret_refuses_a_server_without_one() {
    capture_logs();
    let server = start(None);
    let err =
        connect_as(&server, "secret-reader", &fingerprint("bf16"), Some(b"s3cret")).unwrap_err();
    assert!(matches!(err, HandshakeError::PeerNotAuthenticated), "{err:?}");
    assert!(server_logged(&["WARN", "secret-reader", "requires a shared secret"]));
}

#[test]
fn incompatible_fingerprints_are_refused_on_both_sides_naming_the_field() {
    capture_logs();
    let server = start(None);
    let err = connect_as(&server, "fp8-reader", &fingerprint("fp8"), None).unwrap_err();
    assert!(
        matches!(&err, HandshakeError::Incompatible { field, ours, theirs } if field == "dtype" && ours == "fp8" && theirs == "bf16"),
        "{err:?}"
    );
    assert!(err.to_string().contains("dtype"));
    assert!(server_logged(&["WARN", "fp8-reader", "`dtype` is bf16 here but fp8 on the peer"]));
}

#[test]
fn garbage_and_truncated_clients_leave_the_server_serving() {
    let server = start(None);
    let (survivor, _) = connect_as(&server, "survivor", &fingerprint("bf16"), None).unwrap();

    let mut garbage = TcpStream::connect(server.local_addr()).unwrap();
    garbage.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut reply = Vec::new();
    garbage.set_read_timeout(Some(TIMEOUT)).unwrap();
    let _ = garbage.read_to_end(&mut reply);
    assert!(
        matches!(wire::decode_frame(&reply), Ok(Frame::Refused(Refusal::Other(m))) if m.contains("magic")),
        "{reply:?}"
    );

    // Half a hello, then gone.
    let hello = wire::encode_frame(&Frame::ClientHello(ClientHello {
        engine_id: "half".to_owned(),
        fingerprint: fingerprint("bf16"),
        nonce: [0; 32],
        has_secret: false,
        heartbeat_ms: 100,
        side_channel: None,
    }))
    .unwrap();
    let mut truncated = TcpStream::connect(server.local_addr()).unwrap();
    truncated.write_all(&hello[..hello.len() / 2]).unwrap();
    drop(truncated);

    // A header claiming a huge body.
    let mut huge = TcpStream::connect(server.local_addr()).unwrap();
    let mut header = hello[..wire::FRAME_HEADER_LEN].to_vec();
    header[7..11].copy_from_slice(&u32::MAX.to_be_bytes());
    huge.write_all(&header).unwrap();

    let (link, meta) = connect_as(&server, "next", &fingerprint("bf16"), None).unwrap();
    assert_eq!(meta.engine_id, "owner");
    assert!(link.is_alive() && survivor.is_alive());
    survivor.notify(b"still here").unwrap();
    assert!(wait_until(TIMEOUT, || server
        .take_notifications()
        .iter()
        .any(|n| n.payload == b"still here")));
}

#[test]
fn a_protocol_version_mismatch_is_reported_on_both_sides() {
    let server = start(None);
    let mut future_client = TcpStream::connect(server.local_addr()).unwrap();
    let mut frame = wire::encode_frame(&Frame::Ping).unwrap();
    frame[4..6].copy_from_slice(&(PROTOCOL_VERSION + 1).to_be_bytes());
    future_client.write_all(&frame).unwrap();
    future_client.set_read_timeout(Some(TIMEOUT)).unwrap();
    let mut reply = Vec::new();
    let _ = future_client.read_to_end(&mut reply);

    // The server's refusal is framed in its own version, which is what the newer client sees
    // first; a client of the server's version can read why.
    assert_eq!(&reply[4..6], &PROTOCOL_VERSION.to_be_bytes());
    assert_eq!(reply[6], FrameKind::Refused as u8);
    let Ok(Frame::Refused(Refusal::Other(reason))) = wire::decode_frame(&reply) else {
        panic!("{reply:?}");
    };
    let expected = format!("ours is {PROTOCOL_VERSION}, theirs is {}", PROTOCOL_VERSION + 1);
    assert!(reason.contains(&expected), "{reason}");
}

#[test]
fn a_client_reports_a_server_of_another_version() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let future_server = thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut refusal =
            wire::encode_frame(&Frame::Refused(Refusal::Other("v2 only".to_owned()))).unwrap();
        refusal[4..6].copy_from_slice(&(PROTOCOL_VERSION + 1).to_be_bytes());
        stream.write_all(&refusal).unwrap();
    });
    let err = connect_to(port, "r", &Fingerprint::default(), None, TIMEOUT).unwrap_err();
    assert!(
        matches!(err, HandshakeError::ProtocolVersion { ours, theirs } if ours == PROTOCOL_VERSION && theirs == PROTOCOL_VERSION + 1),
        "{err:?}"
    );
    future_server.join().unwrap();
}

#[test]
fn on_death_fires_when_the_server_shuts_down() {
    let mut server = start(None);
    let (link, _) = connect_as(&server, "reader", &fingerprint("bf16"), None).unwrap();
    let (sender, deaths) = mpsc::channel();
    link.on_death(Box::new(move |reason| sender.send(reason).unwrap()));
    let killed_at = Instant::now();
    server.shutdown();
    let reason = deaths.recv_timeout(3 * HEARTBEAT + Duration::from_millis(500)).unwrap();
    assert!(killed_at.elapsed() < 3 * HEARTBEAT + Duration::from_millis(500), "{reason}");
    assert!(!link.is_alive());
    assert!(deaths.recv_timeout(3 * HEARTBEAT).is_err(), "called once only");
    assert!(matches!(link.notify(b"late"), Err(HandshakeError::PeerGone(_))));

    // Registered after the death: runs at once.
    let (sender, late) = mpsc::channel();
    link.on_death(Box::new(move |reason| sender.send(reason).unwrap()));
    assert_eq!(late.try_recv().unwrap(), reason);
}

#[test]
fn on_death_fires_after_three_silent_heartbeats() {
    // An owner that completes the handshake, then says nothing more.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let owner = thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let mut raw = RawClient { stream, frames: FrameBuffer::new(), transcript: [0; 32] };
        assert!(matches!(raw.receive(), Some(Ok(Frame::ClientHello(_)))));
        raw.send(&Frame::ServerHello(ServerHello {
            nonce: [1; 32],
            has_secret: false,
            heartbeat_ms: 50,
        }));
        raw.send(&Frame::Metadata(metadata("silent-owner")));
        // Keep the socket open (and read the reader's pings) until the reader gives up.
        while raw.receive().is_some() {}
    });
    let connected_at = Instant::now();
    let (link, meta) = connect_to(port, "reader", &fingerprint("bf16"), None, TIMEOUT).unwrap();
    assert_eq!(meta.engine_id, "silent-owner");
    let (sender, deaths) = mpsc::channel();
    link.on_death(Box::new(move |reason| sender.send(reason).unwrap()));
    let reason = deaths.recv_timeout(Duration::from_secs(2)).unwrap();
    let silent = connected_at.elapsed();
    assert!(silent >= Duration::from_millis(150), "declared dead after {silent:?}: {reason}");
    assert!(reason.contains("no frame"), "{reason}");
    drop(link);
    owner.join().unwrap();
}

#[test]
fn the_server_drops_a_client_that_went_silent() {
    let server = start(None);
    let mut raw = RawClient::connect(&server);
    raw.hello("mute", fingerprint("bf16"), false, [3; 32]);
    assert!(matches!(raw.receive(), Some(Ok(Frame::Metadata(_)))));
    // Announced a 50 ms heartbeat and never pings: closed after about 150 ms, with the
    // server's own pings arriving meanwhile.
    let silent_since = Instant::now();
    let mut pings = 0;
    while let Some(frame) = raw.receive() {
        assert!(matches!(frame, Ok(Frame::Ping)));
        pings += 1;
    }
    let closed_after = silent_since.elapsed();
    assert!(closed_after < Duration::from_secs(2), "{closed_after:?}");
    assert!(pings <= 3, "{pings} pings");
}

#[test]
fn shutdown_joins_promptly_with_clients_connected() {
    let mut server = start(Some(b"k"));
    let links: Vec<PeerLink> = (0..4)
        .map(|i| {
            connect_as(&server, &format!("reader-{i}"), &fingerprint("bf16"), Some(b"k")).unwrap().0
        })
        .collect();
    // One that connected and said nothing, one stuck mid-handshake.
    let _idle = TcpStream::connect(server.local_addr()).unwrap();
    let mut mid = RawClient::connect(&server);
    mid.hello("mid", fingerprint("bf16"), true, [2; 32]);
    thread::sleep(Duration::from_millis(50));

    let started = Instant::now();
    server.shutdown();
    assert!(started.elapsed() < Duration::from_secs(1), "shutdown took {:?}", started.elapsed());
    assert!(wait_until(TIMEOUT, || links.iter().all(|l| !l.is_alive())));
    assert!(TcpStream::connect(server.local_addr()).is_err());
    drop(server); // a second shutdown is a no-op
}

#[test]
fn closing_a_link_does_not_report_a_death() {
    let server = start(None);
    let (link, _) = connect_as(&server, "closer", &fingerprint("bf16"), None).unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&calls);
    link.on_death(Box::new(move |_| {
        counter.fetch_add(1, Ordering::SeqCst);
    }));
    link.close();
    thread::sleep(3 * HEARTBEAT);
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

#[test]
fn bad_configurations_and_unreachable_servers_are_errors() {
    let zero = SideChannelConfig { heartbeat: Duration::ZERO, ..SideChannelConfig::default() };
    assert!(matches!(
        SideChannelServer::start(zero, metadata("x")),
        Err(HandshakeError::Config(_))
    ));
    let empty = SideChannelConfig { secret: Some(Vec::new()), ..SideChannelConfig::default() };
    assert!(matches!(
        SideChannelServer::start(empty, metadata("x")),
        Err(HandshakeError::Config(_))
    ));
    let config =
        SideChannelConfig { secret: Some(b"hidden".to_vec()), ..SideChannelConfig::default() };
    assert!(!format!("{config:?}").contains("hidden"));

    // A port nobody listens on.
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let err = connect_to(port, "r", &Fingerprint::default(), None, TIMEOUT).unwrap_err();
    assert!(
        matches!(&err, HandshakeError::Unreachable { address, .. } if address.ends_with(&port.to_string())),
        "{err:?}"
    );

    // A server that accepts and never answers.
    let mute = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = mute.local_addr().unwrap().port();
    let started = Instant::now();
    let err = connect_to(port, "r", &Fingerprint::default(), None, Duration::from_millis(200))
        .unwrap_err();
    assert!(
        matches!(err, HandshakeError::Timeout { waiting_for, .. } if waiting_for.contains("hello")),
        "{err:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(2));
    let _ = mute.accept().map(|(s, _)| s.shutdown(Shutdown::Both));
}

#[test]
fn lookups_are_served_only_after_authentication_and_echo_their_id() {
    let server = start(Some(b"s3cret"));
    let asked = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&asked);
    server.set_lookup_handler(Arc::new(move |reader: &str, request: &LookupRequest| {
        seen.lock().unwrap().push((reader.to_owned(), request.fingerprints.clone()));
        let found = (request.fingerprints.first() == Some(&7)).then(|| LookupMatch {
            owner_request_id: "turn".to_owned(),
            matched_blocks: 1,
            claim_id: 3,
            claim_ms: 1000,
            offer: b"{}".to_vec(),
        });
        LookupReply { id: request.id, found, not_yet: false }
    }));
    // Before any hello: the server refuses and closes, and never consults the hold book.
    let mut raw = RawClient::connect(&server);
    raw.send(&Frame::Lookup(LookupRequest {
        id: 1,
        fingerprints: vec![7],
        request_id: None,
        continues: None,
    }));
    assert!(matches!(raw.receive(), Some(Ok(Frame::Refused(_))) | None));
    assert!(raw.receive().is_none());
    // An authenticated link: each lookup gets its own reply, misses included.
    let (link, _) = connect_as(&server, "reader", &fingerprint("bf16"), Some(b"s3cret")).unwrap();
    let found = ask(&link, vec![7, 8], TIMEOUT).unwrap().found.unwrap();
    assert_eq!((found.owner_request_id.as_str(), found.claim_id), ("turn", 3));
    assert!(ask(&link, vec![9], TIMEOUT).unwrap().found.is_none());
    // Both came on one connection, named by the engine id it announced and its number.
    let asked = asked.lock().unwrap().clone();
    assert_eq!(asked.iter().map(|(_, f)| f.clone()).collect::<Vec<_>>(), vec![vec![7, 8], vec![9]]);
    assert!(asked[0].0.starts_with("reader#") && asked[0].0 == asked[1].0, "{asked:?}");
    // The server's directory only lists clients that announced a side channel.
    assert!(server.known_peers().is_empty());
}

#[test]
fn after_an_authenticated_handshake_untagged_replayed_or_forged_frames_end_the_connection() {
    capture_logs();
    let server = start(Some(b"s3cret"));
    server.set_lookup_handler(Arc::new(|_: &str, request: &LookupRequest| LookupReply {
        id: request.id,
        found: None,
        not_yet: false,
    }));
    let lookup = |id| {
        Frame::Lookup(LookupRequest {
            id,
            fingerprints: vec![1],
            request_id: None,
            continues: None,
        })
    };

    // A correctly tagged lookup is answered with a tagged reply (the buffer checks its tag).
    let mut raw = RawClient::connect(&server);
    let mut ours = raw.authenticate("tagger", b"s3cret");
    let first = wire::encode_frame(&lookup(1)).unwrap();
    let tag = ours.tag(&first);
    raw.send_tagged(&lookup(1), &tag);
    assert!(matches!(raw.receive(), Some(Ok(Frame::LookupReply(LookupReply { id: 1, .. })))));
    // The same frame and tag again (a replay): the server drops the connection.
    raw.send_tagged(&lookup(1), &tag);
    assert!(raw.receive().is_none());
    assert!(server_logged(&["tagger", "does not carry this connection's tag"]));

    // Untagged (what an injector without the secret can write), and a wrong tag.
    for (name, tag) in [("untagged", Vec::new()), ("forger", vec![0u8; TAG_LEN])] {
        let mut raw = RawClient::connect(&server);
        raw.authenticate(name, b"s3cret");
        raw.send_tagged(&lookup(2), &tag);
        if tag.is_empty() {
            // The next frame's header is then read where the tag should be.
            raw.send_tagged(&lookup(3), &[]);
        }
        assert!(raw.receive().is_none(), "{name}");
        assert!(server_logged(&[name, "does not carry this connection's tag"]), "{name}");
    }

    // A real link keeps working throughout.
    let (link, _) = connect_as(&server, "reader", &fingerprint("bf16"), Some(b"s3cret")).unwrap();
    assert!(ask(&link, vec![1], TIMEOUT).unwrap().found.is_none());
    link.notify(b"after many frames").unwrap();
    assert!(ask(&link, vec![1], TIMEOUT).unwrap().found.is_none());
}

#[test]
fn a_lookup_to_a_silent_or_dead_owner_fails_instead_of_hanging() {
    let server = start(None);
    server.set_lookup_handler(Arc::new(|_: &str, request: &LookupRequest| {
        // Slower than the reader waits, faster than three heartbeats (the link stays alive).
        thread::sleep(Duration::from_millis(150));
        LookupReply { id: request.id, found: None, not_yet: false }
    }));
    let (link, _) = connect_as(&server, "reader", &fingerprint("bf16"), None).unwrap();
    // A reply later than the lookup's timeout counts as none.
    let err = ask(&link, vec![1], Duration::from_millis(50)).unwrap_err();
    assert!(matches!(err, HandshakeError::Timeout { .. }), "{err}");
    // A lookup still waiting past its timeout ends when the next one is sent, whatever the
    // owner does meanwhile.
    let (tx, outcomes) = mpsc::channel();
    let first = tx.clone();
    link.send_lookup(
        vec![1],
        None,
        None,
        Duration::from_millis(50),
        Box::new(move |outcome| drop(first.send(("first", outcome)))),
    );
    thread::sleep(Duration::from_millis(60));
    link.send_lookup(
        vec![1],
        None,
        None,
        TIMEOUT,
        Box::new(move |outcome| drop(tx.send(("second", outcome)))),
    );
    let (which, outcome) =
        outcomes.try_recv().expect("the first lookup ended when the second was sent");
    assert!(
        which == "first" && matches!(outcome, Err(HandshakeError::Timeout { .. })),
        "{which}: {outcome:?}"
    );
    // The link keeps working: the second lookup gets its reply.
    let (which, outcome) = outcomes.recv_timeout(TIMEOUT).unwrap();
    assert!(
        which == "second" && matches!(outcome, Ok(LookupReply { found: None, .. })),
        "{which}: {outcome:?}"
    );
    // A lookup waiting when the owner goes fails with it, and so does one sent afterwards.
    let (tx, outcome) = mpsc::channel();
    link.send_lookup(
        vec![1],
        None,
        None,
        Duration::from_secs(60),
        Box::new(move |o| drop(tx.send(o))),
    );
    drop(server);
    let outcome = outcome.recv_timeout(TIMEOUT).unwrap();
    assert!(
        matches!(outcome, Err(HandshakeError::PeerGone(_)) | Ok(LookupReply { found: None, .. })),
        "{outcome:?}"
    );
    assert!(wait_until(TIMEOUT, || !link.is_alive()));
    assert!(matches!(ask(&link, vec![1], TIMEOUT), Err(HandshakeError::PeerGone(_))));
}

/// A lookup's outcome, waited for (the link hands it over on its own thread).
fn ask(link: &PeerLink, fingerprints: Vec<u64>, timeout: Duration) -> LookupOutcome {
    let (tx, outcome) = mpsc::channel();
    link.send_lookup(fingerprints, None, None, timeout, Box::new(move |o| drop(tx.send(o))));
    outcome.recv_timeout(timeout + TIMEOUT).expect("the lookup's outcome was never handed over")
}

#[test]
fn an_unauthenticated_client_cannot_make_the_server_buffer_a_large_frame() {
    let server = start(Some(b"s3cret"));
    let mut raw = RawClient::connect(&server);
    // Only the header of a 1 MiB notification, before any hello: refused at the header.
    let mut header = Vec::from(wire::MAGIC);
    header.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    header.push(FrameKind::Notify as u8);
    header.extend_from_slice(&(1u32 << 20).to_be_bytes());
    raw.stream.write_all(&header).unwrap();
    let started = Instant::now();
    assert!(matches!(raw.receive(), Some(Ok(Frame::Refused(_))) | None));
    assert!(started.elapsed() < Duration::from_secs(3), "the server waited for the body");
    // An authenticated client still gets large frames (a big notification) through.
    let (link, _) = connect_as(&server, "reader", &fingerprint("bf16"), Some(b"s3cret")).unwrap();
    link.notify(&vec![7u8; 512 << 10]).unwrap();
    assert!(wait_until(TIMEOUT, || server.take_notifications().len() == 1));
}

#[test]
fn metadata_with_an_empty_worker_address_or_rkey_is_refused_naming_the_field() {
    let mut meta = metadata("owner");
    assert!(meta.validate().is_ok());
    meta.worker_address.clear();
    let err = meta.validate().unwrap_err().to_string();
    assert!(err.contains("worker_address"), "{err}");
    let mut meta = metadata("owner");
    meta.regions.push(kvduplex::handshake::RegionInfo {
        addr: 4096,
        len: 4096,
        rkey: vec![],
        memory: kvduplex::handshake::MemoryType::Host,
    });
    let err = meta.validate().unwrap_err().to_string();
    assert!(err.contains("regions[0]") && err.contains("rkey"), "{err}");
}

#[test]
fn a_non_loopback_side_channel_needs_a_secret_unless_allowed_explicitly() {
    let open = SideChannelConfig { host: "0.0.0.0".to_owned(), ..SideChannelConfig::default() };
    let err = SideChannelServer::start(open.clone(), metadata("x")).err().expect("refused");
    assert!(err.to_string().contains("without a shared secret"), "{err}");
    let with_secret = SideChannelConfig { secret: Some(b"s".to_vec()), ..open.clone() };
    SideChannelServer::start(with_secret, metadata("x")).unwrap();
    let allowed = SideChannelConfig { allow_unauthenticated: true, ..open };
    SideChannelServer::start(allowed, metadata("x")).unwrap();
    for host in ["127.0.0.1", "localhost", "::1"] {
        let local = SideChannelConfig { host: host.to_owned(), ..SideChannelConfig::default() };
        SideChannelServer::start(local, metadata("x")).unwrap();
    }
}
