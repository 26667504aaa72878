//! Connections to peer engines: the handshake that makes one, the handle a caller reads
//! through, and its end.
//!
//! Peers are keyed by the side channel they were connected through ("host:port"), never by the
//! engine id they declare: a second server declaring a connected engine's id is a connection of
//! its own and displaces nothing. Each connection owns whether it is open ([`Connection`]: its
//! transport and the batches posted on it, under one lock); the engine's [`PeerTable`] numbers
//! the connections and routes each address to its latest one, which callers use while it is
//! open. Callers name a connection by its handle, `engine-id@host:port#number`
//! ([`Engine::peer_status`], [`Engine::connect`]), so a read goes to the connection that was
//! checked, or fails when that one died or was replaced meanwhile; a bare engine id names the
//! one open connection declaring it, and is refused while several do.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::connect::is_retryable_engine_error;
use super::connection::{Connection, PostError, Tracked, Transport};
use super::copier::CopyQueue;
use super::lookup::IndexFeed;
use super::routes::{settle_waiting, unroute};
#[allow(unused_imports)] // rustdoc links
use super::Engine;
use super::{lock, EngineError, Inflight, Shared};
use crate::descriptors::{RegionBounds, RegionIndex};
#[allow(unused_imports)] // rustdoc links
use crate::handshake::PeerTable;
use crate::handshake::{EngineMetadata, MemoryType, SameHostIdentity};
use crate::side_channel::PeerLink;
use crate::ucx::{
    check_not_this_process, packed, Endpoint, OpenError, PeerProcess, Read, SameHostPeer,
};

/// A ready connection to one peer engine.
pub(super) struct Peer {
    /// The side channel ("host:port") it was connected through: its key in the peer table.
    pub(super) address: String,
    /// Its number in the peer table.
    pub(super) connection: u64,
    pub(super) meta: EngineMetadata,
    /// The peer's registered regions, every remote range is checked against (by the
    /// planner here, and by the transport that reads them, which shares them).
    regions: Arc<[RegionBounds]>,
    /// `regions`, indexed for those checks.
    pub(super) region_index: RegionIndex,
    pub(super) link: PeerLink,
    /// Set when the peer runs on this host and proved which process it is: its host memory is
    /// then read directly, not through the endpoint.
    pub(super) same_host: Option<Arc<SameHostPeer>>,
    /// Whether the connection is open, its transport and the batches posted on it; closed (for
    /// good: a new `connect` makes a new peer) when the peer dies, a batch to it passes its
    /// deadline through UCX, or the engine closes.
    conn: Connection<PeerTransport, Arc<Inflight>>,
}

/// How batches reach one peer: its UCX endpoint, opened by the first read (an engine
/// connected only to look up, or connected back to, holds none), and its same-host copy queue.
#[derive(Default)]
struct PeerTransport {
    endpoint: Option<Endpoint>,
    copies: CopyQueue,
}

impl Transport for PeerTransport {
    /// Closes the copy queue (a failed batch stops at its copy's next call) and aborts the
    /// endpoint ([`Endpoint::abort`]).
    fn cancel(self) {
        drop(self.copies);
        if let Some(endpoint) = self.endpoint {
            endpoint.abort();
        }
    }
}

impl Tracked for Arc<Inflight> {
    fn deadline(&self) -> Instant {
        self.deadline
    }

    fn settled(&self) -> bool {
        self.batch.outcome().is_some()
    }

    fn fails_alone(&self) -> bool {
        self.same_host
    }

    fn fail(&self, reason: &str) {
        lock(&self.abort_reason).get_or_insert_with(|| reason.to_owned());
        self.batch.fail(reason.to_owned());
    }

    fn failed(&self) -> bool {
        self.batch.has_failed()
    }
}

/// How callers name connection `connection` to `address`, which declared `engine_id`.
pub(super) fn handle(engine_id: &str, address: &str, connection: u64) -> String {
    format!("{engine_id}@{address}#{connection}")
}

impl Peer {
    pub(super) fn handle(&self) -> String {
        handle(&self.meta.engine_id, &self.address, self.connection)
    }

    /// Whether the connection is still open (its own say; the peer table only routes).
    pub(super) fn is_live(&self) -> bool {
        self.conn.is_open()
    }

    /// Starts `reads` of `inflight`'s batch and tracks it on this connection, or fails it when
    /// the connection closed: with `direct` (the peer on this host, every local range host
    /// memory) on the peer's copy thread, else posted on the peer's endpoint, opened on first
    /// use. A post that may have left reads in flight closes the connection, which cancels
    /// them; the batch then fails when the last of them has completed, so no byte lands in
    /// blocks the caller then reuses.
    pub(super) fn post(
        &self,
        shared: &Shared,
        inflight: &Arc<Inflight>,
        reads: &[Read<'_>],
        direct: Option<&Arc<SameHostPeer>>,
    ) {
        let batch = &inflight.batch;
        let closed = self.conn.post(Arc::clone(inflight), |transport| match direct {
            Some(direct) => {
                let copy = direct.prepare(reads, batch).map_err(PostError::NothingPosted)?;
                // A copy the queue refuses is dropped, which fails its batch.
                transport
                    .copies
                    .submit(copy, &shared.copy_threads, &self.meta.engine_id)
                    .map_err(PostError::NothingPosted)
            }
            None => {
                let endpoint = match transport.endpoint.take() {
                    Some(endpoint) => endpoint,
                    None => self.open_endpoint(shared)?,
                };
                let endpoint = transport.endpoint.insert(endpoint);
                if let Some(status) = endpoint.failure() {
                    // Closes the connection; the next `connect` makes another.
                    return Err(PostError::MaybePartial(format!("the endpoint failed: {status}")));
                }
                endpoint
                    .post_reads(reads, batch)
                    .map_err(|e| PostError::MaybePartial(e.to_string()))
            }
        });
        if closed {
            unroute(shared, self);
        }
    }

    /// Opens the UCX endpoint to the peer, with peer error handling unless the engine's
    /// configuration turned it off (the same on every endpoint).
    ///
    /// Why every endpoint: with it a batch fails at its deadline whatever the peer does. UCX
    /// lets only such an endpoint be force-closed (`ucp.h`, `UCP_EP_CLOSE_FLAG_FORCE`:
    /// undefined behaviour without `UCP_ERR_HANDLING_MODE_PEER`), and a force close cancels
    /// every read on it without the peer's reply: `ucp_ep_close_nbx` discards the endpoint's
    /// transport lanes with a cancelling flush (`UCT_FLUSH_FLAG_CANCEL`: a tcp socket is
    /// closed, an InfiniBand queue pair moved to its error state, so the NIC writes nothing
    /// more), and completes the reads as `UCS_ERR_CANCELED` only once those lanes are flushed
    /// (`ucp_ep_discard_lanes` purges the requests in its completion callback). So when a
    /// read's completion comes back no byte of it can land any more, and its batch, which
    /// settles on its last read's completion, is reported failed exactly then, within this
    /// process's own progress. A remote failure is then an error of the endpoint, not of the
    /// process (on InfiniBand's rc transports an unhandled one has been fatal to the reader).
    /// Without it an endpoint can only be closed with a flush, which a frozen peer may never
    /// answer: a read it has not served stays out, and its batch pending (failed, never
    /// reported read) until the peer serves it or dies.
    ///
    /// Why not per peer, off for one on this host: its fast path is not UCX. A peer the
    /// handshake proved to run on this host (its process vouched for what it sent, read out of
    /// that very process: [`SameHostPeer`]; never an address or a boot id, which containers
    /// share) has its host memory read directly, never through an endpoint; UCX reads a peer on
    /// this host only where that proof failed (another pid namespace: UCX's own cma fails
    /// there too, and what it falls back to needs the peer to serve) or for device memory,
    /// whose cuda_ipc transport handles peer errors. And the mode must be the one the peer
    /// picks for its endpoint to us: UCX pairs the two endpoints of two workers and refuses
    /// "asymmetric endpoint configuration" (`ucp_ep_config_err_mode_check_mismatch`), which a
    /// rule each side evaluates on its own view of the other (memory types, what each could
    /// prove) does not guarantee.
    fn open_endpoint(&self, shared: &Shared) -> Result<Endpoint, PostError> {
        let rkeys: Vec<(&[u8], MemoryType)> =
            self.meta.regions.iter().map(|r| (r.rkey.as_slice(), r.memory)).collect();
        shared
            .worker
            .connect(
                &self.meta.worker_address,
                Arc::clone(&self.regions),
                &rkeys,
                shared.config.peer_error_handling,
            )
            .map_err(|e| {
                // Only transports that report a peer's failure can carry such an endpoint.
                let hint = if shared.config.peer_error_handling {
                    " (with peer_error_handling, UCX_TLS must allow a transport that handles \
                     peer errors, e.g. tcp, rc or cuda_ipc; UCX's shared memory does not)"
                } else {
                    ""
                };
                PostError::NothingPosted(format!(
                    "cannot open an endpoint to peer {}: {e}{hint}",
                    self.meta.engine_id
                ))
            })
    }

    /// Fails this connection's batches that passed their deadline by `now`: a same-host one
    /// alone, a UCX one by closing the connection (the next `connect` re-handshakes).
    pub(super) fn expire(&self, shared: &Shared, now: Instant) {
        let reason = |_: &Arc<Inflight>| {
            format!(
                "deadline passed before the last byte arrived from peer {}",
                self.meta.engine_id
            )
        };
        let (failed_alone, closed) = self.conn.expire(now, reason);
        if failed_alone > 0 {
            log::warn!(
                "{failed_alone} same-host batches from peer {} passed their deadline",
                self.meta.engine_id
            );
        }
        if closed {
            log::warn!(
                "a batch from peer {} passed its deadline; closing the connection to it",
                self.handle()
            );
            unroute(shared, self);
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
pub(super) fn attempt_connect(
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
        let peer = Arc::new(Peer {
            address: key.to_owned(),
            connection: connected.connection,
            same_host: parts.same_host,
            meta: parts.meta,
            region_index: RegionIndex::new(&parts.regions),
            regions: parts.regions,
            link: parts.link,
            conn: Connection::new(PeerTransport::default()),
        });
        waiting = routes.add(&peer);
        peer
    });
    if let Err(e) = &result {
        log::debug!("connecting to {key} failed: {e}");
        routes.table.on_failed(key, &e.to_string(), is_retryable_engine_error(e), Instant::now());
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

/// Closes the connection (failing its batches and cancelling their reads: see
/// [`Endpoint::abort`]; a batch settles only when its last read has completed, so one whose
/// reads UCX has not released stays pending rather than be reported while bytes may land) and
/// ends it in the peer table (a newer connection to its address is left alone).
pub(super) fn abort_peer(shared: &Shared, peer: &Peer, reason: &str) {
    peer.conn.close(reason);
    unroute(shared, peer);
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
