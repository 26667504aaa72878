//! Connections to peer engines: the handshake that makes one, the handle a caller reads
//! through, and its end.
//!
//! Peers are keyed by the side channel they were connected through ("host:port"), never by the
//! engine id they declare: a second server declaring a connected engine's id is a connection of
//! its own and displaces nothing. The engine's [`PeerTable`] is the one owner of liveness: it
//! numbers each ready connection, and a connection is live exactly while the table's entry for
//! its address is ready with its number. Callers name a connection by its handle,
//! `engine-id@host:port#number` ([`Engine::peer_status`], [`Engine::connect`]), so a read goes
//! to the connection that was checked, or fails when that one died or was replaced meanwhile;
//! a bare engine id names the one live connection declaring it, and is refused while several
//! do.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::connect::is_retryable_engine_error;
use super::copier::CopyQueue;
use super::lookup::IndexFeed;
#[allow(unused_imports)] // rustdoc links
use super::Engine;
use super::{lock, EngineError, Inflight, Shared};
use crate::clock::deadline_after;
use crate::descriptors::{RegionBounds, RegionIndex};
use crate::handshake::{
    ConnectDecision, EngineMetadata, HandshakeError, MemoryType, PeerState, SameHostIdentity,
};
use crate::side_channel::PeerLink;
use crate::ucx::{
    check_not_this_process, packed, BatchState, Endpoint, OpenError, PeerProcess, Read,
    SameHostPeer,
};

/// A ready connection to one peer engine.
pub(super) struct Peer {
    /// The side channel ("host:port") it was connected through: its key in the peer table.
    pub(super) address: String,
    /// Its number in the peer table, which says whether it is still the live connection.
    pub(super) connection: u64,
    pub(super) meta: EngineMetadata,
    /// The peer's registered regions, every remote range is checked against (by the
    /// planner here, and by the transport that reads them, which shares them).
    regions: Arc<[RegionBounds]>,
    /// `regions`, indexed for those checks.
    pub(super) region_index: RegionIndex,
    /// Opened by the first read (an engine connected only to look up, or connected back to,
    /// holds no UCX endpoint); taken (and aborted) when the peer dies or a batch to it passes
    /// its deadline.
    endpoint: Mutex<Option<Endpoint>>,
    /// The endpoint was opened once; it is never reopened (a new `connect` makes a new peer).
    endpoint_opened: AtomicBool,
    pub(super) link: PeerLink,
    /// Set when the peer runs on this host and proved which process it is: its host memory is
    /// then read directly, not through the endpoint.
    pub(super) same_host: Option<Arc<SameHostPeer>>,
    /// Its same-host batches, for its own copy thread; closed by `abort_peer`.
    copies: Mutex<CopyQueue>,
}

/// How callers name connection `connection` to `address`, which declared `engine_id`.
fn handle(engine_id: &str, address: &str, connection: u64) -> String {
    format!("{engine_id}@{address}#{connection}")
}

impl Peer {
    pub(super) fn handle(&self) -> String {
        handle(&self.meta.engine_id, &self.address, self.connection)
    }

    /// Whether the peer table still has this connection as the live one to its address.
    pub(super) fn is_live(&self, shared: &Shared) -> bool {
        lock(&shared.table).is_current(&self.address, self.connection)
    }

    /// Starts `reads`, whose batch the engine tracks already: with `direct` (the peer on this
    /// host, every local range host memory) on the peer's copy thread, else posted on the
    /// peer's endpoint, opened on first use. A peer that died after the caller found it live,
    /// and before the batch was tracked (unseen by `abort_peer`), is seen here: `abort_peer`
    /// ends the connection in the table and takes the endpoint first.
    pub(super) fn start_reads(
        &self,
        shared: &Shared,
        reads: &[Read<'_>],
        batch: &Arc<BatchState>,
        direct: Option<&Arc<SameHostPeer>>,
    ) -> Result<(), PostError> {
        if let Some(direct) = direct {
            if !self.is_live(shared) {
                return Err(PostError::NothingPosted(format!(
                    "peer {} was disconnected",
                    self.meta.engine_id
                )));
            }
            let copy = direct.prepare(reads, batch).map_err(PostError::NothingPosted)?;
            // A copy the queue refuses is dropped, which fails its batch.
            return lock(&self.copies)
                .submit(copy, &shared.copy_threads, &self.meta.engine_id)
                .map_err(PostError::NothingPosted);
        }
        let mut endpoint = lock(&self.endpoint);
        if endpoint.is_none()
            && self.is_live(shared)
            && !self.endpoint_opened.swap(true, Ordering::AcqRel)
        {
            let rkeys: Vec<(&[u8], MemoryType)> =
                self.meta.regions.iter().map(|r| (r.rkey.as_slice(), r.memory)).collect();
            let opened = shared.worker.connect(
                &self.meta.worker_address,
                Arc::clone(&self.regions),
                &rkeys,
                shared.config.peer_error_handling,
            );
            let opened = opened.map_err(|e| {
                PostError::NothingPosted(format!(
                    "cannot open an endpoint to peer {}: {e}",
                    self.meta.engine_id
                ))
            })?;
            *endpoint = Some(opened);
        }
        match endpoint.as_ref() {
            Some(endpoint) => endpoint
                .post_reads(reads, batch)
                .map_err(|e| PostError::MaybePartial(e.to_string())),
            None => Err(PostError::NothingPosted(format!(
                "peer {} was disconnected",
                self.meta.engine_id
            ))),
        }
    }
}

/// Why a batch could not be posted, and whether some of its reads may be in flight anyway.
pub(super) enum PostError {
    NothingPosted(String),
    /// A post failed after earlier reads of the batch were posted: they may still write.
    MaybePartial(String),
}

/// The live connection `peer` names: a handle ([`Peer::handle`]), or a bare engine id that
/// exactly one live connection declared.
pub(super) fn resolve(shared: &Shared, peer: &str) -> Result<Arc<Peer>, EngineError> {
    let table = lock(&shared.table);
    let peers = lock(&shared.peers);
    let numbered = peer
        .rsplit_once('#')
        .and_then(|(_, n)| n.parse::<u64>().ok())
        .filter(|_| peer.contains('@'));
    if let Some(connection) = numbered {
        return peers
            .get(&connection)
            .filter(|p| p.handle() == peer && table.is_current(&p.address, connection))
            .cloned()
            .ok_or_else(|| EngineError::PeerNotConnected(peer.to_owned()));
    }
    let mut claiming = peers
        .values()
        .filter(|p| p.meta.engine_id == peer && table.is_current(&p.address, p.connection));
    match (claiming.next(), claiming.next()) {
        (Some(only), None) => Ok(Arc::clone(only)),
        (None, _) => Err(EngineError::PeerNotConnected(peer.to_owned())),
        (Some(a), Some(b)) => Err(EngineError::AmbiguousPeer {
            engine_id: peer.to_owned(),
            addresses: format!("{} and {}", a.address, b.address),
        }),
    }
}

/// The peer table's decision for `key`; a ready entry whose connection is gone from the
/// engine counts as dead and is connected afresh.
pub(super) fn begin_connect(shared: &Shared, key: &str, now: Instant) -> ConnectDecision {
    let mut table = lock(&shared.table);
    let decision = table.begin_connect(key, now);
    if let ConnectDecision::Ready { connection, .. } = &decision {
        if !lock(&shared.peers).contains_key(connection) {
            table.mark_dead(key, *connection);
            return table.begin_connect(key, now);
        }
    }
    decision
}

/// [`Engine::connect`]: the handle of the connection to `host:port`; also run by the lookup
/// threads ([`Engine::start_lookup`]).
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
        let table = lock(&shared.table);
        // An attempt that ended before this lock was taken was signalled already: look again.
        if for_other_attempt && !matches!(table.state(&key), PeerState::Connecting { .. }) {
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
        drop(shared.table_changed.wait_timeout(table, left).unwrap_or_else(|p| p.into_inner()));
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
pub(super) fn attempt_connect(
    shared: &Arc<Shared>,
    key: &str,
    host: &str,
    port: u16,
    timeout: Duration,
) -> Result<Arc<Peer>, EngineError> {
    let result = handshake_with(shared, key, host, port, timeout);
    let mut table = lock(&shared.table);
    let result = result.map(|parts| {
        let connected = table.on_ready(key, &parts.meta);
        if connected.restarted {
            log::info!("peer {} at {key} restarted (now generation {:#x}); its old endpoint and keys are gone", parts.meta.engine_id, parts.meta.generation);
        }
        let peer = Arc::new(Peer {
            address: key.to_owned(),
            connection: connected.connection,
            same_host: parts.same_host,
            meta: parts.meta,
            region_index: RegionIndex::new(&parts.regions),
            regions: parts.regions,
            endpoint: Mutex::new(None),
            endpoint_opened: AtomicBool::new(false),
            link: parts.link,
            copies: Mutex::new(CopyQueue::NotStarted),
        });
        lock(&shared.peers).insert(connected.connection, Arc::clone(&peer));
        peer
    });
    if let Err(e) = &result {
        log::debug!("connecting to {key} failed: {e}");
        table.on_failed(key, &e.to_string(), is_retryable_engine_error(e), Instant::now());
    }
    drop(table);
    shared.table_changed.notify_all();
    let peer = result?;
    // Runs at once if the link died meanwhile.
    let (weak_shared, weak_peer) = (Arc::downgrade(shared), Arc::downgrade(&peer));
    peer.link.on_death(Box::new(move |reason| peer_died(&weak_shared, &weak_peer, &reason)));
    log::info!(
        "connected to peer {} at {key} as {} ({} regions)",
        peer.meta.engine_id,
        peer.handle(),
        peer.meta.regions.len()
    );
    Ok(peer)
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

/// Ends the connection in the peer table (a newer connection to its address is left alone),
/// force-closes its endpoint (UCX completes every outstanding read on it as cancelled, after
/// which none of them writes) and then fails its batches. A batch settles only when its last
/// read has completed, so one whose reads UCX has not released (a close that timed out) stays
/// pending rather than be reported while bytes may land.
pub(super) fn abort_peer(shared: &Shared, peer: &Arc<Peer>, reason: &str) {
    let was_live = lock(&shared.table).mark_dead(&peer.address, peer.connection);
    let was_known = lock(&shared.peers).remove(&peer.connection).is_some();
    if !was_live && !was_known && lock(&peer.endpoint).is_none() {
        return;
    }
    let victims: Vec<Arc<Inflight>> =
        lock(&shared.inflight).iter().filter(|i| Arc::ptr_eq(&i.peer, peer)).cloned().collect();
    for inflight in &victims {
        lock(&inflight.abort_reason).get_or_insert_with(|| reason.to_string());
    }
    lock(&peer.copies).close();
    let endpoint = lock(&peer.endpoint).take();
    if let Some(endpoint) = endpoint {
        endpoint.abort();
    }
    for inflight in &victims {
        inflight.batch.fail(reason.to_string());
        let unfinished = inflight.batch.unfinished_reads();
        if unfinished > 0 && !inflight.same_host {
            log::error!("{unfinished} reads from peer {} are still outstanding after closing its endpoint; their batch stays pending until they complete", peer.meta.engine_id);
        }
    }
}

/// The live connection to `key`, if the peer table has one ready.
pub(super) fn ready_peer(shared: &Shared, key: &str) -> Option<Arc<Peer>> {
    let table = lock(&shared.table);
    let PeerState::Ready { connection, .. } = table.state(key) else { return None };
    lock(&shared.peers).get(connection).cloned()
}

pub(super) fn connect_for_lookup(
    shared: &Arc<Shared>,
    host: &str,
    port: u16,
    deadline: Instant,
) -> Result<Arc<Peer>, String> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err("no time left to connect".to_owned());
    }
    let handle = connect_blocking(shared, host, port, left).map_err(|e| e.to_string())?;
    resolve(shared, &handle).map_err(|e| e.to_string())
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
