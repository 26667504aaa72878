//! What we know about each remote engine, and when a link counts as dead. Time is passed in,
//! so every transition is reproducible in tests.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::EngineMetadata;

/// How connection attempts to one peer are spaced: the n-th failure waits
/// `first_backoff * 2^(n-1)`, at most `max_backoff`, and no retry is scheduled past
/// `connect_deadline` after the first attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    pub first_backoff: Duration,
    pub max_backoff: Duration,
    pub connect_deadline: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            first_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            connect_deadline: Duration::from_secs(30),
        }
    }
}

impl RetryPolicy {
    /// The wait after the `failures`-th consecutive failure (1-based).
    pub fn backoff(&self, failures: u32) -> Duration {
        let factor = 1u32
            .checked_shl(failures.saturating_sub(1))
            .unwrap_or(u32::MAX);
        self.first_backoff
            .saturating_mul(factor)
            .min(self.max_backoff)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerState {
    Unknown,
    Connecting {
        attempt: u32,
    },
    Ready {
        engine_id: String,
        generation: u64,
    },
    /// `retry_at` is `None` once the connect deadline has passed: the peer is given up on
    /// until it is marked dead.
    Failed {
        error: String,
        attempts: u32,
        retry_at: Option<Instant>,
    },
}

/// What the caller of [`PeerTable::begin_connect`] should do now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConnectDecision {
    /// Connect now; the peer is `Connecting`.
    Connect {
        attempt: u32,
    },
    /// Another caller is connecting.
    InProgress,
    AlreadyReady,
    /// Backing off after a failure.
    RetryAt(Instant),
    GaveUp {
        error: String,
        attempts: u32,
    },
}

#[derive(Debug)]
struct Peer {
    state: PeerState,
    first_attempt_at: Option<Instant>,
    /// Survives `mark_dead`, so a reconnect can tell whether the peer restarted meanwhile.
    ready_generation: Option<u64>,
}

/// Connection state per remote engine, keyed by its side-channel `host:port`.
#[derive(Debug, Default)]
pub struct PeerTable {
    policy: RetryPolicy,
    peers: HashMap<String, Peer>,
}

static UNKNOWN: PeerState = PeerState::Unknown;

impl PeerTable {
    pub fn new(policy: RetryPolicy) -> Self {
        Self {
            policy,
            peers: HashMap::new(),
        }
    }

    pub fn state(&self, key: &str) -> &PeerState {
        self.peers.get(key).map_or(&UNKNOWN, |peer| &peer.state)
    }

    pub fn begin_connect(&mut self, key: &str, now: Instant) -> ConnectDecision {
        let peer = peer_entry(&mut self.peers, key);
        let attempt = match &peer.state {
            PeerState::Unknown => 1,
            PeerState::Connecting { .. } => return ConnectDecision::InProgress,
            PeerState::Ready { .. } => return ConnectDecision::AlreadyReady,
            PeerState::Failed {
                error,
                attempts,
                retry_at: None,
            } => {
                return ConnectDecision::GaveUp {
                    error: error.clone(),
                    attempts: *attempts,
                }
            }
            PeerState::Failed {
                retry_at: Some(at), ..
            } if now < *at => return ConnectDecision::RetryAt(*at),
            PeerState::Failed { attempts, .. } => attempts.saturating_add(1),
        };
        peer.first_attempt_at.get_or_insert(now);
        peer.state = PeerState::Connecting { attempt };
        ConnectDecision::Connect { attempt }
    }

    /// Records the handshake's result. Returns whether the peer restarted since it was last
    /// ready (its generation changed), in which case everything cached for it is stale.
    pub fn on_ready(&mut self, key: &str, metadata: &EngineMetadata) -> bool {
        let ready = PeerState::Ready {
            engine_id: metadata.engine_id.clone(),
            generation: metadata.generation,
        };
        let peer = peer_entry(&mut self.peers, key);
        let restarted = peer
            .ready_generation
            .is_some_and(|g| g != metadata.generation);
        peer.state = ready;
        peer.first_attempt_at = None;
        peer.ready_generation = Some(metadata.generation);
        restarted
    }

    /// Records a failed attempt and schedules the next one, unless that would fall past the
    /// connect deadline.
    pub fn on_failed(&mut self, key: &str, error: &str, now: Instant) {
        let peer = peer_entry(&mut self.peers, key);
        let attempts = match peer.state {
            PeerState::Connecting { attempt } => attempt,
            PeerState::Failed { attempts, .. } => attempts,
            PeerState::Unknown | PeerState::Ready { .. } => 1,
        };
        let first_attempt_at = *peer.first_attempt_at.get_or_insert(now);
        let deadline = first_attempt_at.checked_add(self.policy.connect_deadline);
        let retry_at = now
            .checked_add(self.policy.backoff(attempts))
            .filter(|at| deadline.is_none_or(|deadline| *at <= deadline));
        peer.state = PeerState::Failed {
            error: error.to_owned(),
            attempts,
            retry_at,
        };
    }

    /// The link died or the peer was given up on: the next `begin_connect` starts afresh.
    pub fn mark_dead(&mut self, key: &str) {
        if let Some(peer) = self.peers.get_mut(key) {
            peer.state = PeerState::Unknown;
            peer.first_attempt_at = None;
        }
    }
}

fn peer_entry<'a>(peers: &'a mut HashMap<String, Peer>, key: &str) -> &'a mut Peer {
    peers.entry(key.to_owned()).or_insert(Peer {
        state: PeerState::Unknown,
        first_attempt_at: None,
        ready_generation: None,
    })
}

/// When a kept-open link pings, and when silence means the other side is gone.
#[derive(Clone, Debug)]
pub struct Liveness {
    ping_every: Duration,
    silence_limit: Duration,
    next_ping_at: Instant,
    last_heard_at: Instant,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LivenessAction {
    SendPing,
    Dead {
        silent_for: Duration,
    },
    /// Nothing is due for this long.
    Wait(Duration),
}

impl Liveness {
    /// A peer that sent nothing for this many of its heartbeats is dead.
    pub const MISSED_HEARTBEATS: u32 = 3;

    pub fn new(now: Instant, our_heartbeat: Duration, peer_heartbeat: Duration) -> Self {
        Self {
            ping_every: our_heartbeat,
            silence_limit: peer_heartbeat.saturating_mul(Self::MISSED_HEARTBEATS),
            next_ping_at: now + our_heartbeat,
            last_heard_at: now,
        }
    }

    pub fn on_frame_received(&mut self, now: Instant) {
        self.last_heard_at = now;
    }

    pub fn on_ping_sent(&mut self, now: Instant) {
        self.next_ping_at = now + self.ping_every;
    }

    pub fn poll(&self, now: Instant) -> LivenessAction {
        let silent_for = now.saturating_duration_since(self.last_heard_at);
        if silent_for >= self.silence_limit {
            return LivenessAction::Dead { silent_for };
        }
        if now >= self.next_ping_at {
            return LivenessAction::SendPing;
        }
        let until_ping = self.next_ping_at - now;
        LivenessAction::Wait(until_ping.min(self.silence_limit - silent_for))
    }
}
