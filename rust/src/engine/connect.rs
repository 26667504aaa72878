//! Connecting to peers: the engine's connecting verbs (a blocking `connect`, a non-blocking
//! `peer_status` that starts handshakes on threads of their own), the callers that wait for a
//! handshake under way ([`connect_then`]), and the handshake itself ([`attempt_connect`]: the
//! peer's metadata checked, who it is as the kernel says, its connection numbered by the peer
//! table). The connections are [`super::peer`]'s; which one answers for an address,
//! [`super::routes`]'.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::feeds::IndexFeed;
use super::peer::{handle, Peer};
use super::retry::Retry;
use super::routes::{abort_peer, begin_connect, resolve, Connected, Waiting};
use super::{lock, Engine, EngineError, PeerStatus, Shared};
use crate::clock::deadline_after;
use crate::descriptors::RegionBounds;
use crate::handshake::{
    ConnectDecision, EngineMetadata, HandshakeError, MemoryType, PeerState, SameHostIdentity,
};
use crate::same_host::SameHostPeer;
use crate::side_channel::PeerLink;
use crate::ucx::{check_not_this_process, packed, OpenError, PeerProcess};

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

/// [`super::Engine::connect`]: the handle of the connection to `host:port`, made on the
/// caller's thread unless another caller's attempt is under way.
fn connect_blocking(
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
                    Err(e) if e.is_retryable() && Instant::now() < deadline => continue,
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
fn spawn_handshake(shared: &Arc<Shared>, key: String, host: String, port: u16, timeout: Duration) {
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
fn settle_waiting(shared: &Arc<Shared>, waiting: Vec<Waiting>, connected: Option<&Arc<Peer>>) {
    for Waiting { host, port, deadline, then } in waiting {
        match connected {
            Some(peer) => then(Ok(Arc::clone(peer))),
            None => connect_then(shared, host, port, deadline, then),
        }
    }
}

/// The identity to check with the kernel, if the peer claims a process of this host (same boot
/// id) and of our pid namespace (where its pid names the same process).
fn claim_on_this_host<'a>(
    our_boot_id: Option<&str>,
    our_pid_namespace: Option<u64>,
    meta: &'a EngineMetadata,
) -> Option<&'a SameHostIdentity> {
    let theirs = meta.same_host.as_ref()?;
    let here = our_boot_id == Some(theirs.boot_id.as_str())
        && our_pid_namespace == Some(theirs.pid_namespace);
    here.then_some(theirs)
}

/// Whether a peer proven to be a process of this host is read directly: same-host reads on and
/// all its memory host memory.
fn reads_directly(enabled: bool, meta: &EngineMetadata) -> bool {
    enabled && meta.regions.iter().all(|r| r.memory == MemoryType::Host)
}

/// The process on the other end of `link`, if the peer names one of this host and the kernel
/// confirms it (`Ok(None)`: none named, or it cannot be checked); an error when the kernel
/// shows the claim false and same-host reads would have believed it.
fn peer_process(
    shared: &Shared,
    meta: &EngineMetadata,
    link: &PeerLink,
) -> Result<Option<PeerProcess>, String> {
    let Some(claim) = claim_on_this_host(shared.boot_id.as_deref(), shared.pid_namespace, meta)
    else {
        return Ok(None);
    };
    match PeerProcess::prove(link.socket(), claim.pid, claim.socket_fd) {
        Ok(process) => Ok(Some(process)),
        Err(OpenError::Unreadable(e)) => {
            log::info!(
                "peer {} claims to be process {} on this host, which cannot be checked (it is read through UCX): {e}",
                meta.engine_id,
                claim.pid
            );
            Ok(None)
        }
        // Without same-host reads a false claim only vouches for nothing (a relay between
        // engines of this host may then be used).
        Err(OpenError::Forged(e)) if shared.same_host_reads => Err(e),
        Err(OpenError::Forged(e)) => {
            log::warn!("peer {} makes a false claim, ignored: {e}", meta.engine_id);
            Ok(None)
        }
    }
}

/// One handshake with the side channel at `key`, its outcome recorded in the peer table: a
/// success becomes the live connection to `key`, numbered by the table.
fn attempt_connect(
    shared: &Arc<Shared>,
    key: &str,
    host: &str,
    port: u16,
    timeout: Duration,
) -> Result<Arc<Peer>, EngineError> {
    let result = handshake_with(shared, key, host, port, timeout);
    let mut routes = lock(&shared.routes);
    // Checked under the lock `close` clears the routes with, after it stopped the engine: a
    // connection made meanwhile is either aborted by `close` or dropped here.
    let closed = shared.stop.load(Ordering::Acquire);
    let result = result.and_then(|parts| if closed { Err(EngineError::Closed) } else { Ok(parts) });
    let mut waiting = Vec::new();
    let result = result.map(|parts| {
        let connected = routes.table.on_ready(key, &parts.meta);
        if connected.restarted {
            log::info!("peer {} at {key} restarted (now generation {:#x}); its old endpoint and keys are gone", parts.meta.engine_id, parts.meta.generation);
        }
        let peer = Arc::new(Peer::new(
            key.to_owned(),
            connected.connection,
            parts.meta,
            parts.regions,
            parts.link,
            parts.same_host,
        ));
        waiting = routes.add(&peer);
        peer
    });
    if let Err(e) = &result {
        log::debug!("connecting to {key} failed: {e}");
        routes.table.on_failed(key, &e.to_string(), e.is_retryable(), Instant::now());
        waiting = routes.failed(key);
    }
    drop(routes);
    shared.table_changed.notify_all();
    if let Ok(peer) = &result {
        // Runs at once if the link died meanwhile.
        let (weak_shared, weak_peer) = (Arc::downgrade(shared), Arc::downgrade(peer));
        peer.link.on_death(Box::new(move |reason| peer_died(&weak_shared, &weak_peer, &reason)));
        log::info!(
            "connected to peer {} at {key} as {} ({} regions)",
            peer.meta.engine_id,
            peer.handle(),
            peer.meta.regions.len()
        );
    }
    settle_waiting(shared, waiting, result.as_ref().ok());
    result
}

/// A handshake's outcome, before the table numbers it.
struct Handshaken {
    link: PeerLink,
    meta: EngineMetadata,
    regions: Arc<[RegionBounds]>,
    same_host: Option<Arc<SameHostPeer>>,
}

/// Checks the peer's worker address and remote keys as UCX will parse them (see
/// [`crate::ucx::packed`]), so that a malformed one is refused at the handshake, with the
/// field named, rather than when the first read opens the endpoint.
fn check_packed_for_ucx(meta: &EngineMetadata) -> Result<(), String> {
    packed::parse_worker_address(&meta.worker_address, packed::unified_mode())
        .map_err(|e| format!("a malformed worker_address: {e}"))?;
    for (index, region) in meta.regions.iter().enumerate() {
        packed::check_rkey(&region.rkey, region.memory)
            .map_err(|e| format!("a malformed rkey for regions[{index}]: {e}"))?;
    }
    Ok(())
}

fn handshake_with(
    shared: &Arc<Shared>,
    key: &str,
    host: &str,
    port: u16,
    timeout: Duration,
) -> Result<Handshaken, EngineError> {
    if shared.stop.load(Ordering::Acquire) {
        return Err(EngineError::Closed);
    }
    let (link, meta) = PeerLink::connect(
        host,
        port,
        &shared.config.engine_id,
        Some(shared.side_channel.clone()),
        &shared.config.fingerprint,
        shared.config.secret.as_deref(),
        timeout,
        shared.config.heartbeat,
        Some(IndexFeed::open(&shared.held_index, key).into_sink()),
    )?;
    if shared.stop.load(Ordering::Acquire) {
        return Err(EngineError::Closed);
    }
    let layout = meta.layout.as_ref().ok_or_else(|| {
        EngineError::InvalidArgument(format!(
            "peer {} at {key} has not published a block layout yet",
            meta.engine_id
        ))
    })?;
    let regions: Arc<[RegionBounds]> =
        meta.regions.iter().map(|r| RegionBounds { addr: r.addr, len: r.len }).collect();
    layout.validate_within(&regions)?;
    // Whether UCX could parse what it sent first (nothing here hands its bytes to UCX), then
    // who the peer is, as the kernel says, and whether its worker address reaches this very
    // process (unless the peer is this process).
    check_packed_for_ucx(&meta).map_err(|e| {
        EngineError::InvalidArgument(format!("peer {} at {key} sent {e}", meta.engine_id))
    })?;
    let refused = |error: String| EngineError::ConnectFailed {
        address: key.to_owned(),
        error: format!("peer {:?} refused: {error}", meta.engine_id),
    };
    let process = peer_process(shared, &meta, &link).map_err(refused)?;
    let vouched = process.as_ref().is_some_and(PeerProcess::is_this_process);
    check_not_this_process(&meta.worker_address, vouched).map_err(refused)?;
    let same_host = process.filter(|_| reads_directly(shared.same_host_reads, &meta)).map(|p| {
        log::info!(
            "peer {} is process {} on this host: its blocks are read directly, not through UCX",
            meta.engine_id,
            p.pid()
        );
        Arc::new(SameHostPeer::new(p, Arc::clone(&regions)))
    });
    Ok(Handshaken { link, meta, regions, same_host })
}

fn peer_died(shared: &Weak<Shared>, peer: &Weak<Peer>, reason: &str) {
    let (Some(shared), Some(peer)) = (shared.upgrade(), peer.upgrade()) else { return };
    log::warn!("peer {} is gone ({reason}); failing its in-flight transfers", peer.handle());
    abort_peer(&shared, &peer, &format!("peer {} is gone: {reason}", peer.meta.engine_id));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handshake::{Fingerprint, RegionInfo};

    #[test]
    fn only_a_claim_of_this_host_and_pid_namespace_is_checked_and_host_memory_read_directly() {
        let region = |memory| RegionInfo { addr: 0x1000, len: 4096, rkey: vec![1; 8], memory };
        let identity = SameHostIdentity {
            boot_id: "boot-a".to_owned(),
            pid_namespace: 7,
            pid: 42,
            socket_fd: 9,
        };
        let meta = EngineMetadata {
            engine_id: "d".to_owned(),
            generation: 1,
            worker_address: vec![1; 64],
            regions: vec![region(MemoryType::Host)],
            layout: None,
            fingerprint: Fingerprint::default(),
            same_host: Some(identity.clone()),
        };
        assert_eq!(claim_on_this_host(Some("boot-a"), Some(7), &meta), Some(&identity));
        assert_eq!(claim_on_this_host(Some("boot-b"), Some(7), &meta), None, "another host");
        assert_eq!(claim_on_this_host(Some("boot-a"), Some(8), &meta), None, "another pid ns");
        assert_eq!(claim_on_this_host(None, Some(7), &meta), None, "our boot id unknown");
        assert_eq!(claim_on_this_host(Some("boot-a"), None, &meta), None, "our pid ns unknown");
        let elsewhere = EngineMetadata { same_host: None, ..meta.clone() };
        assert_eq!(claim_on_this_host(Some("boot-a"), Some(7), &elsewhere), None, "no claim");
        assert!(reads_directly(true, &meta));
        assert!(!reads_directly(false, &meta), "turned off");
        let cuda = EngineMetadata {
            regions: vec![region(MemoryType::Host), region(MemoryType::Cuda)],
            ..meta.clone()
        };
        assert!(!reads_directly(true, &cuda), "device memory goes through UCX");
    }
}
