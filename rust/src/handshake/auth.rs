//! Mutual challenge/response over an optional shared secret.
//!
//! Each side sends a fresh random nonce in its hello; each then proves it holds the secret
//! with HMAC-SHA256(secret, direction label || client nonce || server nonce). Both nonces make
//! a proof useless on any other connection; the direction label stops a proof received from
//! the peer being reflected back to it as our own. The secret itself never crosses the wire.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::HandshakeError;

pub const NONCE_LEN: usize = 32;
pub type Nonce = [u8; NONCE_LEN];
pub type Proof = [u8; 32];

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
    client_nonce: &Nonce,
    server_nonce: &Nonce,
) -> Result<Proof, HandshakeError> {
    Ok(keyed(secret, direction, client_nonce, server_nonce)?
        .finalize()
        .into_bytes()
        .into())
}

/// `AuthFailed` unless `proof` is what a holder of `secret` sends in `direction`; the
/// comparison takes the same time wherever the first differing byte is.
pub fn verify(
    secret: &[u8],
    direction: Direction,
    client_nonce: &Nonce,
    server_nonce: &Nonce,
    proof: &Proof,
) -> Result<(), HandshakeError> {
    keyed(secret, direction, client_nonce, server_nonce)?
        .verify_slice(proof)
        .map_err(|_| HandshakeError::AuthFailed)
}

fn keyed(
    secret: &[u8],
    direction: Direction,
    client_nonce: &Nonce,
    server_nonce: &Nonce,
) -> Result<Hmac<Sha256>, HandshakeError> {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).map_err(|e| {
        HandshakeError::Config(format!("shared secret unusable as an HMAC key: {e}"))
    })?;
    mac.update(direction.label());
    mac.update(client_nonce);
    mac.update(server_nonce);
    Ok(mac)
}
