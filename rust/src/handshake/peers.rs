//! What we know about each remote engine, and when a link counts as dead. Time is passed in,
//! so every transition is reproducible in tests.
//!
//! The [`PeerTable`] is the one owner of peer liveness: each ready connection gets a number
//! from it, and a connection counts as live exactly while the table's entry for its address is
//! ready with that number. A death reported for an older connection never ends a newer one,
//! and a caller holding a number can check that it still names the live connection.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::EngineMetadata;

/// How connection attempts to one peer are spaced: the n-th consecutive failure waits
/// `first_backoff * 2^(n-1)`, at most `max_backoff`. A peer is never given up on (a decode
/// node may come back after minutes); a success resets the count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    pub first_backoff: Duration,
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self { first_backoff: Duration::from_millis(100), max_backoff: Duration::from_secs(5) }
    }
}

impl RetryPolicy {
    /// The wait after the `failures`-th consecutive failure (1-based).
    pub fn backoff(&self, failures: u32) -> Duration {
        let factor = 1u32.checked_shl(failures.saturating_sub(1)).unwrap_or(u32::MAX);
        self.first_backoff.saturating_mul(factor).min(self.max_backoff)
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
        /// Numbers this connection among all the table handed out.
        connection: u64,
    },
    Failed {
        error: String,
        /// Whether trying again may help (unreachable, timed out) or not (refused: another
        /// protocol version, an incompatible model, a wrong secret).
        retryable: bool,
        attempts: u32,
        retry_at: Instant,
    },
}

/// What the caller of [`PeerTable::begin_connect`] should do now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConnectDecision {
    /// Connect now; the peer is `Connecting` until [`PeerTable::on_ready`] or
    /// [`PeerTable::on_failed`].
    Connect {
        attempt: u32,
    },
    /// Another caller is connecting.
    InProgress,
    Ready {
        engine_id: String,
        connection: u64,
    },
    /// Backing off after a failure.
    RetryAt {
        at: Instant,
        error: String,
        retryable: bool,
    },
}

#[derive(Debug)]
struct Peer {
    state: PeerState,
    /// Survives `mark_dead`, so a reconnect can tell whether the peer restarted meanwhile.
    ready_generation: Option<u64>,
    /// When a sweep first found it idle (dead, or failed and past its backoff); cleared by
    /// any transition.
    idle_since: Option<Instant>,
}

/// How long an idle entry (a dead connection's address, or a failed one past its backoff) is
/// kept: a peer that reconnects within it is told apart from a restarted one, and keeps
/// backing off; after it, its address is forgotten, so the table holds the addresses in use,
/// not every address ever connected to.
pub const FORGET_IDLE_AFTER: Duration = Duration::from_secs(300);

/// Connection state per remote engine, keyed by its side-channel `host:port`: the one place
/// that decides whether to connect, wait, or use a ready link. Time is passed in.
#[derive(Debug, Default)]
pub struct PeerTable {
    policy: RetryPolicy,
    peers: HashMap<String, Peer>,
    /// The last connection number handed out.
    connections: u64,
    /// When `begin_connect` next looks for idle entries to forget.
    next_sweep: Option<Instant>,
}

/// A connection made ready by [`PeerTable::on_ready`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Connected {
    pub connection: u64,
    /// The peer's generation changed since it was last ready: everything cached for it is stale.
    pub restarted: bool,
}

static UNKNOWN: PeerState = PeerState::Unknown;

impl PeerTable {
    pub fn new(policy: RetryPolicy) -> Self {
        Self { policy, peers: HashMap::new(), connections: 0, next_sweep: None }
    }

    /// Forgets the entries idle for [`FORGET_IDLE_AFTER`] (looking at most once a second).
    fn sweep(&mut self, now: Instant) {
        if self.next_sweep.is_some_and(|at| now < at) {
            return;
        }
        self.next_sweep = now.checked_add(Duration::from_secs(1));
        self.peers.retain(|_, peer| {
            let idle = match peer.state {
                PeerState::Unknown => true,
                PeerState::Failed { retry_at, .. } => now >= retry_at,
                PeerState::Connecting { .. } | PeerState::Ready { .. } => false,
            };
            if !idle {
                return true;
            }
            let since = *peer.idle_since.get_or_insert(now);
            now.saturating_duration_since(since) < FORGET_IDLE_AFTER
        });
    }

    pub fn state(&self, key: &str) -> &PeerState {
        self.peers.get(key).map_or(&UNKNOWN, |peer| &peer.state)
    }

    pub fn begin_connect(&mut self, key: &str, now: Instant) -> ConnectDecision {
        self.sweep(now);
        let peer = peer_entry(&mut self.peers, key);
        let attempt = match &peer.state {
            PeerState::Unknown => 1,
            PeerState::Connecting { .. } => return ConnectDecision::InProgress,
            PeerState::Ready { engine_id, connection, .. } => {
                return ConnectDecision::Ready {
                    engine_id: engine_id.clone(),
                    connection: *connection,
                }
            }
            PeerState::Failed { retry_at, error, retryable, .. } if now < *retry_at => {
                return ConnectDecision::RetryAt {
                    at: *retry_at,
                    error: error.clone(),
                    retryable: *retryable,
                }
            }
            PeerState::Failed { attempts, .. } => attempts.saturating_add(1),
        };
        peer.state = PeerState::Connecting { attempt };
        peer.idle_since = None;
        ConnectDecision::Connect { attempt }
    }

    /// Records the handshake's result: the connection's number, and whether the peer
    /// restarted since it was last ready (its generation changed).
    pub fn on_ready(&mut self, key: &str, metadata: &EngineMetadata) -> Connected {
        self.connections += 1;
        let connection = self.connections;
        let ready = PeerState::Ready {
            engine_id: metadata.engine_id.clone(),
            generation: metadata.generation,
            connection,
        };
        let peer = peer_entry(&mut self.peers, key);
        let restarted = peer.ready_generation.is_some_and(|g| g != metadata.generation);
        peer.state = ready;
        peer.ready_generation = Some(metadata.generation);
        peer.idle_since = None;
        Connected { connection, restarted }
    }

    /// Whether `connection` is the live connection to `key`.
    pub fn is_current(&self, key: &str, connection: u64) -> bool {
        matches!(self.state(key), PeerState::Ready { connection: c, .. } if *c == connection)
    }

    /// Records a failed attempt and when the next one may start.
    pub fn on_failed(&mut self, key: &str, error: &str, retryable: bool, now: Instant) {
        let peer = peer_entry(&mut self.peers, key);
        let attempts = match peer.state {
            PeerState::Connecting { attempt } => attempt,
            PeerState::Failed { attempts, .. } => attempts,
            PeerState::Unknown | PeerState::Ready { .. } => 1,
        };
        let backoff = self.policy.backoff(attempts);
        peer.state = PeerState::Failed {
            error: error.to_owned(),
            retryable,
            attempts,
            retry_at: now.checked_add(backoff).unwrap_or(now),
        };
        peer.idle_since = None;
    }

    /// Connection `connection` to `key` died: the next `begin_connect` connects afresh.
    /// Returns whether it was the live one (a newer connection is left alone).
    pub fn mark_dead(&mut self, key: &str, connection: u64) -> bool {
        let current = self.is_current(key, connection);
        if let (true, Some(peer)) = (current, self.peers.get_mut(key)) {
            peer.state = PeerState::Unknown;
            peer.idle_since = None;
        }
        current
    }

    /// Forgets every peer (the engine closes).
    pub fn clear(&mut self) {
        self.peers.clear();
    }
}

fn peer_entry<'a>(peers: &'a mut HashMap<String, Peer>, key: &str) -> &'a mut Peer {
    peers.entry(key.to_owned()).or_insert(Peer {
        state: PeerState::Unknown,
        ready_generation: None,
        idle_since: None,
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
