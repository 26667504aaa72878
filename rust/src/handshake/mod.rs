//! The side-channel handshake, without sockets: what engines tell each other before any KV
//! block moves, how it is framed on the wire, how a shared secret is proven, and how the
//! state of each remote engine evolves over time.
//!
//! Everything here is deterministic: randomness comes in as nonces and time as `now`, so the
//! protocol can be tested without a network. The sockets live in [`crate::side_channel`].

pub mod auth;
pub mod peers;
pub mod wire;

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use peers::{ConnectDecision, Connected, PeerState, PeerTable, RetryPolicy, FORGET_IDLE_AFTER};
use wire::{Frame, FrameKind};

/// Version of the side-channel protocol. The frame header's magic and version fields keep
/// their place in every future version so that a mismatch is always reported as one.
/// 2: lookups of held turns (Lookup/LookupReply frames, the client's side channel in its hello).
/// 3: after a handshake with a shared secret every frame carries its tag (`auth::FrameAuth`).
/// 4: proofs cover both hellos and the metadata frame is tagged; the same-host identity carries
///    a proof bound to the connection instead of a static probe value.
/// 5: owners announce what their lookups can find (Held frames, owner to reader).
pub const PROTOCOL_VERSION: u16 = 5;

/// Where a registered region lives; the reader needs it to pick a UCX memory type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MemoryType {
    Host,
    Cuda,
}

/// One registered memory region of an engine, as a remote reader needs it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionInfo {
    pub addr: u64,
    pub len: u64,
    /// Packed UCX remote key.
    pub rkey: Vec<u8>,
    pub memory: MemoryType,
}

/// What must be equal on both sides for KV blocks to be interchangeable (model, dtype,
/// block_size, kv_heads, head_size, num_layers, layout, tp_size, ...). Kept as sorted
/// name/value pairs so both sides compare the same fields in the same order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fingerprint(pub BTreeMap<String, String>);

/// Stands for a fingerprint field one side has and the other lacks.
const MISSING_FIELD: &str = "<missing>";

impl Fingerprint {
    /// Fails on the first field (in name order) whose values differ, including fields only
    /// one side has.
    pub fn check_compatible(&self, theirs: &Fingerprint) -> Result<(), HandshakeError> {
        let fields = self.0.keys().chain(theirs.0.keys());
        let mut names: Vec<&String> = fields.collect();
        names.sort();
        names.dedup();
        for name in names {
            let ours = self.0.get(name);
            let their_value = theirs.0.get(name);
            if ours != their_value {
                return Err(HandshakeError::Incompatible {
                    field: name.clone(),
                    ours: ours.map_or(MISSING_FIELD, String::as_str).to_owned(),
                    theirs: their_value.map_or(MISSING_FIELD, String::as_str).to_owned(),
                });
            }
        }
        Ok(())
    }
}

/// Everything a reader needs to read an owner's KV blocks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineMetadata {
    pub engine_id: String,
    /// Random per process start; a new value means the peer restarted and every endpoint and
    /// rkey cached for it is stale.
    pub generation: u64,
    /// Packed UCX worker address.
    pub worker_address: Vec<u8>,
    pub regions: Vec<RegionInfo>,
    pub layout: Option<crate::descriptors::BlockLayout>,
    pub fingerprint: Fingerprint,
    /// Who the engine is on its host, for readers on the same host (absent where unknown).
    #[serde(default)]
    pub same_host: Option<SameHostIdentity>,
}

/// An engine's process as a reader on the same host reads it without UCX: the host's boot id,
/// the pid, where the process keeps its 32-byte probe key (never sent), and this connection's
/// [`auth::same_host_proof`] made with that key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SameHostIdentity {
    pub boot_id: String,
    pub pid: u32,
    pub probe_addr: u64,
    /// Made per connection by the owner's side channel; zero in the metadata it publishes.
    pub proof: auth::Proof,
}

impl EngineMetadata {
    /// What the engine's process vouches for to same-host readers: all of the metadata except
    /// the proof itself (SHA-256 of its canonical encoding with the proof zeroed): id,
    /// generation, worker address, regions and their rkeys, layout, compatibility fingerprint
    /// and the identity's pid and probe address. A peer replaying another process's identity
    /// can change none of them.
    pub fn digest(&self) -> [u8; 32] {
        use sha2::{Digest, Sha256};
        let mut unproven = self.clone();
        if let Some(identity) = &mut unproven.same_host {
            identity.proof = [0; 32];
        }
        Sha256::digest(wire::metadata_body(&unproven)).into()
    }

    /// Refuses metadata that UCX would read past: UCX takes a worker address and packed rkeys
    /// without their lengths, so an empty (or absurdly short) one is a malformed peer, not a
    /// call to make.
    pub fn validate(&self) -> Result<(), HandshakeError> {
        if self.worker_address.len() < MIN_PACKED_LEN {
            return Err(HandshakeError::Malformed(format!(
                "engine {:?} sent a {}-byte worker_address",
                self.engine_id,
                self.worker_address.len()
            )));
        }
        for (index, region) in self.regions.iter().enumerate() {
            if region.rkey.len() < MIN_PACKED_LEN {
                return Err(HandshakeError::Malformed(format!(
                    "engine {:?} sent a {}-byte rkey for regions[{index}]",
                    self.engine_id,
                    region.rkey.len()
                )));
            }
        }
        Ok(())
    }
}

/// Shorter packed worker addresses or rkeys than this are never produced by UCX.
pub const MIN_PACKED_LEN: usize = 4;

/// A fresh value for [`EngineMetadata::generation`], drawn from the OS.
pub fn new_generation() -> Result<u64, HandshakeError> {
    getrandom::u64().map_err(|e| HandshakeError::Random(e.to_string()))
}

/// The complete metadata frame (header and body), as the owner sends it.
pub fn encode_metadata(m: &EngineMetadata) -> Vec<u8> {
    wire::encode_metadata(m)
}

/// Parses exactly one metadata frame. Truncated, garbage, oversized or wrong-version bytes
/// give an error, never a panic.
pub fn decode_metadata(bytes: &[u8]) -> Result<EngineMetadata, HandshakeError> {
    match wire::decode_frame(bytes)? {
        Frame::Metadata(m) => Ok(m),
        other => Err(HandshakeError::Malformed(format!(
            "expected a {:?} frame, got a {:?} frame",
            FrameKind::Metadata,
            other.kind()
        ))),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("side-channel I/O failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("cannot listen for side-channel connections on {address}: {source}")]
    Bind { address: String, source: std::io::Error },
    #[error("cannot reach the side channel at {address}: {source}")]
    Unreachable { address: String, source: std::io::Error },
    #[error("timed out after {after:?} waiting for {waiting_for}")]
    Timeout { waiting_for: &'static str, after: Duration },
    #[error("truncated frame: {got} of {needed} bytes")]
    Truncated { got: usize, needed: usize },
    #[error("malformed frame: {0}")]
    Malformed(String),
    #[error("{kind:?} frame of {len} bytes exceeds its cap of {max} bytes")]
    FrameTooLarge { kind: FrameKind, len: u64, max: u64 },
    #[error("protocol version mismatch: ours is {ours}, theirs is {theirs}")]
    ProtocolVersion { ours: u16, theirs: u16 },
    #[error("incompatible KV caches: `{field}` is {ours} here but {theirs} on the peer")]
    Incompatible { field: String, ours: String, theirs: String },
    #[error("the peer requires a shared secret and we have none")]
    AuthRequired,
    #[error("authentication failed: the peer's shared secret differs from ours")]
    AuthFailed,
    #[error("we have a shared secret but the peer has none, so it cannot prove who it is")]
    PeerNotAuthenticated,
    #[error("frame {seq} ({direction:?}) does not carry this connection's tag: injected, replayed, reordered or corrupted")]
    ForgedFrame { direction: auth::Direction, seq: u64 },
    #[error("the peer refused: {0}")]
    Refused(String),
    #[error("the peer is gone: {0}")]
    PeerGone(String),
    #[error("{queued} bytes already wait to be written to the peer: it is not reading them")]
    Backlog { queued: usize },
    #[error("invalid side-channel configuration: {0}")]
    Config(String),
    #[error("the OS has no randomness for nonces: {0}")]
    Random(String),
}
