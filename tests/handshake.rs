//! The handshake without sockets: wire format, fingerprints, auth math, peer states.

use std::time::{Duration, Instant};

use kvduplex::descriptors::BlockLayout;
use kvduplex::handshake::auth::{self, Direction, FrameAuth};
use kvduplex::handshake::peers::{Liveness, LivenessAction};
use kvduplex::handshake::wire::{
    self, ClientHello, Frame, FrameBuffer, FrameKind, Refusal, ServerHello, FRAME_HEADER_LEN,
    MAX_CONTROL_FRAME_LEN, MAX_METADATA_FRAME_LEN,
};
use kvduplex::handshake::{
    decode_metadata, encode_metadata, ConnectDecision, EngineMetadata, Fingerprint, HandshakeError,
    MemoryType, PeerState, PeerTable, RegionInfo, RetryPolicy, SameHostIdentity, FORGET_IDLE_AFTER,
    PROTOCOL_VERSION,
};
use kvduplex::holds::feed::{HeldUpdate, MAX_FINGERPRINTS_PER_UPDATE};
use proptest::prelude::*;

fn fingerprint(fields: &[(&str, &str)]) -> Fingerprint {
    Fingerprint(fields.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
}

fn metadata() -> EngineMetadata {
    EngineMetadata {
        engine_id: "prefill-0".to_owned(),
        generation: 0xdead_beef_0123_4567,
        worker_address: vec![7; 300],
        regions: vec![
            RegionInfo {
                addr: 0x7f00_0000_0000,
                len: 1 << 30,
                rkey: vec![1, 2, 3],
                memory: MemoryType::Cuda,
            },
            RegionInfo { addr: 0x1000, len: 4096, rkey: vec![], memory: MemoryType::Host },
        ],
        layout: Some(BlockLayout {
            segment_bases: vec![0x7f00_0000_0000, 0x7f00_4000_0000],
            block_stride: 65536,
            block_len: 32768,
            num_blocks: 1000,
        }),
        fingerprint: fingerprint(&[
            ("model", "llama-3-8b"),
            ("dtype", "bf16"),
            ("block_size", "16"),
        ]),
        same_host: Some(SameHostIdentity {
            boot_id: "0d5c8f4e-1b2a-4c3d-9e8f-7a6b5c4d3e2f".to_owned(),
            pid: 4242,
            probe_addr: 0x5555_0000_1000,
            proof: [9; 32],
        }),
    }
}

/// A frame of `kind` with the given body, header written by hand.
fn raw_frame(version: u16, kind: u8, body: &[u8]) -> Vec<u8> {
    let mut bytes = wire::MAGIC.to_vec();
    bytes.extend_from_slice(&version.to_be_bytes());
    bytes.push(kind);
    bytes.extend_from_slice(&(body.len() as u32).to_be_bytes());
    bytes.extend_from_slice(body);
    bytes
}

#[test]
fn metadata_round_trips() {
    let m = metadata();
    assert_eq!(decode_metadata(&encode_metadata(&m)).unwrap(), m);
    let no_layout = EngineMetadata { layout: None, regions: vec![], same_host: None, ..m };
    assert_eq!(decode_metadata(&encode_metadata(&no_layout)).unwrap(), no_layout);
}

#[test]
fn every_frame_kind_round_trips() {
    let frames = [
        Frame::ClientHello(ClientHello {
            engine_id: "decode-3".to_owned(),
            fingerprint: fingerprint(&[("tp_size", "2")]),
            nonce: [9; 32],
            has_secret: true,
            heartbeat_ms: 1000,
            side_channel: Some("10.0.0.3:5600".to_owned()),
        }),
        Frame::Lookup(kvduplex::holds::LookupRequest {
            id: 7,
            fingerprints: vec![1, u64::MAX, 3],
            request_id: Some("req-1".into()),
            continues: Some(u64::MAX - 1),
        }),
        Frame::LookupReply(kvduplex::holds::LookupReply {
            id: 7,
            found: Some(kvduplex::holds::LookupMatch {
                owner_request_id: "d-1".to_owned(),
                matched_blocks: 2,
                claim_id: 11,
                claim_ms: 30_000,
                offer: b"{}".to_vec(),
            }),
            not_yet: false,
        }),
        Frame::LookupReply(kvduplex::holds::LookupReply { id: 8, found: None, not_yet: true }),
        Frame::ServerHello(wire::ServerHello {
            nonce: [4; 32],
            has_secret: false,
            heartbeat_ms: 250,
        }),
        Frame::AuthProof(wire::AuthProof { mac: [0xab; 32] }),
        Frame::Refused(Refusal::Incompatible {
            field: "dtype".to_owned(),
            ours: "bf16".to_owned(),
            theirs: "fp8".to_owned(),
        }),
        Frame::Refused(Refusal::Other("because".to_owned())),
        Frame::Metadata(metadata()),
        Frame::Notify(b"req-17:done".to_vec()),
        Frame::Notify(Vec::new()),
        Frame::Ping,
        Frame::Held(HeldUpdate {
            reset: true,
            held: vec![1, u64::MAX, 1],
            freed: vec![],
            synced: true,
        }),
        Frame::Held(HeldUpdate { freed: vec![7], ..HeldUpdate::default() }),
        // The largest update an owner sends fits its frame.
        Frame::Held(HeldUpdate {
            held: vec![u64::MAX; MAX_FINGERPRINTS_PER_UPDATE / 2],
            freed: vec![u64::MAX; MAX_FINGERPRINTS_PER_UPDATE / 2],
            ..HeldUpdate::default()
        }),
    ];
    for frame in frames {
        let bytes = wire::encode_frame(&frame).unwrap();
        assert_eq!(wire::decode_frame(&bytes).unwrap(), frame);
    }
}

#[test]
fn version_mismatch_names_both_versions_before_parsing_the_body() {
    let theirs = PROTOCOL_VERSION + 1;
    // The body is garbage: the version must be reported, not the garbage.
    let bytes = raw_frame(theirs, FrameKind::Metadata as u8, b"\xc1\xc1 not msgpack");
    let err = decode_metadata(&bytes).unwrap_err();
    assert!(
        matches!(err, HandshakeError::ProtocolVersion { ours, theirs: t } if ours == PROTOCOL_VERSION && t == theirs),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(
        message.contains(&PROTOCOL_VERSION.to_string()) && message.contains(&theirs.to_string()),
        "{message}"
    );

    // A stream reports it as soon as the header is complete, before any body byte.
    let mut buffer = FrameBuffer::new();
    buffer.extend(&bytes[..FRAME_HEADER_LEN]);
    assert!(matches!(buffer.next_frame(), Err(HandshakeError::ProtocolVersion { .. })));
}

#[test]
fn oversized_frames_are_refused_from_the_header() {
    let mut header = raw_frame(PROTOCOL_VERSION, FrameKind::Ping as u8, &[]);
    header[7..11].copy_from_slice(&(MAX_CONTROL_FRAME_LEN + 1).to_be_bytes());
    let mut buffer = FrameBuffer::new();
    buffer.extend(&header);
    assert!(matches!(
        buffer.next_frame(),
        Err(HandshakeError::FrameTooLarge { kind: FrameKind::Ping, .. })
    ));

    let mut header = raw_frame(PROTOCOL_VERSION, FrameKind::Metadata as u8, &[]);
    header[7..11].copy_from_slice(&(MAX_METADATA_FRAME_LEN + 1).to_be_bytes());
    assert!(matches!(decode_metadata(&header), Err(HandshakeError::FrameTooLarge { .. })));

    let notify = Frame::Notify(vec![0; wire::MAX_NOTIFY_FRAME_LEN as usize + 1]);
    assert!(matches!(wire::encode_frame(&notify), Err(HandshakeError::FrameTooLarge { .. })));
}

#[test]
fn malformed_input_is_named() {
    let err = decode_metadata(b"GET / HTTP/1.1\r\n\r\n").unwrap_err();
    assert!(matches!(err, HandshakeError::Malformed(ref m) if m.contains("magic")), "{err:?}");
    let err = decode_metadata(&raw_frame(PROTOCOL_VERSION, 99, &[])).unwrap_err();
    assert!(matches!(err, HandshakeError::Malformed(ref m) if m.contains("99")), "{err:?}");
    let err = decode_metadata(&wire::encode_frame(&Frame::Ping).unwrap()).unwrap_err();
    assert!(matches!(err, HandshakeError::Malformed(ref m) if m.contains("Ping")), "{err:?}");
    let mut trailing = encode_metadata(&metadata());
    trailing.push(0);
    assert!(matches!(decode_metadata(&trailing), Err(HandshakeError::Malformed(_))));
    let zero_heartbeat = ClientHello {
        engine_id: String::new(),
        fingerprint: Fingerprint::default(),
        nonce: [0; 32],
        has_secret: false,
        heartbeat_ms: 0,
        side_channel: None,
    };
    let bytes = wire::encode_frame(&Frame::ClientHello(zero_heartbeat)).unwrap();
    assert!(
        matches!(wire::decode_frame(&bytes), Err(HandshakeError::Malformed(m)) if m.contains("heartbeat"))
    );
}

#[test]
fn every_truncation_of_a_valid_encoding_is_an_error() {
    let bytes = encode_metadata(&metadata());
    for len in 0..bytes.len() {
        match decode_metadata(&bytes[..len]) {
            Err(HandshakeError::Truncated { got, needed }) => {
                assert_eq!(got, len);
                assert!(needed > len);
            }
            other => panic!("prefix of {len} bytes gave {other:?}"),
        }
    }
}

#[test]
fn frame_buffer_reassembles_frames_split_anywhere() {
    let frames =
        vec![Frame::Ping, Frame::Metadata(metadata()), Frame::Notify(b"x".to_vec()), Frame::Ping];
    let stream: Vec<u8> = frames.iter().flat_map(|f| wire::encode_frame(f).unwrap()).collect();
    for chunk in [1, 2, 7, 11, 64, stream.len()] {
        let mut buffer = FrameBuffer::new();
        let mut got = Vec::new();
        for piece in stream.chunks(chunk) {
            buffer.extend(piece);
            while let Some(frame) = buffer.next_frame().unwrap() {
                got.push(frame);
            }
        }
        assert_eq!(got, frames, "chunks of {chunk}");
    }
}

fn arb_metadata() -> impl Strategy<Value = EngineMetadata> {
    (
        ".{0,20}",
        any::<u64>(),
        prop::collection::vec(any::<u8>(), 0..64),
        prop::collection::vec(
            (any::<u64>(), any::<u64>(), prop::collection::vec(any::<u8>(), 0..16), any::<bool>()),
            0..4,
        ),
        prop::option::of((
            prop::collection::vec(any::<u64>(), 0..4),
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
        )),
        prop::collection::btree_map(".{0,8}", ".{0,8}", 0..4),
    )
        .prop_map(|(engine_id, generation, worker_address, regions, layout, fields)| {
            EngineMetadata {
                engine_id,
                generation,
                worker_address,
                regions: regions
                    .into_iter()
                    .map(|(addr, len, rkey, cuda)| RegionInfo {
                        addr,
                        len,
                        rkey,
                        memory: if cuda { MemoryType::Cuda } else { MemoryType::Host },
                    })
                    .collect(),
                layout: layout.map(|(segment_bases, block_stride, block_len, num_blocks)| {
                    BlockLayout { segment_bases, block_stride, block_len, num_blocks }
                }),
                fingerprint: Fingerprint(fields),
                same_host: None,
            }
        })
}

proptest! {
    #[test]
    fn random_bytes_never_decode(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        prop_assert!(decode_metadata(&bytes).is_err());
    }

    #[test]
    fn random_bodies_behind_a_valid_header_never_panic(
        kind in 1u8..=10,
        body in prop::collection::vec(any::<u8>(), 0..512),
    ) {
        let bytes = raw_frame(PROTOCOL_VERSION, kind, &body);
        let _ = wire::decode_frame(&bytes);
        let mut buffer = FrameBuffer::new();
        buffer.extend(&bytes);
        let _ = buffer.next_frame();
    }

    #[test]
    fn arbitrary_metadata_round_trips_and_its_truncations_fail(m in arb_metadata(), cut in any::<prop::sample::Index>()) {
        let bytes = encode_metadata(&m);
        prop_assert_eq!(decode_metadata(&bytes).unwrap(), m);
        let len = cut.index(bytes.len());
        prop_assert!(decode_metadata(&bytes[..len]).is_err());
    }

    #[test]
    fn a_tagged_frame_with_any_byte_flipped_is_refused_and_never_decoded(
        payload in prop::collection::vec(any::<u8>(), 0..256),
        at in any::<prop::sample::Index>(),
        bits in 1u8..=255,
    ) {
        let auth = || FrameAuth::new(b"secret", Direction::ClientToServer, &[1; 32]).unwrap();
        let frame = Frame::Notify(payload);
        let mut bytes = wire::encode_frame(&frame).unwrap();
        let tag = auth().tag(&bytes);
        bytes.extend_from_slice(&tag);
        // Intact, it decodes.
        let mut buffer = FrameBuffer::new();
        buffer.authenticate(auth());
        buffer.extend(&bytes);
        prop_assert_eq!(buffer.next_frame().unwrap(), Some(frame));
        // Any flipped byte (header, body or tag) is an error, never a frame.
        let i = at.index(bytes.len());
        bytes[i] ^= bits;
        let mut buffer = FrameBuffer::new();
        buffer.authenticate(auth());
        buffer.extend(&bytes);
        let got = buffer.next_frame();
        prop_assert!(got.is_err() || matches!(got, Ok(None)), "{:?}", got);
    }

    #[test]
    fn flipped_bytes_never_panic(m in arb_metadata(), at in any::<prop::sample::Index>(), bits in 1u8..=255) {
        let mut bytes = encode_metadata(&m);
        let i = at.index(bytes.len());
        bytes[i] ^= bits;
        let _ = decode_metadata(&bytes);
    }
}

#[test]
fn fingerprint_mismatch_names_the_first_differing_field() {
    let ours = fingerprint(&[("model", "m"), ("dtype", "bf16"), ("tp_size", "2")]);
    assert!(ours.check_compatible(&ours.clone()).is_ok());

    let theirs = fingerprint(&[("model", "m"), ("dtype", "fp8"), ("tp_size", "4")]);
    let err = ours.check_compatible(&theirs).unwrap_err();
    assert!(
        matches!(&err, HandshakeError::Incompatible { field, ours, theirs } if field == "dtype" && ours == "bf16" && theirs == "fp8"),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(
        message.contains("dtype") && message.contains("bf16") && message.contains("fp8"),
        "{message}"
    );

    let fewer = fingerprint(&[("model", "m"), ("dtype", "bf16")]);
    let err = ours.check_compatible(&fewer).unwrap_err();
    assert!(
        matches!(&err, HandshakeError::Incompatible { field, ours, theirs } if field == "tp_size" && ours == "2" && theirs == "<missing>"),
        "{err:?}"
    );
    let err = fewer.check_compatible(&ours).unwrap_err();
    assert!(
        matches!(&err, HandshakeError::Incompatible { ours, .. } if ours == "<missing>"),
        "{err:?}"
    );
}

#[test]
fn refusals_are_mirrored_to_the_receivers_view() {
    let sender = HandshakeError::Incompatible {
        field: "dtype".into(),
        ours: "bf16".into(),
        theirs: "fp8".into(),
    };
    let received = Refusal::from_error(&sender).into_peer_error();
    assert!(
        matches!(&received, HandshakeError::Incompatible { field, ours, theirs } if field == "dtype" && ours == "fp8" && theirs == "bf16"),
        "{received:?}"
    );
    let mirrored = |e: HandshakeError| Refusal::from_error(&e).into_peer_error();
    assert!(matches!(mirrored(HandshakeError::AuthFailed), HandshakeError::AuthFailed));
    assert!(matches!(mirrored(HandshakeError::PeerNotAuthenticated), HandshakeError::AuthRequired));
    assert!(matches!(mirrored(HandshakeError::AuthRequired), HandshakeError::PeerNotAuthenticated));
    let version = HandshakeError::ProtocolVersion { ours: 1, theirs: 2 };
    assert!(matches!(mirrored(version), HandshakeError::Refused(m) if m.contains("version")));
}

#[test]
fn proofs_verify_only_with_the_same_secret_transcript_and_direction() {
    let hello = |nonce| ClientHello {
        engine_id: "r".into(),
        fingerprint: Fingerprint::default(),
        nonce,
        has_secret: true,
        heartbeat_ms: 50,
        side_channel: None,
    };
    let server =
        ServerHello { nonce: auth::new_nonce().unwrap(), has_secret: true, heartbeat_ms: 50 };
    let client = hello(auth::new_nonce().unwrap());
    let transcript = wire::transcript(&client, &server);
    let secret = b"correct horse";
    let proof = auth::prove(secret, Direction::ClientToServer, &transcript).unwrap();
    assert!(auth::verify(secret, Direction::ClientToServer, &transcript, &proof).is_ok());

    let fails = |r: Result<(), HandshakeError>| matches!(r, Err(HandshakeError::AuthFailed));
    assert!(fails(auth::verify(b"wrong", Direction::ClientToServer, &transcript, &proof)));
    // Reflection: the client's proof is not a valid server proof.
    assert!(fails(auth::verify(secret, Direction::ServerToClient, &transcript, &proof)));
    // Replay on another connection (other nonces), or hellos a man in the middle changed.
    let other = wire::transcript(&hello(auth::new_nonce().unwrap()), &server);
    assert!(fails(auth::verify(secret, Direction::ClientToServer, &other, &proof)));
    let rewritten =
        wire::transcript(&client, &ServerHello { heartbeat_ms: 60_000, ..server.clone() });
    assert!(fails(auth::verify(secret, Direction::ClientToServer, &rewritten, &proof)));
    let mut tampered = proof;
    tampered[31] ^= 1;
    assert!(fails(auth::verify(secret, Direction::ClientToServer, &transcript, &tampered)));
}

#[test]
fn auth_is_negotiated_only_when_both_sides_have_a_secret() {
    let secret: &[u8] = b"s";
    assert_eq!(auth::negotiate_auth(Some(secret), true).unwrap(), Some(secret));
    assert_eq!(auth::negotiate_auth(None, false).unwrap(), None);
    assert!(matches!(
        auth::negotiate_auth(Some(secret), false),
        Err(HandshakeError::PeerNotAuthenticated)
    ));
    assert!(matches!(auth::negotiate_auth(None, true), Err(HandshakeError::AuthRequired)));
}

fn policy() -> RetryPolicy {
    RetryPolicy { first_backoff: Duration::from_millis(100), max_backoff: Duration::from_secs(5) }
}

#[test]
fn backoff_doubles_up_to_its_cap() {
    let p = policy();
    let waits: Vec<u64> = (1..=9).map(|n| p.backoff(n).as_millis() as u64).collect();
    assert_eq!(waits, [100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000]);
    assert_eq!(p.backoff(u32::MAX), Duration::from_secs(5));
}

#[test]
fn failed_connects_back_off_and_are_never_given_up() {
    let mut table = PeerTable::new(policy());
    let t0 = Instant::now();
    let key = "10.0.0.2:5600";
    assert_eq!(table.state(key), &PeerState::Unknown);
    assert_eq!(table.begin_connect(key, t0), ConnectDecision::Connect { attempt: 1 });
    assert_eq!(table.begin_connect(key, t0), ConnectDecision::InProgress);
    table.on_failed(key, "connection refused", true, t0);
    let retry_at = t0 + Duration::from_millis(100);
    assert_eq!(
        table.state(key),
        &PeerState::Failed {
            error: "connection refused".into(),
            retryable: true,
            attempts: 1,
            retry_at,
        }
    );
    assert_eq!(
        table.begin_connect(key, t0 + Duration::from_millis(99)),
        ConnectDecision::RetryAt {
            at: retry_at,
            error: "connection refused".into(),
            retryable: true,
        }
    );

    // Each failure doubles the wait, measured from the failure, up to the cap; a peer down
    // for minutes is still retried every `max_backoff`.
    let mut now = retry_at;
    let mut expected_wait = Duration::from_millis(200);
    for attempt in 2..=12 {
        assert_eq!(table.begin_connect(key, now), ConnectDecision::Connect { attempt });
        table.on_failed(key, "refused", true, now);
        let PeerState::Failed { retry_at: at, attempts, .. } = table.state(key).clone() else {
            panic!("{:?}", table.state(key));
        };
        assert_eq!((attempts, at - now), (attempt, expected_wait));
        now = at;
        expected_wait = (expected_wait * 2).min(Duration::from_secs(5));
    }

    // A refusal (not retryable) backs off the same way; callers see it is not retryable.
    assert!(matches!(table.begin_connect(key, now), ConnectDecision::Connect { .. }));
    table.on_failed(key, "incompatible", false, now);
    assert!(matches!(
        table.begin_connect(key, now),
        ConnectDecision::RetryAt { retryable: false, .. }
    ));

    // A success resets the count; a dead link makes the next caller connect afresh.
    let later = now + Duration::from_secs(60);
    assert!(matches!(table.begin_connect(key, later), ConnectDecision::Connect { .. }));
    let connection = table.on_ready(key, &metadata()).connection;
    assert_eq!(
        table.begin_connect(key, later),
        ConnectDecision::Ready { engine_id: metadata().engine_id, connection }
    );
    assert!(table.mark_dead(key, connection));
    assert_eq!(table.begin_connect(key, later), ConnectDecision::Connect { attempt: 1 });
    table.on_failed(key, "refused", true, later);
    assert!(matches!(table.state(key), PeerState::Failed { attempts: 1, .. }));
}

#[test]
fn ready_reports_a_generation_change_and_dead_peers_become_unknown() {
    let mut table = PeerTable::new(policy());
    let now = Instant::now();
    let key = "owner:5600";
    let mut m = metadata();
    assert_eq!(table.begin_connect(key, now), ConnectDecision::Connect { attempt: 1 });
    let first = table.on_ready(key, &m);
    assert!(!first.restarted, "a first connection is not a restart");
    assert_eq!(
        table.state(key),
        &PeerState::Ready {
            engine_id: m.engine_id.clone(),
            generation: m.generation,
            connection: first.connection,
        }
    );
    assert_eq!(
        table.begin_connect(key, now),
        ConnectDecision::Ready { engine_id: m.engine_id.clone(), connection: first.connection }
    );

    assert!(table.mark_dead(key, first.connection));
    assert_eq!(table.state(key), &PeerState::Unknown);
    assert_eq!(table.begin_connect(key, now), ConnectDecision::Connect { attempt: 1 });
    let second = table.on_ready(key, &m);
    assert!(!second.restarted, "same generation: the peer only reconnected");
    assert_ne!(second.connection, first.connection, "every connection has its own number");
    // The first connection's death, reported late, does not end the second.
    assert!(!table.mark_dead(key, first.connection));
    assert!(table.is_current(key, second.connection) && !table.is_current(key, first.connection));

    assert!(table.mark_dead(key, second.connection));
    m.generation += 1;
    assert_eq!(table.begin_connect(key, now), ConnectDecision::Connect { attempt: 1 });
    let third = table.on_ready(key, &m);
    assert!(third.restarted, "new generation: the peer restarted");

    // Other peers are independent: a connection number of one address means nothing at another.
    assert_eq!(table.state("other:1"), &PeerState::Unknown);
    assert!(!table.is_current("other:1", third.connection));
    assert!(!table.mark_dead("never-seen:1", third.connection));
    assert_eq!(table.state("never-seen:1"), &PeerState::Unknown);
}

#[test]
fn idle_addresses_are_forgotten_and_those_in_use_kept() {
    let mut table = PeerTable::new(policy());
    let t0 = Instant::now();
    let m = metadata();
    // A dead connection's address, a failed one, a ready one and one connecting.
    for key in ["dead:1", "ready:1", "connecting:1"] {
        table.begin_connect(key, t0);
    }
    let dead = table.on_ready("dead:1", &m).connection;
    assert!(table.mark_dead("dead:1", dead));
    table.on_ready("ready:1", &m);
    table.begin_connect("failed:1", t0);
    table.on_failed("failed:1", "refused", true, t0);
    // Sweeps see them idle (the failed one once its backoff passed), then forget them.
    let later = t0 + Duration::from_secs(1);
    table.begin_connect("other:1", later);
    let forgotten = later + FORGET_IDLE_AFTER;
    table.begin_connect("other:2", forgotten);
    assert_eq!(table.state("dead:1"), &PeerState::Unknown);
    assert_eq!(table.state("failed:1"), &PeerState::Unknown);
    assert!(matches!(table.state("ready:1"), PeerState::Ready { .. }));
    assert_eq!(table.state("connecting:1"), &PeerState::Connecting { attempt: 1 });
    // Forgotten: the failed address starts its backoff afresh, and the dead one's next
    // connection is not taken for a restart (its generation was forgotten too).
    assert_eq!(table.begin_connect("failed:1", forgotten), ConnectDecision::Connect { attempt: 1 });
    assert_eq!(table.begin_connect("dead:1", forgotten), ConnectDecision::Connect { attempt: 1 });
    let again = table.on_ready("dead:1", &EngineMetadata { generation: m.generation + 1, ..m });
    assert!(!again.restarted);
}

#[test]
fn liveness_pings_every_heartbeat_and_declares_death_after_three_silent_ones() {
    let t0 = Instant::now();
    let ms = Duration::from_millis;
    let mut liveness = Liveness::new(t0, ms(100), ms(200));
    assert_eq!(liveness.poll(t0), LivenessAction::Wait(ms(100)));
    assert_eq!(liveness.poll(t0 + ms(100)), LivenessAction::SendPing);
    liveness.on_ping_sent(t0 + ms(100));
    assert_eq!(liveness.poll(t0 + ms(150)), LivenessAction::Wait(ms(50)));
    liveness.on_frame_received(t0 + ms(150));
    liveness.on_ping_sent(t0 + ms(200));
    liveness.on_ping_sent(t0 + ms(700));
    // Silence is measured against the peer's heartbeat: 3 × 200 ms after the last frame.
    assert_eq!(liveness.poll(t0 + ms(740)), LivenessAction::Wait(ms(10)));
    assert_eq!(liveness.poll(t0 + ms(750)), LivenessAction::Dead { silent_for: ms(600) });
}
