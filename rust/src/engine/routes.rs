//! Routes to peer connections, under one lock: which connection answers for a side-channel
//! address (the [`PeerTable`]: connect, wait, back off, or use the ready one), the ready
//! connections by number, and the callers waiting for a handshake under way. Whether a
//! connection is open is its own to say ([`Peer::is_live`]); the routes only point to it, and
//! treat a closed one as gone.
//!
//! A handshake with an address runs once at a time, on the thread of whoever started it: a
//! blocking `connect`'s caller, or a thread of its own for `peer_status` and lookups, which
//! others then wait for without a thread each ([`connect_then`]).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::connect::is_retryable_engine_error;
use super::lookup::Retry;
use super::peer::{attempt_connect, handle, Peer};
use super::{lock, EngineError, Shared};
use crate::clock::deadline_after;
use crate::handshake::{ConnectDecision, HandshakeError, PeerState, PeerTable, RetryPolicy};

/// Takes the outcome of waiting for a connection: the ready one, or why there is none.
pub(super) type Connected = Box<dyn FnOnce(Result<Arc<Peer>, String>) + Send>;

/// A caller waiting for the handshake under way with its address.
pub(super) struct Waiting {
    host: String,
    port: u16,
    deadline: Instant,
    then: Connected,
}

pub(super) struct Routes {
    pub(super) table: PeerTable,
    /// Ready connections by the number the table gave them.
    peers: HashMap<u64, Arc<Peer>>,
    /// By address: the callers waiting for the handshake under way with it.
    waiting: HashMap<String, Vec<Waiting>>,
}

impl Routes {
    pub(super) fn new(policy: RetryPolicy) -> Self {
        Self { table: PeerTable::new(policy), peers: HashMap::new(), waiting: HashMap::new() }
    }

    /// The table's decision for `key`; a ready entry whose connection closed counts as dead
    /// and is connected afresh.
    pub(super) fn begin_connect(&mut self, key: &str, now: Instant) -> ConnectDecision {
        let decision = self.table.begin_connect(key, now);
        if let ConnectDecision::Ready { connection, .. } = &decision {
            if self.live(*connection).is_none() {
                self.table.mark_dead(key, *connection);
                return self.table.begin_connect(key, now);
            }
        }
        decision
    }

    fn live(&self, connection: u64) -> Option<&Arc<Peer>> {
        self.peers.get(&connection).filter(|p| p.is_live())
    }

    /// The open connection the table has ready for `key`.
    pub(super) fn ready(&self, key: &str) -> Option<Arc<Peer>> {
        let PeerState::Ready { connection, .. } = self.table.state(key) else { return None };
        self.live(*connection).cloned()
    }

    /// A connection the table just made ready; returns the callers that waited for it.
    pub(super) fn add(&mut self, peer: &Arc<Peer>) -> Vec<Waiting> {
        self.peers.insert(peer.connection, Arc::clone(peer));
        self.waiting.remove(&peer.address).unwrap_or_default()
    }

    /// The callers waiting for `key`, whose handshake ended without a connection.
    pub(super) fn failed(&mut self, key: &str) -> Vec<Waiting> {
        self.waiting.remove(key).unwrap_or_default()
    }

    /// Forgets every connection and waiting caller (the engine closes); returns the
    /// connections.
    pub(super) fn clear(&mut self) -> Vec<Arc<Peer>> {
        self.table.clear();
        self.waiting.clear();
        self.peers.drain().map(|(_, peer)| peer).collect()
    }
}

/// The open connection `peer` names: a handle ([`Peer::handle`]), or a bare engine id that
/// exactly one open connection declared.
pub(super) fn resolve(shared: &Shared, peer: &str) -> Result<Arc<Peer>, EngineError> {
    let routes = lock(&shared.routes);
    let routed = |p: &Arc<Peer>| routes.table.is_current(&p.address, p.connection) && p.is_live();
    let numbered = peer
        .rsplit_once('#')
        .and_then(|(_, n)| n.parse::<u64>().ok())
        .filter(|_| peer.contains('@'));
    if let Some(connection) = numbered {
        return routes
            .peers
            .get(&connection)
            .filter(|p| p.handle() == peer && routed(p))
            .cloned()
            .ok_or_else(|| EngineError::PeerNotConnected(peer.to_owned()));
    }
    let mut claiming = routes.peers.values().filter(|p| p.meta.engine_id == peer && routed(p));
    match (claiming.next(), claiming.next()) {
        (Some(only), None) => Ok(Arc::clone(only)),
        (None, _) => Err(EngineError::PeerNotConnected(peer.to_owned())),
        (Some(a), Some(b)) => Err(EngineError::AmbiguousPeer {
            engine_id: peer.to_owned(),
            addresses: format!("{} and {}", a.address, b.address),
        }),
    }
}

pub(super) fn begin_connect(shared: &Shared, key: &str, now: Instant) -> ConnectDecision {
    lock(&shared.routes).begin_connect(key, now)
}

/// The open connection to `key`, if the peer table has one ready.
pub(super) fn ready_peer(shared: &Shared, key: &str) -> Option<Arc<Peer>> {
    lock(&shared.routes).ready(key)
}

/// Takes a closed connection out of the routes (a newer connection to its address is left
/// alone).
pub(super) fn unroute(shared: &Shared, peer: &Peer) {
    let mut routes = lock(&shared.routes);
    routes.table.mark_dead(&peer.address, peer.connection);
    routes.peers.remove(&peer.connection);
}

/// [`super::Engine::connect`]: the handle of the connection to `host:port`, made on the
/// caller's thread unless another caller's attempt is under way.
pub(super) fn connect_blocking(
    shared: &Arc<Shared>,
    host: &str,
    port: u16,
    timeout: Duration,
) -> Result<String, EngineError> {
    let key = format!("{host}:{port}");
    let deadline = deadline_after(timeout);
    loop {
        if shared.stop.load(Ordering::Acquire) {
            return Err(EngineError::Closed);
        }
        let now = Instant::now();
        // Wait for another caller's attempt to end, or for the backoff to pass.
        let (wait_until, for_other_attempt) = match begin_connect(shared, &key, now) {
            ConnectDecision::Ready { engine_id, connection } => {
                return Ok(handle(&engine_id, &key, connection))
            }
            ConnectDecision::Connect { .. } => {
                let left = deadline.saturating_duration_since(now).max(Duration::from_millis(1));
                match attempt_connect(shared, &key, host, port, left) {
                    Ok(peer) => return Ok(peer.handle()),
                    // The table spaces the next attempt.
                    Err(e) if is_retryable_engine_error(&e) && Instant::now() < deadline => {
                        continue
                    }
                    Err(e) => return Err(e),
                }
            }
            ConnectDecision::InProgress => (deadline, true),
            ConnectDecision::RetryAt { at, error, retryable } => {
                if !retryable || at >= deadline {
                    return Err(EngineError::ConnectFailed { address: key, error });
                }
                (at, false)
            }
        };
        let routes = lock(&shared.routes);
        // An attempt that ended before this lock was taken was signalled already: look again.
        if for_other_attempt && !matches!(routes.table.state(&key), PeerState::Connecting { .. }) {
            continue;
        }
        let left = wait_until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            if for_other_attempt {
                return Err(HandshakeError::Timeout {
                    waiting_for: "another caller's handshake",
                    after: timeout,
                }
                .into());
            }
            continue;
        }
        drop(shared.table_changed.wait_timeout(routes, left).unwrap_or_else(|p| p.into_inner()));
    }
}

/// Hands `then` the open connection to `host:port`, now or once a handshake made it, by
/// `deadline`; never blocks. A handshake under way is waited for; none under way starts one,
/// on a thread of its own ([`spawn_handshake`]); one that failed is tried again when the
/// peer table's backoff allows, from the engine's retry thread, if that is before `deadline`.
/// So an owner that never answers costs one thread however many lookups ask for it (a thread
/// per lookup blocked in its own handshake, before).
pub(super) fn connect_then(
    shared: &Arc<Shared>,
    host: String,
    port: u16,
    deadline: Instant,
    then: Connected,
) {
    let key = format!("{host}:{port}");
    let now = Instant::now();
    let left = deadline.saturating_duration_since(now);
    if shared.stop.load(Ordering::Acquire) {
        return then(Err(EngineError::Closed.to_string()));
    }
    if left.is_zero() {
        return then(Err("no time left to connect".to_owned()));
    }
    let mut routes = lock(&shared.routes);
    match routes.begin_connect(&key, now) {
        ConnectDecision::Ready { .. } => {
            let peer = routes.ready(&key);
            drop(routes);
            then(peer.ok_or_else(|| format!("the connection to {key} closed")));
        }
        ConnectDecision::InProgress => {
            routes.waiting.entry(key).or_default().push(Waiting { host, port, deadline, then });
        }
        ConnectDecision::Connect { .. } => {
            routes.waiting.entry(key.clone()).or_default().push(Waiting {
                host: host.clone(),
                port,
                deadline,
                then,
            });
            drop(routes);
            spawn_handshake(shared, key, host, port, left);
        }
        ConnectDecision::RetryAt { at, retryable: true, .. } if at < deadline => {
            drop(routes);
            let weak = Arc::downgrade(shared);
            let ask = Box::new(move || match Weak::upgrade(&weak) {
                Some(shared) => connect_then(&shared, host, port, deadline, then),
                None => then(Err(EngineError::Closed.to_string())),
            });
            // Queued asks are dropped, unanswered, when the engine closes meanwhile.
            let _ = shared.retries.send(Retry { due: at, ask });
        }
        ConnectDecision::RetryAt { error, .. } => {
            drop(routes);
            then(Err(EngineError::ConnectFailed { address: key, error }.to_string()));
        }
    }
}

/// Runs one handshake with `host:port`, whose table entry the caller just set connecting, on a
/// thread of its own, limited to `timeout`; `close` joins it. Its end hands the connection to
/// whoever waits for it ([`connect_then`]).
pub(super) fn spawn_handshake(
    shared: &Arc<Shared>,
    key: String,
    host: String,
    port: u16,
    timeout: Duration,
) {
    let thread_shared = Arc::clone(shared);
    let thread_key = key.clone();
    let spawned = std::thread::Builder::new()
        .name("kvduplex-connect".into())
        .spawn(move || drop(attempt_connect(&thread_shared, &thread_key, &host, port, timeout)));
    match spawned {
        Ok(handle) => {
            let mut handles = lock(&shared.handshakes);
            handles.retain(|h| !h.is_finished());
            handles.push(handle);
        }
        Err(e) => {
            let error = format!("cannot start a handshake thread: {e}");
            let waiting = {
                let mut routes = lock(&shared.routes);
                routes.table.on_failed(&key, &error, true, Instant::now());
                routes.failed(&key)
            };
            shared.table_changed.notify_all();
            for Waiting { then, .. } in waiting {
                then(Err(error.clone()));
            }
        }
    }
}

/// Hands each caller that waited for a handshake its outcome: the connection, or, after a
/// failure, another try within its own deadline ([`connect_then`]).
pub(super) fn settle_waiting(
    shared: &Arc<Shared>,
    waiting: Vec<Waiting>,
    connected: Option<&Arc<Peer>>,
) {
    for Waiting { host, port, deadline, then } in waiting {
        match connected {
            Some(peer) => then(Ok(Arc::clone(peer))),
            None => connect_then(shared, host, port, deadline, then),
        }
    }
}
