//! Mutual challenge/response over an optional shared secret.
//!
//! Each side sends a fresh random nonce in its hello; each then proves it holds the secret
//! with HMAC-SHA256(secret, direction label || transcript), where the [`Transcript`] is the
//! hash of both hellos as this side sent or received them (so both nonces, and every other
//! field a man in the middle could rewrite). Both nonces make a proof useless on any other
//! connection; the direction label stops a proof received from the peer being reflected back
//! to it as our own. The secret itself never crosses the wire.
//!
//! Every frame after the proofs, starting with the owner's metadata, is bound to the
//! handshake by a [`FrameAuth`]: a tag of HMAC-SHA256(frame key, sequence number || frame)
//! follows the frame, where each direction's frame key is derived from the secret and the
//! transcript. A frame injected into the connection, replayed (on it or on another),
//! reordered, dropped or reflected fails the next check.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::HandshakeError;

pub const NONCE_LEN: usize = 32;
pub type Nonce = [u8; NONCE_LEN];
pub type Proof = [u8; 32];
/// SHA-256 of both hellos (see [`super::wire::transcript`]).
pub type Transcript = [u8; 32];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    ClientToServer,
    ServerToClient,
}

impl Direction {
    fn label(self) -> &'static [u8] {
        match self {
            Self::ClientToServer => b"kvduplex side channel v1: client proof",
            Self::ServerToClient => b"kvduplex side channel v1: server proof",
        }
    }

    fn frame_key_label(self) -> &'static [u8] {
        match self {
            Self::ClientToServer => b"kvduplex side channel v1: client frames",
            Self::ServerToClient => b"kvduplex side channel v1: server frames",
        }
    }
}

/// Bytes of the tag that follows each frame after an authenticated handshake (HMAC-SHA256
/// truncated to 128 bits, as RFC 2104 allows).
pub const TAG_LEN: usize = 16;

/// The frames of one direction of one authenticated connection: tags the frames we send, or
/// checks the frames we receive, in order.
pub struct FrameAuth {
    key: Hmac<Sha256>,
    direction: Direction,
    next_seq: u64,
}

impl FrameAuth {
    /// The frame authenticator for `direction` of the connection whose hellos hash to
    /// `transcript`. Both ends derive the same one for each direction.
    pub fn new(
        secret: &[u8],
        direction: Direction,
        transcript: &Transcript,
    ) -> Result<Self, HandshakeError> {
        let mut derive = hmac_with(secret)?;
        derive.update(direction.frame_key_label());
        derive.update(transcript);
        let frame_key = derive.finalize().into_bytes();
        Ok(Self { key: hmac_with(&frame_key)?, direction, next_seq: 0 })
    }

    /// The tag of the next frame we send.
    pub fn tag(&mut self, frame: &[u8]) -> [u8; TAG_LEN] {
        let full = self.keyed(frame).finalize().into_bytes();
        self.next_seq += 1;
        let mut tag = [0u8; TAG_LEN];
        tag.copy_from_slice(&full[..TAG_LEN]);
        tag
    }

    /// `ForgedFrame` unless `tag` is the next frame's tag for `frame`; the comparison takes
    /// the same time wherever the first differing byte is.
    pub fn check(&mut self, frame: &[u8], tag: &[u8]) -> Result<(), HandshakeError> {
        let forged = HandshakeError::ForgedFrame { direction: self.direction, seq: self.next_seq };
        if tag.len() != TAG_LEN {
            return Err(forged);
        }
        self.keyed(frame).verify_truncated_left(tag).map_err(|_| forged)?;
        self.next_seq += 1;
        Ok(())
    }

    fn keyed(&self, frame: &[u8]) -> Hmac<Sha256> {
        let mut mac = self.key.clone();
        mac.update(&self.next_seq.to_be_bytes());
        mac.update(frame);
        mac
    }
}

impl std::fmt::Debug for FrameAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameAuth")
            .field("direction", &self.direction)
            .field("next_seq", &self.next_seq)
            .finish_non_exhaustive()
    }
}

pub fn new_nonce() -> Result<Nonce, HandshakeError> {
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::fill(&mut nonce).map_err(|e| HandshakeError::Random(e.to_string()))?;
    Ok(nonce)
}

/// The secret this connection authenticates with, if any, given ours and whether the peer
/// has one. A secret on one side only is an error on both: the side without one cannot prove
/// itself, and the side with one would otherwise accept a peer that proved nothing.
pub fn negotiate_auth(
    our_secret: Option<&[u8]>,
    peer_has_secret: bool,
) -> Result<Option<&[u8]>, HandshakeError> {
    match (our_secret, peer_has_secret) {
        (Some(secret), true) => Ok(Some(secret)),
        (None, false) => Ok(None),
        (Some(_), false) => Err(HandshakeError::PeerNotAuthenticated),
        (None, true) => Err(HandshakeError::AuthRequired),
    }
}

pub fn prove(
    secret: &[u8],
    direction: Direction,
    transcript: &Transcript,
) -> Result<Proof, HandshakeError> {
    Ok(keyed(secret, direction, transcript)?.finalize().into_bytes().into())
}

/// `AuthFailed` unless `proof` is what a holder of `secret` sends in `direction`; the
/// comparison takes the same time wherever the first differing byte is.
pub fn verify(
    secret: &[u8],
    direction: Direction,
    transcript: &Transcript,
    proof: &Proof,
) -> Result<(), HandshakeError> {
    keyed(secret, direction, transcript)?
        .verify_slice(proof)
        .map_err(|_| HandshakeError::AuthFailed)
}

fn keyed(
    secret: &[u8],
    direction: Direction,
    transcript: &Transcript,
) -> Result<Hmac<Sha256>, HandshakeError> {
    let mut mac = hmac_with(secret)?;
    mac.update(direction.label());
    mac.update(transcript);
    Ok(mac)
}

fn hmac_with(key: &[u8]) -> Result<Hmac<Sha256>, HandshakeError> {
    <Hmac<Sha256> as Mac>::new_from_slice(key)
        .map_err(|e| HandshakeError::Config(format!("shared secret unusable as an HMAC key: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(direction: Direction) -> (FrameAuth, FrameAuth) {
        let make = || FrameAuth::new(b"secret", direction, &[1u8; 32]).unwrap();
        (make(), make())
    }

    #[test]
    fn frames_check_in_order_and_only_in_order() {
        let (mut sender, mut receiver) = pair(Direction::ClientToServer);
        let (a, b) = (sender.tag(b"frame a"), sender.tag(b"frame b"));
        // Reordered: b's tag is for sequence number 1, the receiver expects 0.
        assert!(matches!(
            receiver.check(b"frame b", &b),
            Err(HandshakeError::ForgedFrame { seq: 0, .. })
        ));
        receiver.check(b"frame a", &a).unwrap();
        // Replayed: a again is refused; then b, in order, passes.
        assert!(receiver.check(b"frame a", &a).is_err());
        receiver.check(b"frame b", &b).unwrap();
    }

    #[test]
    fn a_changed_byte_a_short_tag_another_connection_or_direction_fail() {
        let (mut sender, _) = pair(Direction::ClientToServer);
        let tag = sender.tag(b"frame");
        let (_, mut receiver) = pair(Direction::ClientToServer);
        assert!(receiver.check(b"framE", &tag).is_err());
        assert!(receiver.check(b"frame", &tag[..TAG_LEN - 1]).is_err());
        assert!(receiver.check(b"frame", &[]).is_err());
        // A frame reflected back to its sender (the other direction's key).
        let (_, mut reflected) = pair(Direction::ServerToClient);
        assert!(reflected.check(b"frame", &tag).is_err());
        // The same frame on another connection (other hellos).
        let mut other = FrameAuth::new(b"secret", Direction::ClientToServer, &[3; 32]).unwrap();
        assert!(other.check(b"frame", &tag).is_err());
        // The unspoiled receiver still takes the real one.
        receiver.check(b"frame", &tag).unwrap();
    }
}
