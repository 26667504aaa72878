//! Connections to peer engines: the handle a caller reads through, the batches in flight on
//! it ([`Inflight`]), and its end. The handshake that makes one is `connect.rs`'s.
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

use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::connection::{verdict, Connection, PostError, Tracked, Transport};
use super::copier::CopyQueue;
#[allow(unused_imports)] // rustdoc links
use super::Engine;
use super::{lock, Shared};
use crate::descriptors::{RegionBounds, RegionIndex};
#[allow(unused_imports)] // rustdoc links
use crate::handshake::PeerTable;
use crate::handshake::{EngineMetadata, MemoryType};
use crate::same_host::SameHostPeer;
use crate::side_channel::PeerLink;
use crate::ucx::{BatchState, Endpoint, Read};

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

/// A posted batch as the engine tracks it: for deadlines, peer deaths and the notification
/// that must follow the last byte.
pub(super) struct Inflight {
    /// Its number in the engine's [`super::inflight::InflightBook`].
    pub(super) number: u64,
    pub(super) batch: Arc<BatchState>,
    pub(super) peer: Arc<Peer>,
    pub(super) deadline: Instant,
    pub(super) notify: Mutex<Option<Vec<u8>>>,
    /// Why the engine failed this batch, which says more than UCX's "canceled".
    pub(super) abort_reason: Mutex<Option<String>>,
    /// Read directly (same-host reads): nothing to cancel in UCX, a failed batch stops at
    /// its copy's next call.
    pub(super) same_host: bool,
}

impl Inflight {
    /// The batch's result once it settled: a failure if that was after its deadline
    /// ([`verdict`]).
    pub(super) fn result(&self) -> Option<Result<(), String>> {
        let (outcome, settled_at) = self.batch.settled()?;
        Some(verdict(outcome, settled_at, self.deadline))
    }
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
    /// Connection `connection` to the side channel at `address`, whose handshake gave `meta`
    /// and `link` (and `regions`, its regions' bounds; `same_host`, its process when read
    /// directly).
    pub(super) fn new(
        address: String,
        connection: u64,
        meta: EngineMetadata,
        regions: Arc<[RegionBounds]>,
        link: PeerLink,
        same_host: Option<Arc<SameHostPeer>>,
    ) -> Peer {
        Peer {
            address,
            connection,
            same_host,
            meta,
            region_index: RegionIndex::new(&regions),
            regions,
            link,
            conn: Connection::new(PeerTransport::default()),
        }
    }

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
    /// blocks the caller then reuses. Returns whether it closed the connection (the caller
    /// then takes it out of the routes).
    pub(super) fn post(
        &self,
        shared: &Shared,
        inflight: &Arc<Inflight>,
        reads: &[Read<'_>],
        direct: Option<&Arc<SameHostPeer>>,
    ) -> bool {
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
        closed
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

    /// Fails those of `due`, batches posted on this connection, that passed their deadline by
    /// `now` unsettled: a same-host one alone, a UCX one by closing the connection (the next
    /// `connect` re-handshakes); returns whether it closed (the caller then takes it out of
    /// the routes).
    pub(super) fn expire(&self, due: &[Arc<Inflight>], now: Instant) -> bool {
        let reason = |_: &Arc<Inflight>| {
            format!(
                "deadline passed before the last byte arrived from peer {}",
                self.meta.engine_id
            )
        };
        let (failed_alone, closed) = self.conn.expire(due, now, reason);
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
        }
        closed
    }

    /// Closes the connection, failing its batches ([`Connection::close`]).
    pub(super) fn close(&self, reason: &str) {
        self.conn.close(reason);
    }
}
