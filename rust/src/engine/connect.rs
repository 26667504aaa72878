//! Connecting to peers, as the engine's callers see it: a blocking `connect`, a non-blocking
//! `peer_status` that starts handshakes on threads of their own, and which failures are worth
//! retrying. The handshakes and the connections themselves are [`super::peer`]'s.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::routes::{begin_connect, connect_blocking, resolve, spawn_handshake};
use super::{lock, Engine, EngineError, PeerStatus};
use crate::handshake::{ConnectDecision, HandshakeError, PeerState};

impl Engine {
    /// Handshakes with the engine whose side channel is `host:port` (unless a live connection
    /// exists) and returns the connection's handle (`engine-id@host:port#n`). Waits for an attempt another caller started, and
    /// retries unreachable peers with the peer table's backoff, until `timeout`; refusals
    /// (incompatible, authentication) fail at once.
    pub fn connect(&self, host: &str, port: u16, timeout: Duration) -> Result<String, EngineError> {
        connect_blocking(&self.shared, host, port, timeout)
    }

    /// Non-blocking: where the connection to `host:port` stands, starting a handshake (on a
    /// thread of its own, limited to `timeout`) when none is under way and the backoff allows.
    /// With `expected_engine_id`, a ready peer of another id is a failure (a restarted or
    /// misaddressed engine must not be read from).
    pub fn peer_status(
        &self,
        host: &str,
        port: u16,
        expected_engine_id: Option<&str>,
        timeout: Duration,
    ) -> PeerStatus {
        let key = format!("{host}:{port}");
        if self.shared.stop.load(Ordering::Acquire) {
            return PeerStatus::Failed(EngineError::Closed.to_string());
        }
        match begin_connect(&self.shared, &key, Instant::now()) {
            ConnectDecision::Ready { engine_id, .. }
                if expected_engine_id.is_some_and(|expected| expected != engine_id) =>
            {
                PeerStatus::Failed(format!(
                    "the engine at {key} is {engine_id:?}, not {:?}",
                    expected_engine_id.unwrap_or_default()
                ))
            }
            ConnectDecision::Ready { engine_id, connection } => {
                PeerStatus::Ready(format!("{engine_id}@{key}#{connection}"))
            }
            ConnectDecision::InProgress => PeerStatus::Connecting,
            ConnectDecision::RetryAt { error, .. } => PeerStatus::Failed(error),
            ConnectDecision::Connect { .. } => {
                spawn_handshake(&self.shared, key.clone(), host.to_owned(), port, timeout);
                // Failed already only when no thread could be started for it.
                match lock(&self.shared.routes).table.state(&key) {
                    PeerState::Failed { error, .. } => PeerStatus::Failed(error.clone()),
                    _ => PeerStatus::Connecting,
                }
            }
        }
    }

    /// Whether `peer` (a handle, or a bare engine id) names a live connection.
    pub fn peer_alive(&self, peer: &str) -> bool {
        resolve(&self.shared, peer).is_ok()
    }
}

fn is_retryable(e: &HandshakeError) -> bool {
    matches!(
        e,
        HandshakeError::Io(_) | HandshakeError::Unreachable { .. } | HandshakeError::Timeout { .. }
    )
}

pub(super) fn is_retryable_engine_error(e: &EngineError) -> bool {
    matches!(e, EngineError::Handshake(h) if is_retryable(h))
}
