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
//! other engines' [`Engine::start_lookup`]s of offered holds over the side channel.
//!
//! Here: the engine's state, start, memory, holds and close. Beside it, each module using
//! only those listed before it (and this one): `connection` (a connection's transport and
//! batches, under one lock), `copier` (same-host copy threads), `retry` (the retry thread),
//! `feeds` (what owners announce they hold, both sides), `peer` (a connection to a peer and
//! the batches in flight on it), `routes` (which connection answers for an address, who waits
//! for one), `connect` (connecting verbs, waiting for a handshake, the handshake itself),
//! `read` (posting, tracking and settling batches: [`Transfer`]), `lookup` (lookups of held
//! turns, both sides: [`Engine::start_lookup`]) and `threads` (the progress thread, close's
//! drain).

mod connect;
mod connection;
mod copier;
mod feeds;
mod inflight;
mod lookup;
mod peer;
mod read;
mod retry;
mod routes;
mod threads;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::descriptors::{BlockLayout, PlanError, RegionBounds};
use crate::handshake::{
    new_generation, EngineMetadata, Fingerprint, HandshakeError, RegionInfo, RetryPolicy,
    SameHostIdentity,
};
use crate::held_index::HeldIndex;
use crate::holds::feed::FeedWatch;
use crate::holds::{BlockFingerprint, Evict, HoldBook, HoldError, HoldKind};
use crate::same_host::{boot_id, ucx_tls_allows_cma};
use crate::side_channel::{KnownPeer, Notification, SideChannelConfig, SideChannelServer};
use crate::ucx::{pid_namespace, MemRegion, UcxError, Worker};
pub use crate::ucx::{MemoryOwner, RegionMemory};
use copier::CopyThreads;
use feeds::BookFeed;
use inflight::InflightBook;
use lookup::lookup_handler;
pub use lookup::{
    LookupAnswer, LookupFanOut, LATE_REPLY_WINDOW, NOT_YET_FIRST_RETRY, NOT_YET_MAX_RETRY,
};
use peer::{Inflight, Peer};
pub use read::Transfer;
use retry::{retry_loop, Retry};
use routes::{abort_peer, Routes};
use threads::{drain_reads, progress_loop, CLOSE_DRAIN};

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

impl EngineError {
    /// Whether connecting again may succeed: the peer was unreachable or slow, not refused.
    pub(crate) fn is_retryable(&self) -> bool {
        matches!(
            self,
            EngineError::Handshake(
                HandshakeError::Io(_)
                    | HandshakeError::Unreachable { .. }
                    | HandshakeError::Timeout { .. }
            )
        )
    }
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
    /// UCX peer error handling on endpoints (on by default where the engine is built from
    /// Python or the connector); see [`Worker::connect`] and `peer.rs` (`Peer::open_endpoint`)
    /// for why every endpoint uses it and what turning it off gives up.
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

struct Shared {
    config: EngineConfig,
    generation: u64,
    /// This host's boot id (`None` where it cannot be read: no same-host reads either way).
    boot_id: Option<String>,
    /// This process's pid namespace (`None` where it cannot be read: likewise).
    pid_namespace: Option<u64>,
    /// Whether we read same-host peers directly: the config allows it and `UCX_TLS` does not
    /// rule out UCX's cma, which these reads replace.
    same_host_reads: bool,
    /// Every same-host peer's copy thread ([`copier`]).
    copy_threads: CopyThreads,
    worker: Arc<Worker>,
    server: Mutex<Option<SideChannelServer>>,
    local: RwLock<LocalMemory>,
    /// Which connection answers for each side-channel address, the ready ones, and who waits
    /// for a handshake ([`routes`]); each connection says itself whether it is open.
    routes: Mutex<Routes>,
    /// Signalled whenever a connection attempt ends.
    table_changed: Condvar,
    /// The batches in flight ([`inflight`]: a completion queue and a deadline heap).
    inflight: Mutex<InflightBook<Arc<Inflight>>>,
    /// This engine's held blocks; the side channel's lookups read it too.
    holds: Arc<Mutex<HoldBook>>,
    /// What the owners we are connected to announced they hold ([`lookup::unasked`]).
    held_index: Arc<Mutex<HeldIndex>>,
    /// Moved by every lookup answer ([`Engine::lookup_answers`]).
    lookup_answers: Arc<FeedWatch>,
    /// "host:port" of our side channel, announced to the owners we connect to.
    side_channel: String,
    /// Handshakes on threads of their own ([`connect::spawn_handshake`]: for
    /// [`Engine::peer_status`] and lookups), joined by `close`.
    handshakes: Mutex<Vec<JoinHandle<()>>>,
    /// Lookups' asks to make again ([`retry::retry_loop`]).
    retries: mpsc::Sender<Retry>,
    stop: AtomicBool,
}

pub struct Engine {
    shared: Arc<Shared>,
    progress_thread: Option<JoinHandle<()>>,
    retry_thread: Option<JoinHandle<()>>,
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
        let boot_id = boot_id();
        let pid_namespace = pid_namespace();
        let same_host_reads = config.same_host_reads
            && boot_id.is_some()
            && ucx_tls_allows_cma(std::env::var("UCX_TLS").ok().as_deref());
        let meta = metadata(
            &config,
            generation,
            &worker,
            boot_id.as_deref(),
            pid_namespace,
            &LocalMemory { regions: Vec::new(), layout: None },
        );
        let server = SideChannelServer::start(
            SideChannelConfig {
                host: config.host.clone(),
                port: config.port,
                secret: config.secret.clone(),
                heartbeat: config.heartbeat,
                allow_unauthenticated: config.allow_unauthenticated,
            },
            meta,
        )?;
        let side_channel = format!("{}:{}", config.host, server.local_addr().port());
        log::info!(
            "engine {} (generation {generation:#x}) serving its side channel on {side_channel}",
            config.engine_id
        );
        let holds = Arc::new(Mutex::new(HoldBook::new()));
        let (retries, retry_queue) = mpsc::channel();
        server.set_lookup_handler(lookup_handler(Arc::downgrade(&holds), config.lookup_claim));
        server.set_held_source(Arc::new(BookFeed::new(&holds)));
        let shared = Arc::new(Shared {
            config,
            generation,
            boot_id,
            pid_namespace,
            same_host_reads,
            copy_threads: CopyThreads::default(),
            worker,
            server: Mutex::new(Some(server)),
            local: RwLock::new(LocalMemory { regions: Vec::new(), layout: None }),
            routes: Mutex::new(Routes::new(RetryPolicy::default())),
            table_changed: Condvar::new(),
            inflight: Mutex::new(InflightBook::new()),
            holds,
            held_index: Arc::new(Mutex::new(HeldIndex::new())),
            lookup_answers: Arc::default(),
            side_channel,
            handshakes: Mutex::new(Vec::new()),
            retries,
            stop: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&shared);
        let retry_thread = std::thread::Builder::new()
            .name("kvduplex-lookup-retry".into())
            .spawn(move || {
                retry_loop(&retry_queue, || {
                    weak.upgrade().is_none_or(|shared| shared.stop.load(Ordering::Acquire))
                })
            })
            .map_err(|e| {
                EngineError::InvalidArgument(format!("cannot start the lookup retry thread: {e}"))
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
            retry_thread: Some(retry_thread),
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

    /// Stops offering this engine's memory, as before vLLM unmaps it (sleep): every region is
    /// unregistered (a batch of ours still writing into one keeps it registered until the
    /// batch ends), no region nor layout is published, and every reader's side-channel
    /// connection is closed, so a peer's read fails once it saw its connection end (a new
    /// handshake finds nothing to read; UCX alone may still serve an unregistered range over
    /// some transports, so this, not the unregistration, stops readers); a read it posted
    /// before may still land, which holds' claims and leases rule out. Our own reads fail too
    /// (outside the registered regions). [`Engine::register_region`] and
    /// [`Engine::set_layout`] serve again. Returns how many regions it unregistered.
    pub fn unregister_regions(&self) -> Result<usize, EngineError> {
        let mut local = self.shared.local.write().unwrap_or_else(|p| p.into_inner());
        let count = local.regions.len();
        local.regions.clear();
        local.layout = None;
        self.publish(&local)?;
        drop(local);
        // After the metadata: a handshake answered before it is among these connections.
        lock(&self.shared.server).as_ref().ok_or(EngineError::Closed)?.close_connections();
        log::info!("unregistered {count} regions; readers disconnected");
        Ok(count)
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
            shared.pid_namespace,
            local,
        );
        lock(&self.shared.server).as_ref().ok_or(EngineError::Closed)?.set_metadata(meta);
        Ok(())
    }
}

/// What this engine publishes to readers; the side channel names each connection's socket in
/// the same-host identity. The identity is published even where the boot id or the pid
/// namespace is unknown (empty, zero: no reader takes us for a process of its host then).
fn metadata(
    config: &EngineConfig,
    generation: u64,
    worker: &Worker,
    boot_id: Option<&str>,
    pid_namespace: Option<u64>,
    local: &LocalMemory,
) -> EngineMetadata {
    let identity = SameHostIdentity {
        boot_id: boot_id.unwrap_or_default().to_owned(),
        pid_namespace: pid_namespace.unwrap_or_default(),
        pid: std::process::id(),
        socket_fd: 0,
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
    pub fn take_notifications(&self) -> Vec<Notification> {
        lock(&self.shared.server).as_ref().map(|s| s.take_notifications()).unwrap_or_default()
    }

    /// Engines connected to our side channel that announced their own: the readers of this
    /// engine, and so the owners a lookup may ask. Forgotten when their connection ends.
    pub fn known_peers(&self) -> Vec<KnownPeer> {
        lock(&self.shared.server).as_ref().map(|s| s.known_peers()).unwrap_or_default()
    }

    /// Holds `request_id`'s `num_blocks` blocks, whose tokens have `fingerprints` (the first
    /// `prompt_blocks` of them its prompt's full blocks, 0 if unknown), for readers
    /// until `lease_ends` (one already past ends at the next [`Engine::expire_holds`]); a
    /// reader is granted them against its own fingerprints and gets `offer` (see [`HoldBook`]).
    #[allow(clippy::too_many_arguments)]
    pub fn hold(
        &self,
        request_id: &str,
        kind: HoldKind,
        num_blocks: usize,
        fingerprints: Vec<BlockFingerprint>,
        prompt_blocks: usize,
        offer: Vec<u8>,
        lease_ends: Instant,
    ) -> Result<(), EngineError> {
        let mut holds = lock(&self.shared.holds);
        Ok(holds.hold(
            request_id,
            kind,
            num_blocks,
            fingerprints,
            prompt_blocks,
            offer,
            lease_ends,
            Instant::now(),
        )?)
    }

    /// Expects `request_id`'s turn, being computed, to be held when it finishes (`end`: its
    /// whole prompt's fingerprint), until [`Engine::settle_turns`] (see [`HoldBook::expect`]).
    pub fn expect_turn(&self, request_id: &str, end: BlockFingerprint) -> Result<(), EngineError> {
        Ok(lock(&self.shared.holds).expect(request_id, end)?)
    }

    /// These expected turns are held now, or will not be.
    pub fn settle_turns(&self, request_ids: &[String]) {
        let mut holds = lock(&self.shared.holds);
        for request_id in request_ids {
            holds.settle(request_id);
        }
    }

    /// `reader` is done with its claim `claim_id` on `request_id`'s blocks. Returns true when
    /// this freed the hold.
    pub fn release_hold(&self, reader: &str, request_id: &str, claim_id: u64) -> bool {
        lock(&self.shared.holds).release(reader, request_id, claim_id, Instant::now()).is_some()
    }

    /// Renews the lease of `request_id`'s prompt held for a decode node, for a reader whose
    /// prompt's first block has the fingerprint `first` (see [`HoldBook::renew`]). Returns
    /// whether it was renewed.
    pub fn renew_hold(&self, request_id: &str, first: BlockFingerprint) -> bool {
        lock(&self.shared.holds).renew(request_id, first, Instant::now()).is_some()
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

    /// The latest deadline of the claims alive now on holds that ended (see
    /// [`HoldBook::ended_claims_until`]); `None` when no reader reads an ended hold.
    pub fn ended_claims_until(&self) -> Option<Instant> {
        lock(&self.shared.holds).ended_claims_until(Instant::now())
    }

    /// Claims alive now over all holds, the blocks held, and how many lookups this engine
    /// told to ask again so far, as it computed the turn they continue
    /// ([`HoldBook::awaited`]).
    pub fn hold_occupancy(&self) -> (usize, usize, u64) {
        let holds = lock(&self.shared.holds);
        (holds.num_claims(), holds.held_blocks(), holds.num_awaited())
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
        // Woken to see the engine closed, it asks no owner again; the lookups' links close below.
        let _ = self.shared.retries.send(Retry { due: Instant::now(), ask: Box::new(|| ()) });
        if let Some(t) = self.retry_thread.take() {
            let _ = t.join();
        }
        let peers: Vec<Arc<Peer>> = lock(&self.shared.routes).clear();
        // Delivers what the links have queued (a stalled owner's only until CLOSE_DRAIN).
        let flush_deadline = Instant::now() + CLOSE_DRAIN;
        for peer in &peers {
            peer.link.flush(flush_deadline);
        }
        self.shared.table_changed.notify_all();
        for peer in &peers {
            abort_peer(&self.shared, peer, "engine closed");
        }
        // Their batches were just failed and their copy queues closed, so each copy stops at
        // its next call; one blocked in the kernel is given up on after CLOSE_DRAIN if the
        // regions it writes into hold their memory's owner (its batch stays unfinished and keeps
        // them), else waited for (drain_reads).
        let drain_deadline = Instant::now() + CLOSE_DRAIN;
        self.shared.copy_threads.join_until(drain_deadline);
        drain_reads(&self.shared, drain_deadline);
        lock(&self.shared.inflight).clear();
        drop(peers);
        // Each ends within its own timeout and writes into no registered memory; one still
        // under way after CLOSE_DRAIN (a peer that never answers a handshake a lookup or
        // `peer_status` started) ends alone, and the connection it makes is dropped
        // (`attempt_connect` sees the engine closed).
        let handshakes: Vec<JoinHandle<()>> = lock(&self.shared.handshakes).drain(..).collect();
        let join_deadline = Instant::now() + CLOSE_DRAIN;
        for handshake in handshakes {
            while !handshake.is_finished() && Instant::now() < join_deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            if handshake.is_finished() {
                let _ = handshake.join();
            }
        }
        // A handshake that finished meanwhile may have added a peer.
        for peer in lock(&self.shared.routes).clear() {
            abort_peer(&self.shared, &peer, "engine closed");
        }
        if let Some(mut server) = lock(&self.shared.server).take() {
            server.shutdown();
        }
        // A batch with reads outstanding (into memory whose owner its regions hold) holds the
        // regions they write into: those stay registered until it ends (drain_reads logged it).
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

fn bounds(regions: &[Arc<MemRegion>]) -> Vec<RegionBounds> {
    regions.iter().map(|r| RegionBounds { addr: r.addr, len: r.len }).collect()
}
