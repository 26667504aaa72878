//! The engine: one per process (per vLLM worker). It ties the UCX worker, the side channel,
//! the local memory/layout and the per-peer connections together, and turns block-id reads
//! into posted batches.
//!
//! Verbs, in order of use: [`Engine::start`] → [`Engine::register_region`] /
//! [`Engine::set_layout`] → [`Engine::connect`] → [`Engine::read_blocks`] → poll or wait the
//! [`Transfer`] → the owner drains [`Engine::take_notifications`].
//!
//! Owners also hold finished requests' blocks for readers ([`Engine::hold`] →
//! [`Engine::release_hold`] / [`Engine::expire_holds`] / [`Engine::evict_holds`]) and answer
//! other engines' [`Engine::lookup`]s of offered holds over the side channel.

mod copier;
mod lookup;
mod peer;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard, RwLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::descriptors::{
    check_remote_bounds, plan_reads, plan_segment_reads, BlockLayout, BlockSlice, PlanError,
    RegionBounds,
};
use crate::handshake::{
    new_generation, ConnectDecision, EngineMetadata, Fingerprint, HandshakeError, MemoryType,
    PeerTable, RegionInfo, RetryPolicy, SameHostIdentity,
};
use crate::holds::{BlockFingerprint, Evict, HoldBook, HoldError, HoldKind};
use crate::side_channel::{KnownPeer, Notification, SideChannelConfig, SideChannelServer};
pub use crate::ucx::RegionMemory;
use crate::ucx::{
    boot_id, ucx_tls_allows_cma, BatchState, MemRegion, Probe, Read, UcxError, Worker,
};
use copier::CopyThreads;
use lookup::{lookup_handler, LookupQuestion};
pub use lookup::{
    LookupAnswer, LookupFanOut, LATE_REPLY_WINDOW, NOT_YET_FIRST_RETRY, NOT_YET_MAX_RETRY,
};
use peer::{
    abort_peer, attempt_connect, begin_connect, connect_blocking, connect_for_lookup, ready_peer,
    resolve, Peer, PostError,
};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Ucx(#[from] UcxError),
    #[error(transparent)]
    Handshake(#[from] HandshakeError),
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error("no connection to peer engine {0:?} (connect first; it may have died, restarted or been replaced)")]
    PeerNotConnected(String),
    #[error("the engines at {addresses} all declare the id {engine_id:?}: name the connection by the handle `peer_status` or `connect` returned")]
    AmbiguousPeer { engine_id: String, addresses: String },
    #[error("cannot connect to {address}: {error}")]
    ConnectFailed { address: String, error: String },
    #[error("transfer failed: {0}")]
    Transfer(String),
    #[error("timed out after {0:?} waiting for the transfer")]
    WaitTimeout(Duration),
    #[error("{0}")]
    InvalidArgument(String),
    #[error(transparent)]
    Hold(#[from] HoldError),
    #[error("engine is closed")]
    Closed,
}

#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub engine_id: String,
    pub fingerprint: Fingerprint,
    pub host: String,
    /// 0 picks a free port.
    pub port: u16,
    pub secret: Option<Vec<u8>>,
    pub ucx_lib_dir: Option<PathBuf>,
    pub heartbeat: Duration,
    /// UCX peer error handling on endpoints; see [`Worker::connect`] for the trade-off.
    pub peer_error_handling: bool,
    /// How long a lookup's match stays claimed for its reader (unless released earlier).
    pub lookup_claim: Duration,
    /// Serve peers without a shared secret on a non-loopback address (trusted networks).
    pub allow_unauthenticated: bool,
    /// Read peers on this host with `process_vm_readv`, a batch per call, instead of UCX (host
    /// memory only; off by itself when `UCX_TLS` rules out UCX's own cma).
    pub same_host_reads: bool,
}

struct LocalMemory {
    /// Shared with the batches that write into them (UCX or same-host), which keep them
    /// registered until they end.
    regions: Vec<Arc<MemRegion>>,
    layout: Option<BlockLayout>,
}

/// Where the connection to one peer's side channel stands ([`Engine::peer_status`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerStatus {
    /// Connected: the connection's handle (`engine-id@host:port#n`), which reads name.
    Ready(String),
    Connecting,
    /// The last attempt failed; the next one starts after the table's backoff.
    Failed(String),
}

/// A posted batch as the engine tracks it: for deadlines, peer deaths and the notification
/// that must follow the last byte.
struct Inflight {
    batch: Arc<BatchState>,
    peer: Arc<Peer>,
    deadline: Instant,
    notify: Mutex<Option<Vec<u8>>>,
    /// Why the engine failed this batch, which says more than UCX's "canceled".
    abort_reason: Mutex<Option<String>>,
    /// Read directly (same-host reads): nothing to cancel in UCX, a failed batch stops at
    /// its copy's next call.
    same_host: bool,
}

struct Shared {
    config: EngineConfig,
    generation: u64,
    /// Proves this process to same-host readers (its key, through our side channel); its
    /// address is in our metadata.
    probe: Probe,
    /// This host's boot id (`None` where it cannot be read: no same-host reads either way).
    boot_id: Option<String>,
    /// Whether we read same-host peers directly: the config allows it and `UCX_TLS` does not
    /// rule out UCX's cma, which these reads replace.
    same_host_reads: bool,
    /// Every same-host peer's copy thread ([`copier`]).
    copy_threads: CopyThreads,
    worker: Arc<Worker>,
    server: Mutex<Option<SideChannelServer>>,
    local: RwLock<LocalMemory>,
    /// Ready connections by the number the table gave them (see [`peer`]); whether one is
    /// live is the table's to say.
    peers: Mutex<HashMap<u64, Arc<Peer>>>,
    /// The one owner of connection state by side-channel address: connect, wait, back off,
    /// or use the live connection. Lock order: `table`, then `peers`.
    table: Mutex<PeerTable>,
    /// Signalled whenever a connection attempt ends.
    table_changed: Condvar,
    inflight: Mutex<Vec<Arc<Inflight>>>,
    /// This engine's held blocks; the side channel's lookups read it too.
    holds: Arc<Mutex<HoldBook>>,
    /// "host:port" of our side channel, announced to the owners we connect to.
    side_channel: String,
    /// Handshakes started by [`Engine::peer_status`], joined by `close`.
    handshakes: Mutex<Vec<JoinHandle<()>>>,
    /// Read-done notifications for the notifier thread; `None` once the engine closes.
    outbox: Mutex<Option<mpsc::Sender<Outgoing>>>,
    stop: AtomicBool,
}

/// A notification to send to the owner a batch was read from.
struct Outgoing {
    peer: Arc<Peer>,
    payload: Vec<u8>,
}

pub struct Engine {
    shared: Arc<Shared>,
    progress_thread: Option<JoinHandle<()>>,
    notifier_thread: Option<JoinHandle<()>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Engine {
    pub fn start(config: EngineConfig) -> Result<Engine, EngineError> {
        if config.engine_id.is_empty() {
            return Err(EngineError::InvalidArgument("engine_id must not be empty".into()));
        }
        let worker = Worker::new(&config.engine_id, config.ucx_lib_dir.as_deref())?;
        let generation = new_generation()?;
        let probe = Probe::new(worker.address()).map_err(EngineError::InvalidArgument)?;
        let boot_id = boot_id();
        let same_host_reads = config.same_host_reads
            && boot_id.is_some()
            && ucx_tls_allows_cma(std::env::var("UCX_TLS").ok().as_deref());
        let meta = metadata(
            &config,
            generation,
            &worker,
            boot_id.as_deref(),
            &probe,
            &LocalMemory { regions: Vec::new(), layout: None },
        );
        let server = SideChannelServer::start(
            SideChannelConfig {
                host: config.host.clone(),
                port: config.port,
                secret: config.secret.clone(),
                heartbeat: config.heartbeat,
                allow_unauthenticated: config.allow_unauthenticated,
                same_host_key: Some(probe.key()),
            },
            meta,
        )?;
        let side_channel = format!("{}:{}", config.host, server.local_addr().port());
        log::info!(
            "engine {} (generation {generation:#x}) serving its side channel on {side_channel}",
            config.engine_id
        );
        let holds = Arc::new(Mutex::new(HoldBook::new()));
        let (outbox, queue) = mpsc::channel();
        server.set_lookup_handler(lookup_handler(Arc::downgrade(&holds), config.lookup_claim));
        let shared = Arc::new(Shared {
            config,
            generation,
            probe,
            boot_id,
            same_host_reads,
            copy_threads: CopyThreads::default(),
            worker,
            server: Mutex::new(Some(server)),
            local: RwLock::new(LocalMemory { regions: Vec::new(), layout: None }),
            peers: Mutex::new(HashMap::new()),
            table: Mutex::new(PeerTable::new(RetryPolicy::default())),
            table_changed: Condvar::new(),
            inflight: Mutex::new(Vec::new()),
            holds,
            side_channel,
            handshakes: Mutex::new(Vec::new()),
            outbox: Mutex::new(Some(outbox)),
            stop: AtomicBool::new(false),
        });
        let notifier_thread = std::thread::Builder::new()
            .name("kvduplex-notify".into())
            .spawn(move || send_notifications(&queue))
            .map_err(|e| {
                EngineError::InvalidArgument(format!("cannot start the notifier thread: {e}"))
            })?;
        let weak = Arc::downgrade(&shared);
        let progress_thread = std::thread::Builder::new()
            .name("kvduplex-progress".into())
            .spawn(move || progress_loop(weak))
            .map_err(|e| {
                EngineError::InvalidArgument(format!("cannot start the progress thread: {e}"))
            })?;
        Ok(Engine {
            shared,
            progress_thread: Some(progress_thread),
            notifier_thread: Some(notifier_thread),
        })
    }

    pub fn engine_id(&self) -> &str {
        &self.shared.config.engine_id
    }

    pub fn generation(&self) -> u64 {
        self.shared.generation
    }

    pub fn side_channel_addr(&self) -> Result<std::net::SocketAddr, EngineError> {
        lock(&self.shared.server).as_ref().map(|s| s.local_addr()).ok_or(EngineError::Closed)
    }

    /// Registers memory peers may read and our reads write into. That it stays allocated
    /// while registered is `memory`'s promise, made where the range comes from (the `unsafe`
    /// [`RegionMemory::new`]); a host range is also checked to be mapped now.
    pub fn register_region(&self, memory: RegionMemory) -> Result<(), EngineError> {
        let (addr, len) = (memory.addr(), memory.len());
        if addr == 0 || len == 0 {
            return Err(EngineError::InvalidArgument(format!(
                "cannot register region {addr:#x}+{len}: null address or zero length"
            )));
        }
        let mut local = self.shared.local.write().unwrap_or_else(|p| p.into_inner());
        if local
            .regions
            .iter()
            .any(|r| addr < r.addr.saturating_add(r.len) && r.addr < addr.saturating_add(len))
        {
            return Err(EngineError::InvalidArgument(format!(
                "region {addr:#x}+{len} overlaps a registered region"
            )));
        }
        let region = self.shared.worker.register(memory)?;
        log::info!("registered {:?} region {addr:#x}+{len}", region.memory);
        local.regions.push(Arc::new(region));
        self.publish(&local)
    }

    pub fn set_layout(&self, layout: BlockLayout) -> Result<(), EngineError> {
        let mut local = self.shared.local.write().unwrap_or_else(|p| p.into_inner());
        layout.validate_within(&bounds(&local.regions))?;
        local.layout = Some(layout);
        self.publish(&local)
    }

    fn publish(&self, local: &LocalMemory) -> Result<(), EngineError> {
        let shared = &self.shared;
        let meta = metadata(
            &shared.config,
            shared.generation,
            &shared.worker,
            shared.boot_id.as_deref(),
            &shared.probe,
            local,
        );
        lock(&self.shared.server).as_ref().ok_or(EngineError::Closed)?.set_metadata(meta);
        Ok(())
    }

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
                let shared = Arc::clone(&self.shared);
                let (host, thread_key) = (host.to_owned(), key.clone());
                let spawned =
                    std::thread::Builder::new().name("kvduplex-connect".into()).spawn(move || {
                        drop(attempt_connect(&shared, &thread_key, &host, port, timeout))
                    });
                match spawned {
                    Ok(handle) => {
                        let mut handles = lock(&self.shared.handshakes);
                        handles.retain(|h| !h.is_finished());
                        handles.push(handle);
                        PeerStatus::Connecting
                    }
                    Err(e) => {
                        let error = format!("cannot start a handshake thread: {e}");
                        lock(&self.shared.table).on_failed(&key, &error, true, Instant::now());
                        self.shared.table_changed.notify_all();
                        PeerStatus::Failed(error)
                    }
                }
            }
        }
    }

    /// Whether `peer` (a handle, or a bare engine id) names a live connection.
    pub fn peer_alive(&self, peer: &str) -> bool {
        resolve(&self.shared, peer).is_ok()
    }
}

/// What this engine publishes to readers; the side channel adds each connection's same-host
/// proof. The identity is published even where the boot id is unknown (empty: no reader reads
/// us directly then), so that engines of one process can still prove themselves to each other
/// (see `check_not_this_process`).
fn metadata(
    config: &EngineConfig,
    generation: u64,
    worker: &Worker,
    boot_id: Option<&str>,
    probe: &Probe,
    local: &LocalMemory,
) -> EngineMetadata {
    let identity = SameHostIdentity {
        boot_id: boot_id.unwrap_or_default().to_owned(),
        pid: std::process::id(),
        probe_addr: probe.addr(),
        proof: [0; 32],
    };
    EngineMetadata {
        engine_id: config.engine_id.clone(),
        generation,
        worker_address: worker.address().to_vec(),
        regions: local
            .regions
            .iter()
            .map(|r| RegionInfo {
                addr: r.addr,
                len: r.len,
                rkey: r.rkey.clone(),
                memory: r.memory,
            })
            .collect(),
        layout: local.layout.clone(),
        fingerprint: config.fingerprint.clone(),
        same_host: Some(identity),
    }
}

impl Engine {
    /// Plans, bounds-checks and posts the reads of `remote_ids` into `local_ids`: whole blocks,
    /// or with `slice` only that sub-range of every block (see [`crate::descriptors`]). A peer
    /// on this host is read directly ([`Transfer::same_host`]), by that peer's own copy
    /// thread. `peer_id` is the handle of the
    /// connection to read through ([`Engine::peer_status`]; fails if that connection died or
    /// was replaced), or a bare engine id that one live connection declared.
    #[allow(clippy::too_many_arguments)]
    pub fn read_blocks(
        &self,
        peer_id: &str,
        local_ids: &[i64],
        remote_ids: &[i64],
        notify: Option<Vec<u8>>,
        timeout: Duration,
        segments: Option<std::ops::Range<usize>>,
        slice: Option<BlockSlice>,
    ) -> Result<Transfer, EngineError> {
        if self.shared.stop.load(Ordering::Acquire) {
            return Err(EngineError::Closed);
        }
        let peer = resolve(&self.shared, peer_id)?;
        let local = self.shared.local.read().unwrap_or_else(|p| p.into_inner());
        let local_layout = local.layout.as_ref().ok_or_else(|| {
            EngineError::InvalidArgument("set_layout must be called before read_blocks".into())
        })?;
        let remote_layout = peer
            .meta
            .layout
            .as_ref()
            .ok_or_else(|| EngineError::PeerNotConnected(peer_id.to_string()))?;
        let plan = match segments {
            None => plan_reads(local_layout, remote_layout, local_ids, remote_ids, slice)?,
            Some(range) => plan_segment_reads(
                local_layout,
                remote_layout,
                local_ids,
                remote_ids,
                range,
                slice,
            )?,
        };
        // Both checks below look at each planned (possibly sliced) range itself, not at the
        // blocks it came from: every byte read and written lies in a registered region.
        let remote_regions = check_remote_bounds(&plan, &peer.region_index)?;
        let mut reads = Vec::with_capacity(plan.len());
        let mut nbytes = 0u64;
        // Plans are segment-major, so consecutive reads nearly always fall in the region the
        // previous one did: try that first.
        let mut local_hint = 0usize;
        for (d, &remote_region) in plan.iter().zip(&remote_regions) {
            local_hint =
                find_region(&local.regions, local_hint, |r| r.contains(d.local_addr, d.len))
                    .ok_or_else(|| {
                        EngineError::InvalidArgument(format!(
                            "local range {:#x}+{} is outside the registered regions",
                            d.local_addr, d.len
                        ))
                    })?;
            reads.push(Read {
                local_addr: d.local_addr,
                local: &local.regions[local_hint],
                remote_addr: d.remote_addr,
                remote_region,
                len: d.len,
            });
            nbytes += d.len;
        }
        let batch = BatchState::new(&self.shared.worker);
        let same_host = peer
            .same_host
            .as_ref()
            .filter(|_| reads.iter().all(|r| r.local.memory == MemoryType::Host));
        let inflight = Arc::new(Inflight {
            batch: Arc::clone(&batch),
            peer: Arc::clone(&peer),
            deadline: deadline_after(timeout),
            notify: Mutex::new(notify),
            abort_reason: Mutex::new(None),
            same_host: same_host.is_some(),
        });
        lock(&self.shared.inflight).push(Arc::clone(&inflight));
        match peer.start_reads(&self.shared, &reads, &batch, same_host) {
            Ok(()) => {}
            Err(PostError::NothingPosted(e)) => batch.fail(e),
            // Force-closing the endpoint cancels the posted reads; the batch fails when the
            // last of them has completed, so no byte lands in blocks the caller then reuses.
            Err(PostError::MaybePartial(e)) => {
                abort_peer(&self.shared, &peer, &format!("posting a read failed: {e}"))
            }
        }
        drop(local);
        let transfer = Transfer {
            shared: Arc::clone(&self.shared),
            inflight,
            nbytes,
            num_descriptors: plan.len(),
        };
        // A batch that settled while posting (nothing posted, all done at once) is finished
        // here; a pending one cannot have passed its deadline yet.
        if transfer.inflight.batch.outcome().is_some() {
            transfer.settle();
        }
        Ok(transfer)
    }

    /// Queues `payload` for a connected peer without reading anything. Sent by the notifier
    /// thread, in order with the read-done notifications of batches that finished before
    /// this call; a send that fails later is logged there.
    pub fn notify(&self, peer_id: &str, payload: &[u8]) -> Result<(), EngineError> {
        let peer = resolve(&self.shared, peer_id)?;
        if !peer.link.is_alive() {
            return Err(EngineError::PeerNotConnected(peer_id.to_string()));
        }
        queue_notification(&self.shared, Outgoing { peer, payload: payload.to_vec() })
    }

    pub fn take_notifications(&self) -> Vec<Notification> {
        lock(&self.shared.server).as_ref().map(|s| s.take_notifications()).unwrap_or_default()
    }

    /// Engines connected to our side channel that announced their own: the readers of this
    /// engine, and so the owners a lookup may ask. Forgotten when their connection ends.
    pub fn known_peers(&self) -> Vec<KnownPeer> {
        lock(&self.shared.server).as_ref().map(|s| s.known_peers()).unwrap_or_default()
    }

    /// Holds `request_id`'s `num_blocks` blocks, whose tokens have `fingerprints`, for readers
    /// for `ttl`; a reader is granted them against its own fingerprints and gets `offer`
    /// (see [`HoldBook`]).
    pub fn hold(
        &self,
        request_id: &str,
        kind: HoldKind,
        num_blocks: usize,
        fingerprints: Vec<BlockFingerprint>,
        offer: Vec<u8>,
        ttl: Duration,
    ) -> Result<(), EngineError> {
        Ok(lock(&self.shared.holds).hold(
            request_id,
            kind,
            num_blocks,
            fingerprints,
            offer,
            ttl,
            Instant::now(),
        )?)
    }

    /// `reader` is done with its claim `claim_id` on `request_id`'s blocks. Returns true when
    /// this freed the hold.
    pub fn release_hold(&self, reader: &str, request_id: &str, claim_id: u64) -> bool {
        lock(&self.shared.holds).release(reader, request_id, claim_id, Instant::now()).is_some()
    }

    /// Ends leases and claims whose time is up; returns the holds this freed.
    pub fn expire_holds(&self) -> Vec<String> {
        lock(&self.shared.holds).expire(Instant::now())
    }

    /// Frees unclaimed holds of `which` kind, least recently used first, until `num_blocks`
    /// blocks were freed or none is left.
    pub fn evict_holds(&self, num_blocks: usize, which: Evict) -> Vec<String> {
        lock(&self.shared.holds).evict(num_blocks, which, Instant::now())
    }

    /// Claims alive now over all holds, and the blocks held.
    pub fn hold_occupancy(&self) -> (usize, usize) {
        let holds = lock(&self.shared.holds);
        (holds.num_claims(), holds.held_blocks())
    }

    /// Asks every `(host, port)` in `targets` at once for the longest held turn starting
    /// with `fingerprints` or, with `request_id`, for a grant of that hold's blocks that carry
    /// them. A named hold that the owner has not taken yet (it takes a hold one engine step
    /// after answering its request) is asked for again, less and less often (see
    /// [`NOT_YET_FIRST_RETRY`]), until `timeout` has passed. A connected owner is asked from this thread right away: a new
    /// thread may wait long for a core on a busy host. Others are connected to first, each on
    /// a thread of its own, within `timeout`. Nothing here needs the caller: poll the
    /// returned [`LookupFanOut`]; an owner's reply is taken until [`LATE_REPLY_WINDOW`] after
    /// `timeout`, so that a late claim can still be handed back.
    pub fn start_lookup(
        &self,
        targets: Vec<(String, u16)>,
        fingerprints: Vec<BlockFingerprint>,
        request_id: Option<String>,
        timeout: Duration,
    ) -> LookupFanOut {
        let connect_deadline = deadline_after(timeout);
        let fan_out = LookupFanOut::new(
            targets.iter().map(|(host, port)| format!("{host}:{port}")).collect(),
            Arc::new(LookupQuestion {
                fingerprints,
                request_id,
                retry_until: deadline_after(timeout),
            }),
            deadline_after(timeout.saturating_add(LATE_REPLY_WINDOW)),
        );
        for (index, (host, port)) in targets.into_iter().enumerate() {
            if let Some(peer) = ready_peer(&self.shared, &fan_out.addresses[index]) {
                fan_out.ask(index, &peer, NOT_YET_FIRST_RETRY);
                continue;
            }
            let (shared, asking) = (Arc::downgrade(&self.shared), fan_out.clone());
            let connect_and_ask = move || {
                let connected = match shared.upgrade() {
                    Some(shared) => connect_for_lookup(&shared, &host, port, connect_deadline),
                    None => Err("engine closed".to_owned()),
                };
                match connected {
                    Ok(peer) => asking.ask(index, &peer, NOT_YET_FIRST_RETRY),
                    Err(e) => asking.answer(index, Err(e)),
                }
            };
            if let Err(e) =
                std::thread::Builder::new().name("kvduplex-lookup".into()).spawn(connect_and_ask)
            {
                fan_out.answer(index, Err(format!("cannot start a lookup thread: {e}")));
            }
        }
        fan_out
    }

    /// Stops the progress thread, fails what is in flight, closes peers and the side channel,
    /// then unregisters memory. Idempotent.
    pub fn close(&mut self) {
        if self.shared.stop.swap(true, Ordering::AcqRel) {
            return;
        }
        self.shared.worker.wake();
        if let Some(t) = self.progress_thread.take() {
            let _ = t.join();
        }
        // Delivers what is queued (each write bounded by the side channel's write timeout)
        // while the links are still open, then ends.
        drop(lock(&self.shared.outbox).take());
        if let Some(t) = self.notifier_thread.take() {
            let _ = t.join();
        }
        let peers: Vec<Arc<Peer>> = lock(&self.shared.peers).drain().map(|(_, p)| p).collect();
        for peer in &peers {
            abort_peer(&self.shared, peer, "engine closed");
        }
        // Their batches were just failed and their copy queues closed, so each copy stops at
        // its next call; one blocked in the kernel is given up on after CLOSE_DRAIN (its batch
        // stays unfinished, and keeps the regions it writes into registered).
        let drain_deadline = Instant::now() + CLOSE_DRAIN;
        self.shared.copy_threads.join_until(drain_deadline);
        drain_reads(&self.shared, drain_deadline);
        lock(&self.shared.inflight).clear();
        drop(peers);
        lock(&self.shared.table).clear();
        self.shared.table_changed.notify_all();
        // Each ends within its own timeout; none may outlive the engine's memory.
        let handshakes: Vec<JoinHandle<()>> = lock(&self.shared.handshakes).drain(..).collect();
        for handshake in handshakes {
            let _ = handshake.join();
        }
        // A handshake that finished meanwhile may have added a peer.
        for peer in lock(&self.shared.peers).drain().map(|(_, p)| p).collect::<Vec<_>>() {
            abort_peer(&self.shared, &peer, "engine closed");
        }
        if let Some(mut server) = lock(&self.shared.server).take() {
            server.shutdown();
        }
        // A batch with reads outstanding holds the regions they write into: those stay
        // registered until it ends (drain_reads logged it).
        drop(std::mem::take(
            &mut self.shared.local.write().unwrap_or_else(|p| p.into_inner()).regions,
        ));
        log::info!("engine {} closed", self.shared.config.engine_id);
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.close();
    }
}

/// How long `close` waits for same-host copies and progresses UCX for reads its aborts did not
/// cancel; past it the batches of those reads keep the memory they target registered, and
/// close returns without them.
const CLOSE_DRAIN: Duration = Duration::from_secs(2);

/// Progresses until no in-flight batch has a read outstanding, or `deadline` passes (logged).
fn drain_reads(shared: &Shared, deadline: Instant) {
    loop {
        shared.worker.progress();
        let outstanding: usize =
            lock(&shared.inflight).iter().map(|i| i.batch.unfinished_reads()).sum();
        if outstanding == 0 {
            return;
        }
        if Instant::now() >= deadline {
            log::error!("closing with {outstanding} reads (UCX or same-host) not completed after {CLOSE_DRAIN:?}: their memory stays registered until they end");
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn bounds(regions: &[Arc<MemRegion>]) -> Vec<RegionBounds> {
    regions.iter().map(|r| RegionBounds { addr: r.addr, len: r.len }).collect()
}

/// Index of the first region satisfying `fits`, trying `hint` before scanning.
fn find_region<T>(regions: &[T], hint: usize, fits: impl Fn(&T) -> bool) -> Option<usize> {
    if regions.get(hint).is_some_and(&fits) {
        return Some(hint);
    }
    regions.iter().position(fits)
}

fn is_retryable(e: &HandshakeError) -> bool {
    matches!(
        e,
        HandshakeError::Io(_) | HandshakeError::Unreachable { .. } | HandshakeError::Timeout { .. }
    )
}

fn is_retryable_engine_error(e: &EngineError) -> bool {
    matches!(e, EngineError::Handshake(h) if is_retryable(h))
}

/// Fails a batch that passed its deadline. A UCX batch's reads may still be in flight, so the
/// peer's endpoint is aborted first (failing every batch to that peer); the next `connect`
/// re-handshakes. A same-host batch is failed alone: its copy stops at its next call.
fn expire(shared: &Shared, inflight: &Inflight) {
    if inflight.batch.outcome().is_some()
        || inflight.batch.has_failed()
        || Instant::now() < inflight.deadline
    {
        return;
    }
    let reason = format!(
        "deadline passed before the last byte arrived from peer {}",
        inflight.peer.meta.engine_id
    );
    if inflight.same_host {
        log::warn!("{reason}");
        lock(&inflight.abort_reason).get_or_insert_with(|| reason.clone());
        inflight.batch.fail(reason);
    } else if inflight.peer.is_live(shared) {
        log::warn!("{reason}; aborting the connection to it");
        abort_peer(shared, &inflight.peer, &reason);
    }
}

/// Background progress: drives UCX (an owner must progress for tcp-emulated reads), enforces
/// deadlines and sends read-done notifications for batches nobody waits on. Between rounds it
/// sleeps on the worker's event fd, so an idle engine costs no CPU and still answers at once.
fn progress_loop(shared: Weak<Shared>) {
    let mut last_activity = Instant::now() - SPIN_AFTER_ACTIVITY;
    loop {
        let Some(shared) = shared.upgrade() else { return };
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        if shared.worker.progress_in_background() > 0 {
            last_activity = Instant::now();
        }
        // Pending batches need their deadlines checked even when UCX stays silent.
        let timeout = if settle_all(&shared) { BUSY_POLL } else { IDLE_POLL };
        // While a peer is actively reading over a transport this worker must serve (tcp),
        // keep progressing instead of paying a poll() round trip per message; a thread
        // blocked in `Transfer::wait` already drives progress, so leave the core to it.
        let waited_on = shared.worker.driven_in_foreground();
        let spin = last_activity.elapsed() < SPIN_AFTER_ACTIVITY && !waited_on;
        let worker = Arc::clone(&shared.worker);
        drop(shared);
        if waited_on {
            // Waking on every UCX event would only fight the waiter for the worker lock.
            std::thread::sleep(BUSY_POLL);
        } else if spin {
            std::thread::yield_now();
        } else {
            worker.wait_for_events(timeout);
        }
    }
}

const SPIN_AFTER_ACTIVITY: Duration = Duration::from_millis(2);
const BUSY_POLL: Duration = Duration::from_millis(1);
const IDLE_POLL: Duration = Duration::from_millis(100);

/// Settles every in-flight batch that finished or passed its deadline; returns whether any is
/// still pending.
fn settle_all(shared: &Shared) -> bool {
    let pending: Vec<Arc<Inflight>> = lock(&shared.inflight).clone();
    for inflight in &pending {
        expire(shared, inflight);
        if inflight.batch.outcome().is_some() {
            finish_inflight(shared, inflight);
        }
    }
    !lock(&shared.inflight).is_empty()
}

/// Queues the batch's notification (once, only on success) and stops tracking it. Called on
/// the progress thread and in `Transfer::poll`/`wait`, neither of which may block on a socket.
fn finish_inflight(shared: &Shared, inflight: &Arc<Inflight>) {
    if let Some(Ok(())) = inflight.batch.outcome() {
        if let Some(payload) = lock(&inflight.notify).take() {
            if let Err(e) =
                queue_notification(shared, Outgoing { peer: Arc::clone(&inflight.peer), payload })
            {
                log::warn!(
                    "read done but peer {} was not notified: {e}",
                    inflight.peer.meta.engine_id
                );
            }
        }
    }
    lock(&shared.inflight).retain(|i| !Arc::ptr_eq(i, inflight));
}

fn queue_notification(shared: &Shared, outgoing: Outgoing) -> Result<(), EngineError> {
    let outbox = lock(&shared.outbox);
    match outbox.as_ref().map(|outbox| outbox.send(outgoing)) {
        Some(Ok(())) => Ok(()),
        _ => Err(EngineError::Closed),
    }
}

/// The notifier thread: writes queued notifications to their peers' side-channel links, in
/// order, until the engine closes. A peer whose socket does not take the write within the
/// side channel's write timeout loses its link (and is reconnected by the next `connect`).
fn send_notifications(queue: &mpsc::Receiver<Outgoing>) {
    for Outgoing { peer, payload } in queue {
        if let Err(e) = peer.link.notify(&payload) {
            log::warn!("read done but notifying peer {} failed: {e}", peer.meta.engine_id);
        }
    }
}

/// One posted batch.
pub struct Transfer {
    shared: Arc<Shared>,
    inflight: Arc<Inflight>,
    pub nbytes: u64,
    pub num_descriptors: usize,
}

/// How long `wait` keeps driving UCX progress back to back after UCX last reported an event,
/// before it naps between rounds: spinning is what makes small batches fast, and over shared
/// memory the rounds are this thread copying the bytes (a long batch reports an event per
/// completed read), so only a batch waiting on a silent peer (tcp) naps.
const WAIT_SPIN: Duration = Duration::from_millis(2);

impl Transfer {
    /// Read directly from a process on this host, not through UCX.
    pub fn same_host(&self) -> bool {
        self.inflight.same_host
    }

    fn settle(&self) -> Option<Result<(), EngineError>> {
        expire(&self.shared, &self.inflight);
        let outcome = self.inflight.batch.outcome()?;
        finish_inflight(&self.shared, &self.inflight);
        Some(outcome.map_err(|ucx_error| {
            EngineError::Transfer(lock(&self.inflight.abort_reason).clone().unwrap_or(ucx_error))
        }))
    }

    /// Non-blocking: `Ok(true)` when every byte arrived, `Ok(false)` while pending.
    pub fn poll(&self) -> Result<bool, EngineError> {
        self.shared.worker.progress();
        match self.settle() {
            None => Ok(false),
            Some(r) => r.map(|()| true),
        }
    }

    /// Blocks until the batch completes, fails, or `timeout` passes.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<(), EngineError> {
        let _driving = self.shared.worker.foreground();
        self.drive(timeout)
    }

    fn drive(&self, timeout: Option<Duration>) -> Result<(), EngineError> {
        // The clock is read only once the first round did not finish the batch.
        let mut start = None;
        let mut last_event = None;
        loop {
            let events = self.shared.worker.progress();
            if let Some(r) = self.settle() {
                return r;
            }
            let now = Instant::now();
            let waited = now - *start.get_or_insert(now);
            if timeout.is_some_and(|t| waited >= t) {
                return Err(EngineError::WaitTimeout(waited));
            }
            if events > 0 || last_event.is_none() {
                last_event = Some(now);
            }
            if last_event.is_some_and(|at| now - at < WAIT_SPIN) {
                // Over tcp the owner must run to serve the reads; on a busy host it may need
                // this core.
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
}

/// `now + timeout`, or a year from now when that overflows the clock (a timeout that large is
/// as good as none, and must not panic).
fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .or_else(|| now.checked_add(Duration::from_secs(365 * 24 * 3600)))
        .unwrap_or(now)
}
