//! Routes to peer connections, under one lock: which connection answers for a side-channel
//! address (the [`PeerTable`]: connect, wait, back off, or use the ready one), the ready
//! connections by number, and the callers waiting for a handshake under way. Whether a
//! connection is open is its own to say ([`Peer::is_live`]); the routes only point to it, and
//! treat a closed one as gone.
//!
//! A handshake with an address runs once at a time, on the thread of whoever started it: a
//! blocking `connect`'s caller, or a thread of its own for `peer_status` and lookups, which
//! others then wait for without a thread each ([`super::connect::connect_then`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::peer::Peer;
use super::{lock, EngineError, Shared};
use crate::handshake::{ConnectDecision, PeerState, PeerTable, RetryPolicy};

/// Takes the outcome of waiting for a connection: the ready one, or why there is none.
pub(super) type Connected = Box<dyn FnOnce(Result<Arc<Peer>, String>) + Send>;

/// A caller waiting for the handshake under way with its address.
pub(super) struct Waiting {
    pub(super) host: String,
    pub(super) port: u16,
    pub(super) deadline: Instant,
    pub(super) then: Connected,
}

pub(super) struct Routes {
    pub(super) table: PeerTable,
    /// Ready connections by the number the table gave them.
    peers: HashMap<u64, Arc<Peer>>,
    /// By address: the callers waiting for the handshake under way with it.
    pub(super) waiting: HashMap<String, Vec<Waiting>>,
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

/// Closes the connection (failing its batches and cancelling their reads: see
/// [`crate::ucx::Endpoint::abort`]; a batch settles only when its last read has completed, so
/// one whose reads UCX has not released stays pending rather than be reported while bytes may
/// land) and ends it in the peer table (a newer connection to its address is left alone).
pub(super) fn abort_peer(shared: &Shared, peer: &Peer, reason: &str) {
    peer.close(reason);
    unroute(shared, peer);
}
