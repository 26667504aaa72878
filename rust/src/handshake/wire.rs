//! Frames on the side channel.
//!
//! Every frame is `MAGIC (4) | version (u16 BE) | kind (u8) | body length (u32 BE) | body`.
//! The header is checked before the body is looked at, so a peer speaking another protocol
//! version is reported as such rather than as garbage, and a length over the kind's cap is
//! refused before any of it is buffered. Bodies are msgpack, except `Notify` (the opaque
//! payload itself) and `Ping` (empty). After a handshake with a shared secret, each frame is
//! followed by its [`FrameAuth`] tag ([`TAG_LEN`] bytes).

use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::auth::{FrameAuth, Nonce, Proof, Transcript, TAG_LEN};
use super::{EngineMetadata, Fingerprint, HandshakeError, PROTOCOL_VERSION};
use crate::holds::feed::HeldUpdate;
use crate::holds::{LookupReply, LookupRequest};

pub const MAGIC: [u8; 4] = *b"KVDX";
pub const FRAME_HEADER_LEN: usize = 11;
/// Region lists and worker addresses of a large engine stay well under this.
pub const MAX_METADATA_FRAME_LEN: u32 = 16 << 20;
/// A notification carries request ids, not data.
pub const MAX_NOTIFY_FRAME_LEN: u32 = 1 << 20;
/// A lookup carries one fingerprint per block of a prompt; its reply the owner's offer
/// (`holds::MAX_FINGERPRINTS` and `holds::MAX_OFFER_BYTES` fit).
pub const MAX_LOOKUP_FRAME_LEN: u32 = 1 << 20;
/// An owner's announcement of what it holds (`feed::MAX_FINGERPRINTS_PER_UPDATE` fit).
pub const MAX_HELD_FRAME_LEN: u32 = 1 << 20;
/// Hellos, proofs, refusals and pings.
pub const MAX_CONTROL_FRAME_LEN: u32 = 64 << 10;
/// Bounds the heartbeat a peer may announce, so its death is noticed within minutes at most.
pub const MAX_HEARTBEAT: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    ClientHello = 1,
    ServerHello = 2,
    AuthProof = 3,
    Refused = 4,
    Metadata = 5,
    Notify = 6,
    Ping = 7,
    Lookup = 8,
    LookupReply = 9,
    Held = 10,
}

impl FrameKind {
    fn from_byte(byte: u8) -> Option<Self> {
        Some(match byte {
            1 => Self::ClientHello,
            2 => Self::ServerHello,
            3 => Self::AuthProof,
            4 => Self::Refused,
            5 => Self::Metadata,
            6 => Self::Notify,
            7 => Self::Ping,
            8 => Self::Lookup,
            9 => Self::LookupReply,
            10 => Self::Held,
            _ => return None,
        })
    }

    pub fn max_body_len(self) -> u32 {
        match self {
            Self::Metadata => MAX_METADATA_FRAME_LEN,
            Self::Notify => MAX_NOTIFY_FRAME_LEN,
            Self::Lookup | Self::LookupReply => MAX_LOOKUP_FRAME_LEN,
            Self::Held => MAX_HELD_FRAME_LEN,
            _ => MAX_CONTROL_FRAME_LEN,
        }
    }
}

/// First frame of a connection, client to server.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientHello {
    pub engine_id: String,
    pub fingerprint: Fingerprint,
    pub nonce: Nonce,
    pub has_secret: bool,
    /// How often the client pings; the server declares it dead after three silent intervals.
    pub heartbeat_ms: u32,
    /// Where the client's own side channel listens ("host:port"), so the server can find it
    /// later (a prefill node looks up held turns on the decode nodes that read from it).
    #[serde(default)]
    pub side_channel: Option<String>,
}

/// The hash both sides prove over: the two hellos as this side sent or received them, in
/// their canonical encoding (a re-encoding of what was decoded, so a field a man in the middle
/// changed, added or dropped changes it).
pub fn transcript(client: &ClientHello, server: &ServerHello) -> Transcript {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for body in [msgpack(client), msgpack(server)] {
        h.update((body.len() as u64).to_le_bytes());
        h.update(&body);
    }
    h.finalize().into()
}

/// The server's answer to a [`ClientHello`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerHello {
    pub nonce: Nonce,
    pub has_secret: bool,
    /// How often the server pings; the client declares it dead after three silent intervals.
    pub heartbeat_ms: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthProof {
    pub mac: Proof,
}

/// Why the sender ends the handshake, worded from the sender's side.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Refusal {
    AuthRequired,
    AuthFailed,
    PeerNotAuthenticated,
    Incompatible { field: String, ours: String, theirs: String },
    Other(String),
}

impl Refusal {
    /// What to tell the peer about `error`, which ended our side of the handshake.
    pub fn from_error(error: &HandshakeError) -> Self {
        match error {
            HandshakeError::AuthRequired => Self::AuthRequired,
            HandshakeError::AuthFailed => Self::AuthFailed,
            HandshakeError::PeerNotAuthenticated => Self::PeerNotAuthenticated,
            HandshakeError::Incompatible { field, ours, theirs } => Self::Incompatible {
                field: field.clone(),
                ours: ours.clone(),
                theirs: theirs.clone(),
            },
            other => Self::Other(other.to_string()),
        }
    }

    /// The error the receiver reports: the sender's view mirrored, so "ours" is the
    /// receiver's value and a missing secret is blamed on the right side.
    pub fn into_peer_error(self) -> HandshakeError {
        match self {
            Self::AuthRequired => HandshakeError::PeerNotAuthenticated,
            Self::PeerNotAuthenticated => HandshakeError::AuthRequired,
            Self::AuthFailed => HandshakeError::AuthFailed,
            Self::Incompatible { field, ours, theirs } => {
                HandshakeError::Incompatible { field, ours: theirs, theirs: ours }
            }
            Self::Other(reason) => HandshakeError::Refused(reason),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    ClientHello(ClientHello),
    ServerHello(ServerHello),
    AuthProof(AuthProof),
    Refused(Refusal),
    Metadata(EngineMetadata),
    Notify(Vec<u8>),
    Ping,
    Lookup(LookupRequest),
    LookupReply(LookupReply),
    /// Owner to reader: what the owner's lookups can now find, or no longer.
    Held(HeldUpdate),
}

impl Frame {
    pub fn kind(&self) -> FrameKind {
        match self {
            Self::ClientHello(_) => FrameKind::ClientHello,
            Self::ServerHello(_) => FrameKind::ServerHello,
            Self::AuthProof(_) => FrameKind::AuthProof,
            Self::Refused(_) => FrameKind::Refused,
            Self::Metadata(_) => FrameKind::Metadata,
            Self::Notify(_) => FrameKind::Notify,
            Self::Ping => FrameKind::Ping,
            Self::Lookup(_) => FrameKind::Lookup,
            Self::LookupReply(_) => FrameKind::LookupReply,
            Self::Held(_) => FrameKind::Held,
        }
    }
}

/// The frame's bytes, or `FrameTooLarge` when its body exceeds the kind's cap (the peer
/// would refuse it).
pub fn encode_frame(frame: &Frame) -> Result<Vec<u8>, HandshakeError> {
    let encoded;
    let body: &[u8] = match frame {
        Frame::Notify(payload) => payload,
        Frame::Ping => &[],
        Frame::ClientHello(hello) => {
            encoded = msgpack(hello);
            &encoded
        }
        Frame::ServerHello(hello) => {
            encoded = msgpack(hello);
            &encoded
        }
        Frame::AuthProof(proof) => {
            encoded = msgpack(proof);
            &encoded
        }
        Frame::Refused(refusal) => {
            encoded = msgpack(refusal);
            &encoded
        }
        Frame::Metadata(metadata) => {
            encoded = msgpack(metadata);
            &encoded
        }
        Frame::Lookup(lookup) => {
            encoded = msgpack(lookup);
            &encoded
        }
        Frame::LookupReply(reply) => {
            encoded = msgpack(reply);
            &encoded
        }
        Frame::Held(update) => {
            encoded = msgpack(update);
            &encoded
        }
    };
    within_cap(frame.kind(), body)
}

/// Like [`encode_frame`] for a metadata frame, without moving the metadata into a [`Frame`].
pub fn encode_metadata_frame(metadata: &EngineMetadata) -> Result<Vec<u8>, HandshakeError> {
    within_cap(FrameKind::Metadata, &msgpack(metadata))
}

fn within_cap(kind: FrameKind, body: &[u8]) -> Result<Vec<u8>, HandshakeError> {
    let max = kind.max_body_len();
    match u32::try_from(body.len()) {
        Ok(len) if len <= max => Ok(with_header(kind, len, body)),
        _ => {
            Err(HandshakeError::FrameTooLarge { kind, len: body.len() as u64, max: u64::from(max) })
        }
    }
}

/// The metadata frame without the size check; a body over the cap (or over 4 GiB, which the
/// length field then understates as `u32::MAX`) is refused by the receiver's decoder.
pub(super) fn encode_metadata(metadata: &EngineMetadata) -> Vec<u8> {
    let body = msgpack(metadata);
    let len = u32::try_from(body.len()).unwrap_or(u32::MAX);
    with_header(FrameKind::Metadata, len, &body)
}

fn with_header(kind: FrameKind, len: u32, body: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(FRAME_HEADER_LEN + body.len());
    bytes.extend_from_slice(&MAGIC);
    bytes.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    bytes.push(kind as u8);
    bytes.extend_from_slice(&len.to_be_bytes());
    bytes.extend_from_slice(body);
    bytes
}

fn msgpack(body: &impl Serialize) -> Vec<u8> {
    // Our bodies are structs of strings, integers, byte vectors and string-keyed maps, all of
    // which msgpack can represent; serializing them into a Vec has no failure mode.
    rmp_serde::to_vec_named(body).expect("msgpack encoding of a side-channel body cannot fail")
}

/// Parses exactly one frame; trailing bytes are an error.
pub fn decode_frame(bytes: &[u8]) -> Result<Frame, HandshakeError> {
    let Some(header) = parse_header(bytes)? else {
        return Err(HandshakeError::Truncated { got: bytes.len(), needed: FRAME_HEADER_LEN });
    };
    let needed = header.frame_len();
    if bytes.len() < needed {
        return Err(HandshakeError::Truncated { got: bytes.len(), needed });
    }
    if bytes.len() > needed {
        return Err(HandshakeError::Malformed(format!(
            "{} bytes after the end of a {needed}-byte {:?} frame",
            bytes.len() - needed,
            header.kind
        )));
    }
    decode_body(header.kind, &bytes[FRAME_HEADER_LEN..])
}

/// Reassembles frames from a byte stream that arrives in arbitrary pieces (reads may time
/// out mid-frame). Holds at most one frame's worth of bytes beyond what was pushed last.
#[derive(Debug, Default)]
pub struct FrameBuffer {
    bytes: Vec<u8>,
    /// A cap on every frame's body below the kinds' own (before authentication).
    limit: Option<u32>,
    /// After an authenticated handshake: every frame is followed by its tag, checked here.
    auth: Option<FrameAuth>,
}

impl FrameBuffer {
    pub fn new() -> Self {
        Self::default()
    }

    /// Refuse frames whose body exceeds `limit` whatever their kind (`None`: the kinds' caps).
    /// A server keeps unauthenticated clients to hello-sized frames this way.
    pub fn set_limit(&mut self, limit: Option<u32>) {
        self.limit = limit;
    }

    /// From the next frame on, every frame must be followed by its [`FrameAuth`] tag.
    pub fn authenticate(&mut self, auth: FrameAuth) {
        self.auth = Some(auth);
    }

    pub fn extend(&mut self, bytes: &[u8]) {
        self.bytes.extend_from_slice(bytes);
    }

    /// The next complete frame, `None` while more bytes are needed. A bad header is reported
    /// as soon as it is complete, before its body arrives.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, HandshakeError> {
        let Some(header) = parse_header(&self.bytes)? else {
            return Ok(None);
        };
        if let Some(limit) = self.limit.filter(|limit| header.body_len > *limit) {
            return Err(HandshakeError::FrameTooLarge {
                kind: header.kind,
                len: u64::from(header.body_len),
                max: u64::from(limit),
            });
        }
        let frame_len = header.frame_len();
        let tag_len = if self.auth.is_some() { TAG_LEN } else { 0 };
        if self.bytes.len() < frame_len + tag_len {
            return Ok(None);
        }
        if let Some(auth) = &mut self.auth {
            auth.check(&self.bytes[..frame_len], &self.bytes[frame_len..frame_len + tag_len])?;
        }
        let frame = decode_body(header.kind, &self.bytes[FRAME_HEADER_LEN..frame_len]);
        self.bytes.drain(..frame_len + tag_len);
        frame.map(Some)
    }
}

struct FrameHeader {
    kind: FrameKind,
    body_len: u32,
}

impl FrameHeader {
    fn frame_len(&self) -> usize {
        FRAME_HEADER_LEN + self.body_len as usize
    }
}

/// `None` while the header is incomplete; a wrong magic is reported from its first byte on.
fn parse_header(bytes: &[u8]) -> Result<Option<FrameHeader>, HandshakeError> {
    let magic_seen = &bytes[..bytes.len().min(MAGIC.len())];
    if magic_seen != &MAGIC[..magic_seen.len()] {
        return Err(HandshakeError::Malformed(format!(
            "frame starts with {magic_seen:02x?}, expected the magic {MAGIC:02x?}"
        )));
    }
    let Some(header) = bytes.get(..FRAME_HEADER_LEN) else {
        return Ok(None);
    };
    let theirs = u16::from_be_bytes([header[4], header[5]]);
    if theirs != PROTOCOL_VERSION {
        return Err(HandshakeError::ProtocolVersion { ours: PROTOCOL_VERSION, theirs });
    }
    let kind = FrameKind::from_byte(header[6])
        .ok_or_else(|| HandshakeError::Malformed(format!("unknown frame kind {}", header[6])))?;
    let body_len = u32::from_be_bytes([header[7], header[8], header[9], header[10]]);
    let max = kind.max_body_len();
    if body_len > max {
        return Err(HandshakeError::FrameTooLarge {
            kind,
            len: u64::from(body_len),
            max: u64::from(max),
        });
    }
    Ok(Some(FrameHeader { kind, body_len }))
}

fn decode_body(kind: FrameKind, body: &[u8]) -> Result<Frame, HandshakeError> {
    Ok(match kind {
        FrameKind::ClientHello => {
            let hello: ClientHello = from_msgpack(kind, body)?;
            check_heartbeat(hello.heartbeat_ms)?;
            Frame::ClientHello(hello)
        }
        FrameKind::ServerHello => {
            let hello: ServerHello = from_msgpack(kind, body)?;
            check_heartbeat(hello.heartbeat_ms)?;
            Frame::ServerHello(hello)
        }
        FrameKind::AuthProof => Frame::AuthProof(from_msgpack(kind, body)?),
        FrameKind::Refused => Frame::Refused(from_msgpack(kind, body)?),
        FrameKind::Metadata => Frame::Metadata(from_msgpack(kind, body)?),
        FrameKind::Notify => Frame::Notify(body.to_vec()),
        FrameKind::Lookup => Frame::Lookup(from_msgpack(kind, body)?),
        FrameKind::LookupReply => Frame::LookupReply(from_msgpack(kind, body)?),
        FrameKind::Held => Frame::Held(from_msgpack(kind, body)?),
        FrameKind::Ping if body.is_empty() => Frame::Ping,
        FrameKind::Ping => {
            return Err(HandshakeError::Malformed(format!(
                "Ping frame with a {}-byte body",
                body.len()
            )))
        }
    })
}

fn from_msgpack<T: DeserializeOwned>(kind: FrameKind, body: &[u8]) -> Result<T, HandshakeError> {
    // `from_slice` borrows from the body, so a length inside the msgpack that exceeds the
    // body fails instead of allocating what it claims.
    rmp_serde::from_slice(body)
        .map_err(|e| HandshakeError::Malformed(format!("{kind:?} body: {e}")))
}

fn check_heartbeat(heartbeat_ms: u32) -> Result<(), HandshakeError> {
    let max_ms = MAX_HEARTBEAT.as_millis();
    if heartbeat_ms == 0 || u128::from(heartbeat_ms) > max_ms {
        return Err(HandshakeError::Malformed(format!(
            "heartbeat of {heartbeat_ms} ms is outside 1..={max_ms} ms"
        )));
    }
    Ok(())
}

/// A heartbeat as announced in a hello; `Config` when zero or over [`MAX_HEARTBEAT`].
pub fn heartbeat_ms(heartbeat: Duration) -> Result<u32, HandshakeError> {
    match u32::try_from(heartbeat.as_millis()) {
        Ok(ms) if ms > 0 && heartbeat <= MAX_HEARTBEAT => Ok(ms),
        _ => Err(HandshakeError::Config(format!(
            "heartbeat {heartbeat:?} is outside 1 ms..={MAX_HEARTBEAT:?}"
        ))),
    }
}
