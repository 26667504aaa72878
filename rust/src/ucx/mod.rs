//! Safe wrappers over UCP: one context + worker per engine, registered memory, endpoints with
//! their unpacked remote keys, and batches of one-sided reads, each read completed on its own.
//!
//! Same-host peers are read without UCX, a batch per system call ([`same_host`]).
//!
//! All `unsafe` in the crate lives in this module. Every UCP call on a worker (and on its
//! context) is made while holding [`Worker::lock`]: the worker is created in UCX's
//! `SERIALIZED` thread mode, which allows any thread as long as calls never overlap.

pub mod packed;
mod same_host;
mod sys;

use std::ffi::{c_int, c_void, CString};
use std::path::Path;
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crate::descriptors::RegionBounds;
use crate::handshake::MemoryType;
pub use same_host::{
    boot_id, check_not_this_process, ucx_tls_allows_cma, OpenError, Probe, SameHostClaim,
    SameHostCopy, SameHostPeer,
};
use sys::{Api, StatusPtr};

#[derive(Debug, thiserror::Error)]
pub enum UcxError {
    #[error("cannot load UCX: {0}")]
    Load(String),
    #[error("{call} failed: {status}")]
    Call { call: &'static str, status: String },
}

fn call_error(api: &Api, call: &'static str, status: sys::ucs_status_t) -> UcxError {
    UcxError::Call { call, status: api.status_text(status) }
}

fn call_result(api: &Api, call: &'static str, status: sys::ucs_status_t) -> Result<(), UcxError> {
    if status == sys::UCS_OK {
        Ok(())
    } else {
        Err(call_error(api, call, status))
    }
}

pub struct Worker {
    api: &'static Api,
    context: sys::ucp_context_h,
    worker: sys::ucp_worker_h,
    lock: Mutex<()>,
    address: Vec<u8>,
    /// Owned by UCX (closed with the worker); readable when the worker has events.
    event_fd: Option<c_int>,
    /// Threads inside a [`Foreground`] section, driving progress themselves.
    foreground: AtomicUsize,
}

// SAFETY: the raw handles are only used while `lock` is held (or in Drop, which has exclusive
// access), matching the SERIALIZED thread mode the worker is created with.
unsafe impl Send for Worker {}
unsafe impl Sync for Worker {}

impl Worker {
    /// Starts a UCP context (RMA) and worker; UCX reads its `UCX_*` environment variables here.
    pub fn new(name: &str, lib_dir: Option<&Path>) -> Result<Arc<Worker>, UcxError> {
        let api = sys::api(lib_dir).map_err(UcxError::Load)?;
        let check = |call, status| call_result(api, call, status);
        let name = CString::new(name.replace('\0', "")).unwrap_or_default();
        let mut config = ptr::null_mut();
        // SAFETY: out-pointer to a local; UCX allocates the config, released below.
        check("ucp_config_read", unsafe {
            (api.ucp_config_read)(ptr::null(), ptr::null(), &mut config)
        })?;
        // SAFETY: all-zero is valid for the reserve space and unused fields.
        let mut params: sys::ucp_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_NAME;
        // WAKEUP gives the worker an event fd, so an idle progress thread can sleep in poll()
        // and still answer a tcp peer's reads at once.
        params.features = sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_WAKEUP;
        params.name = name.as_ptr();
        let mut context = ptr::null_mut();
        // SAFETY: params and config are valid for the call; context is an out-pointer.
        let status = unsafe {
            (api.ucp_init_version)(
                sys::UCP_API_MAJOR,
                sys::UCP_API_MINOR,
                &params,
                config,
                &mut context,
            )
        };
        // SAFETY: config came from ucp_config_read and is not used after this.
        unsafe { (api.ucp_config_release)(config) };
        check("ucp_init", status)?;

        // SAFETY: as above.
        let mut wparams: sys::ucp_worker_params_t = unsafe { std::mem::zeroed() };
        wparams.field_mask = sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE;
        wparams.thread_mode = sys::UCS_THREAD_MODE_SERIALIZED;
        let mut worker = ptr::null_mut();
        // SAFETY: context is live; worker is an out-pointer.
        let status = unsafe { (api.ucp_worker_create)(context, &wparams, &mut worker) };
        if status != sys::UCS_OK {
            // SAFETY: the context has no workers and is not used again.
            unsafe { (api.ucp_cleanup)(context) };
            return Err(call_error(api, "ucp_worker_create", status));
        }
        let mut addr = ptr::null_mut();
        let mut addr_len = 0usize;
        // SAFETY: worker is live; out-pointers to locals.
        let status = unsafe { (api.ucp_worker_get_address)(worker, &mut addr, &mut addr_len) };
        if status != sys::UCS_OK {
            // SAFETY: tearing down what was created above, in reverse order.
            unsafe {
                (api.ucp_worker_destroy)(worker);
                (api.ucp_cleanup)(context);
            }
            return Err(call_error(api, "ucp_worker_get_address", status));
        }
        // SAFETY: UCX returned addr_len readable bytes at addr; released right after the copy.
        let address = unsafe { std::slice::from_raw_parts(addr as *const u8, addr_len).to_vec() };
        // SAFETY: addr came from ucp_worker_get_address on this worker.
        unsafe { (api.ucp_worker_release_address)(worker, addr) };
        let mut efd: c_int = -1;
        // SAFETY: worker is live; efd is an out-pointer to a local.
        let event_fd = match unsafe { (api.ucp_worker_get_efd)(worker, &mut efd) } {
            sys::UCS_OK => Some(efd),
            status => {
                log::info!(
                    "UCX worker has no event fd ({}); the progress thread will poll",
                    api.status_text(status)
                );
                None
            }
        };
        Ok(Arc::new(Worker {
            api,
            context,
            worker,
            lock: Mutex::new(()),
            address,
            event_fd,
            foreground: AtomicUsize::new(0),
        }))
    }

    /// This worker's address, which peers need to create an endpoint to it.
    pub fn address(&self) -> &[u8] {
        &self.address
    }

    fn guard(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn check(&self, call: &'static str, status: sys::ucs_status_t) -> Result<(), UcxError> {
        call_result(self.api, call, status)
    }

    /// Drives UCX until it reports no more work; returns how many events were processed. The
    /// lock is taken for at most [`ROUNDS_PER_LOCK`] rounds, so posting and other threads'
    /// progress interleave with a long stream of events instead of waiting for the worker to
    /// go idle.
    pub fn progress(&self) -> u32 {
        self.progress_rounds(false)
    }

    /// [`Worker::progress`] for a background thread: it stops after the round during which a
    /// thread entered a [`Foreground`] section, and does nothing while one is inside.
    pub fn progress_in_background(&self) -> u32 {
        self.progress_rounds(true)
    }

    /// Marks the calling thread as driving progress itself until the returned guard drops
    /// (e.g. while it blocks on a batch): background progress stands aside meanwhile, since
    /// two threads taking turns on the worker lock only slow each other down (and a read
    /// copied by another core's thread pulls the destination's cache lines across).
    pub fn foreground(&self) -> Foreground<'_> {
        self.foreground.fetch_add(1, Ordering::AcqRel);
        Foreground { worker: self }
    }

    /// Whether a thread is inside a [`Foreground`] section.
    pub fn driven_in_foreground(&self) -> bool {
        self.foreground.load(Ordering::Acquire) > 0
    }

    fn progress_rounds(&self, background: bool) -> u32 {
        let stand_aside = || background && self.driven_in_foreground();
        let mut total = 0;
        loop {
            if stand_aside() {
                return total;
            }
            let _g = self.guard();
            for _ in 0..ROUNDS_PER_LOCK {
                // SAFETY: worker is live and the lock is held.
                let n = unsafe { (self.api.ucp_worker_progress)(self.worker) };
                total += n;
                if n == 0 {
                    return total;
                }
                if stand_aside() {
                    return total;
                }
            }
        }
    }

    /// Progresses, then sleeps until UCX has events or `timeout` passes (or `wake` is called).
    /// Background progress: it returns at once when a thread is in a [`Foreground`] section.
    pub fn wait_for_events(&self, timeout: Duration) {
        let Some(fd) = self.event_fd else {
            std::thread::sleep(timeout.min(Duration::from_millis(1)));
            return;
        };
        {
            let _g = self.guard();
            loop {
                if self.driven_in_foreground() {
                    return;
                }
                // SAFETY: worker is live and the lock is held.
                if unsafe { (self.api.ucp_worker_progress)(self.worker) } == 0 {
                    break;
                }
            }
            // SAFETY: as above; arm reports BUSY when events arrived since the last progress.
            let status = unsafe { (self.api.ucp_worker_arm)(self.worker) };
            if status == sys::UCS_ERR_BUSY {
                return;
            }
            if status != sys::UCS_OK {
                drop(_g);
                std::thread::sleep(timeout.min(Duration::from_millis(1)));
                return;
            }
        }
        let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        let millis = c_int::try_from(timeout.as_millis()).unwrap_or(c_int::MAX).max(1);
        // SAFETY: one valid pollfd for the duration of the call; the fd stays open while the
        // worker lives, and `self` keeps it alive.
        unsafe { libc::poll(&mut pfd, 1, millis) };
    }

    /// Wakes a thread blocked in [`Worker::wait_for_events`].
    pub fn wake(&self) {
        let _g = self.guard();
        // SAFETY: worker is live and the lock is held.
        unsafe { (self.api.ucp_worker_signal)(self.worker) };
    }

    /// Registers `[addr, addr+len)` (host or GPU memory; UCX detects which) for remote reads.
    /// A host range must be mapped in this process, page by page (checked here); a GPU range
    /// must be one UCX's CUDA support recognizes. The caller keeps the memory mapped until the
    /// returned region is dropped: [`crate::engine::Engine::register_region`]'s contract with
    /// its caller, the one this crate cannot check (a raw address from Python), which every
    /// later read and copy into the region relies on.
    pub fn register(self: &Arc<Self>, addr: u64, len: u64) -> Result<MemRegion, UcxError> {
        let _g = self.guard();
        // SAFETY: zeroed reserve space and unused fields are valid.
        let mut params: sys::ucp_mem_map_params_t = unsafe { std::mem::zeroed() };
        params.field_mask =
            sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH;
        params.address = addr as *mut c_void;
        params.length = len as usize;
        let mut memh = ptr::null_mut();
        // SAFETY: the caller vouches that the range is mapped memory of this process (the engine
        // API documents it); UCX validates what it can and fails otherwise.
        self.check("ucp_mem_map", unsafe {
            (self.api.ucp_mem_map)(self.context, &params, &mut memh)
        })?;
        let unmap = |memh| {
            // SAFETY: memh was just mapped on this context.
            unsafe { (self.api.ucp_mem_unmap)(self.context, memh) };
        };
        let mut attr = sys::ucp_mem_attr_t {
            field_mask: sys::UCP_MEM_ATTR_FIELD_MEM_TYPE,
            address: ptr::null_mut(),
            length: 0,
            mem_type: 0,
        };
        // SAFETY: memh is live; attr is a local out-struct.
        if let Err(e) =
            self.check("ucp_mem_query", unsafe { (self.api.ucp_mem_query)(memh, &mut attr) })
        {
            unmap(memh);
            return Err(e);
        }
        let memory = match attr.mem_type {
            sys::UCS_MEMORY_TYPE_HOST if !host_range_is_mapped(addr, len) => {
                unmap(memh);
                return Err(UcxError::Call {
                    call: "ucp_mem_map",
                    status: format!("{addr:#x}+{len} is not mapped memory of this process"),
                });
            }
            sys::UCS_MEMORY_TYPE_HOST => MemoryType::Host,
            sys::UCS_MEMORY_TYPE_CUDA | sys::UCS_MEMORY_TYPE_CUDA_MANAGED => MemoryType::Cuda,
            other => {
                unmap(memh);
                return Err(UcxError::Call {
                    call: "ucp_mem_query",
                    status: format!("unsupported memory type {other}"),
                });
            }
        };
        let mut rkey_buf = ptr::null_mut();
        let mut rkey_len = 0usize;
        // SAFETY: memh is live; out-pointers to locals.
        if let Err(e) = self.check("ucp_rkey_pack", unsafe {
            (self.api.ucp_rkey_pack)(self.context, memh, &mut rkey_buf, &mut rkey_len)
        }) {
            unmap(memh);
            return Err(e);
        }
        // SAFETY: UCX returned rkey_len bytes at rkey_buf; the buffer is released after the copy.
        let rkey = unsafe { std::slice::from_raw_parts(rkey_buf as *const u8, rkey_len).to_vec() };
        // SAFETY: rkey_buf came from ucp_rkey_pack.
        unsafe { (self.api.ucp_rkey_buffer_release)(rkey_buf) };
        Ok(MemRegion { worker: Arc::clone(self), memh, addr, len, memory, rkey })
    }

    /// Creates an endpoint to a peer worker and unpacks the peer's remote keys for it.
    ///
    /// `peer_error_handling` trades speed for a hard guarantee: with it, aborting the endpoint
    /// force-closes it (see [`Endpoint::abort`]), tearing down its transport connections, so no
    /// byte of a cancelled read lands afterwards;
    /// but UCX 1.22 then reads over tcp emulation instead of cma/shared memory (1 vs 8-17
    /// GB/s). Without it a dead peer is detected through the side channel, and the aborting
    /// close flushes instead, which may leave a read to a frozen peer outstanding: its batch then settles only when UCX
    /// completes that read, so no byte lands after the batch is reported.
    /// `regions` are the peer's registered regions and `rkeys` their packed remote keys, by the
    /// same index: every read posted on the endpoint is checked against `regions`.
    pub fn connect(
        self: &Arc<Self>,
        peer_address: &[u8],
        regions: Arc<[RegionBounds]>,
        rkeys: &[(&[u8], MemoryType)],
        peer_error_handling: bool,
    ) -> Result<Endpoint, UcxError> {
        // UCX parses both without a length: only bytes it reads within their end reach it.
        packed::check_worker_address(peer_address, packed::unified_mode())
            .map_err(|status| UcxError::Call { call: "ucp_ep_create", status })?;
        if rkeys.len() != regions.len() {
            return Err(UcxError::Call {
                call: "ucp_ep_rkey_unpack",
                status: format!("{} remote keys for {} regions", rkeys.len(), regions.len()),
            });
        }
        for (i, (rkey, memory)) in rkeys.iter().enumerate() {
            packed::check_rkey(rkey, *memory).map_err(|e| UcxError::Call {
                call: "ucp_ep_rkey_unpack",
                status: format!("the peer's region {i}: {e}"),
            })?;
        }
        let _g = self.guard();
        // SAFETY: zeroed reserve space and unused fields are valid.
        let mut params: sys::ucp_ep_params_t = unsafe { std::mem::zeroed() };
        params.field_mask =
            sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
        params.address = peer_address.as_ptr() as *const c_void;
        params.err_mode = if peer_error_handling {
            sys::UCP_ERR_HANDLING_MODE_PEER
        } else {
            sys::UCP_ERR_HANDLING_MODE_NONE
        };
        let mut ep = ptr::null_mut();
        // SAFETY: the address bytes stay alive for the call; UCX copies what it needs.
        self.check("ucp_ep_create", unsafe {
            (self.api.ucp_ep_create)(self.worker, &params, &mut ep)
        })?;
        let mut endpoint = Endpoint {
            worker: Arc::clone(self),
            ep,
            rkeys: Vec::with_capacity(rkeys.len()),
            remote: regions,
            outstanding: Arc::new(AtomicUsize::new(0)),
            peer_error_handling,
        };
        for (packed, _) in rkeys {
            let mut rkey = ptr::null_mut();
            // SAFETY: ep is live; the packed key bytes are alive for the call.
            let status = unsafe {
                (self.api.ucp_ep_rkey_unpack)(ep, packed.as_ptr() as *const c_void, &mut rkey)
            };
            if let Err(e) = self.check("ucp_ep_rkey_unpack", status) {
                drop(_g);
                drop(endpoint);
                return Err(e);
            }
            endpoint.rkeys.push(rkey);
        }
        Ok(endpoint)
    }
}

/// Whether every page of `[addr, addr+len)` is mapped in this process (`mincore` fails with
/// ENOMEM on any unmapped page). Checked a GiB at a time to bound the page vector.
fn host_range_is_mapped(addr: u64, len: u64) -> bool {
    const CHUNK: u64 = 1 << 30;
    // SAFETY: sysconf only reads a configuration value.
    let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        p if p > 0 => p as u64,
        _ => 4096,
    };
    let Some(end) = addr.checked_add(len) else { return false };
    let mut start = addr & !(page - 1);
    let mut residency = Vec::new();
    while start < end {
        let chunk = (end - start).min(CHUNK);
        let Ok(chunk_len) = usize::try_from(chunk) else { return false };
        residency.resize(chunk_len.div_ceil(page as usize), 0u8);
        // SAFETY: mincore reads only the page tables of the range (start is page-aligned) and
        // writes one byte per page of it into `residency`, which has exactly that many.
        if unsafe { libc::mincore(start as *mut c_void, chunk_len, residency.as_mut_ptr()) } != 0 {
            return false;
        }
        start += chunk;
    }
    true
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: every MemRegion and Endpoint holds an Arc<Worker>, so none is left; the
        // worker is destroyed before its context.
        unsafe {
            (self.api.ucp_worker_destroy)(self.worker);
            (self.api.ucp_cleanup)(self.context);
        }
    }
}

/// A thread driving progress itself; see [`Worker::foreground`].
pub struct Foreground<'a> {
    worker: &'a Worker,
}

impl Drop for Foreground<'_> {
    fn drop(&mut self) {
        self.worker.foreground.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Memory registered with UCX; unregistered on drop.
pub struct MemRegion {
    worker: Arc<Worker>,
    memh: sys::ucp_mem_h,
    pub addr: u64,
    pub len: u64,
    pub memory: MemoryType,
    /// The packed remote key a peer needs to read this region.
    pub rkey: Vec<u8>,
}

// SAFETY: memh is only used under the worker lock (in Drop and when posting reads).
unsafe impl Send for MemRegion {}
unsafe impl Sync for MemRegion {}

impl MemRegion {
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        RegionBounds { addr: self.addr, len: self.len }.contains(addr, len)
    }
}

impl Drop for MemRegion {
    fn drop(&mut self) {
        let _g = self.worker.guard();
        // SAFETY: memh was mapped on this worker's context and is dropped once.
        let status = unsafe { (self.worker.api.ucp_mem_unmap)(self.worker.context, self.memh) };
        if status != sys::UCS_OK {
            log::warn!(
                "ucp_mem_unmap of {:#x}+{} failed: {}",
                self.addr,
                self.len,
                self.worker.api.status_text(status)
            );
        }
    }
}

/// An endpoint to one peer worker, with the peer's regions' remote keys unpacked for it.
pub struct Endpoint {
    worker: Arc<Worker>,
    ep: sys::ucp_ep_h,
    rkeys: Vec<sys::ucp_rkey_h>,
    /// The peer's regions (its `Peer`'s, shared), by the same index as `rkeys`.
    remote: Arc<[RegionBounds]>,
    /// Batches posted on this endpoint with reads UCX has not completed: its remote keys are
    /// destroyed only when there are none.
    outstanding: Arc<AtomicUsize>,
    /// Created with `UCP_ERR_HANDLING_MODE_PEER`: only such an endpoint may be force-closed.
    peer_error_handling: bool,
}

// SAFETY: ep and rkeys are only used under the worker lock.
unsafe impl Send for Endpoint {}
unsafe impl Sync for Endpoint {}

/// One contiguous read: `len` bytes from the peer's `remote_addr` (inside the peer region
/// `remote_region`) into `local_addr` (inside `local`).
pub struct Read<'a> {
    pub local_addr: u64,
    pub local: &'a Arc<MemRegion>,
    pub remote_addr: u64,
    pub remote_region: usize,
    pub len: u64,
}

/// Progress rounds per taking of the worker lock: a small batch's reads (one per round over
/// shared memory) complete under one lock, and a large one's still leave the lock to posting
/// threads every few tens of microseconds.
const ROUNDS_PER_LOCK: usize = 32;

/// How long closing an endpoint may take before it is abandoned to worker teardown.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

impl Endpoint {
    /// Posts every read of `batch`; each completes on its own (a read that completes at once,
    /// or a pending one through [`read_done`]), and the batch settles when the last one has.
    /// No flush: a batch never waits behind other batches' reads to the same peer.
    ///
    /// Every read is checked here, before anything is posted, to lie inside its local region
    /// and inside the peer region it names. On an error after posting began, the reads posted
    /// before it are still in flight (the batch stays pending until they
    /// complete, or until [`Endpoint::abort`] cancels them).
    ///
    /// Crate invariant (this module is private to the crate): the local regions stay
    /// registered until the batch has no read outstanding. The engine keeps them for its life
    /// and, closing, drains outstanding reads and leaves registered (leaks) the regions of
    /// any it could not drain. Held per batch instead, a region's last reference could fall
    /// inside UCX's completion callback, whose unregistering would need the worker lock that
    /// progress holds.
    pub fn post_reads(&self, reads: &[Read<'_>], batch: &Arc<BatchState>) -> Result<(), UcxError> {
        if let Err(status) = check_bounds(reads, &self.remote) {
            return Err(UcxError::Call { call: "ucp_get_nbx", status });
        }
        let api = self.worker.api;
        // A batch is posted on one endpoint, once; it counts there until its last read ends.
        if batch.endpoint_batches.set(Arc::clone(&self.outstanding)).is_ok() {
            self.outstanding.fetch_add(1, Ordering::AcqRel);
        }
        let _g = self.worker.guard();
        // The posting itself counts as one unfinished read, so the batch cannot settle before
        // its last read is posted; every read is counted up front (one atomic add per batch).
        batch.start_reads(reads.len() + 1);
        // One reference to the batch for all its pending reads' callbacks, so that a read
        // costs no reference count of its own: released by whoever ends the batch's last read.
        let in_flight = Arc::into_raw(Arc::clone(batch));
        let result = self.post_each(api, reads, batch, in_flight);
        if let Err(e) = &result {
            batch.record_read_error(e.to_string());
        }
        if batch.reads_finished(1) {
            // SAFETY: the posting ended the batch's last read, so no callback will use the
            // in-flight reference: it is released here, once.
            unsafe { drop(Arc::from_raw(in_flight)) };
        }
        result
    }

    /// Posts `reads`, all counted in `batch` already: each one is ended here (done at once,
    /// failed, or never posted after a failure) or, when it goes pending, by [`read_done`].
    /// `in_flight` is the batch's reference that [`read_done`] is handed.
    fn post_each(
        &self,
        api: &'static Api,
        reads: &[Read<'_>],
        batch: &BatchState,
        in_flight: *const BatchState,
    ) -> Result<(), UcxError> {
        let mut result = Ok(());
        for (i, read) in reads.iter().enumerate() {
            let rkey = self.rkeys[read.remote_region];
            let user_data = in_flight as *mut c_void;
            let param = sys::ucp_request_param_t {
                op_attr_mask: sys::UCP_OP_ATTR_FIELD_MEMH
                    | sys::UCP_OP_ATTR_FIELD_CALLBACK
                    | sys::UCP_OP_ATTR_FIELD_USER_DATA,
                memh: read.local.memh,
                cb: Some(read_done),
                user_data,
                ..Default::default()
            };
            // SAFETY: UCX writes the remote range into the local buffer until the read
            // completes: check_bounds checked that the local range lies in a registered region
            // (which the caller keeps alive until the batch settles) and the remote range in
            // the region this rkey was unpacked for; the lock is held. user_data stays valid
            // until the read ends: the in-flight reference is released only after the batch's
            // last read, and UCX calls read_done (once) only for a read that went pending.
            let sp = unsafe {
                (api.ucp_get_nbx)(
                    self.ep,
                    read.local_addr as *mut c_void,
                    read.len as usize,
                    read.remote_addr,
                    rkey,
                    &param,
                )
            };
            // Never the batch's last read here: the posting itself is still counted.
            match sys::status_ptr(sp) {
                StatusPtr::Pending(_) => {}
                StatusPtr::Done => {
                    let _ = batch.reads_finished(1);
                }
                StatusPtr::Failed(status) => {
                    // This read and the ones never posted.
                    let _ = batch.reads_finished(reads.len() - i);
                    result = Err(call_error(api, "ucp_get_nbx", status));
                    break;
                }
            }
        }
        result
    }
}

/// Checks every read to lie inside its local region and inside the peer region (of `remote`)
/// it names, with a length that fits in memory: the check before any read is made, by either
/// transport.
fn check_bounds(reads: &[Read<'_>], remote: &[RegionBounds]) -> Result<(), String> {
    let in_bounds = |read: &&Read<'_>| {
        read.local.contains(read.local_addr, read.len)
            && remote
                .get(read.remote_region)
                .is_some_and(|r| r.contains(read.remote_addr, read.len))
            && usize::try_from(read.len).is_ok()
    };
    match reads.iter().find(|read| !in_bounds(read)) {
        Some(read) => Err(format!(
            "read of {} bytes from {:#x} (peer region {}) into {:#x} is outside the registered regions",
            read.len, read.remote_addr, read.remote_region, read.local_addr
        )),
        None => Ok(()),
    }
}

/// UCX's completion callback of one pending read: runs exactly once, inside progress (or a
/// forced close) on the thread holding the worker lock.
unsafe extern "C" fn read_done(
    request: *mut c_void,
    status: sys::ucs_status_t,
    user_data: *mut c_void,
) {
    // SAFETY: user_data is the batch's in-flight reference (post_reads), released only once
    // the batch's last read has ended; this read has not, so the batch is alive.
    let batch = unsafe { &*(user_data as *const BatchState) };
    let api = batch.api;
    if status != sys::UCS_OK {
        batch.record_read_error(format!("UCX read failed: {}", api.status_text(status)));
    }
    // SAFETY: the request belongs to this completed read and is freed once.
    unsafe { (api.ucp_request_free)(request) };
    if batch.reads_finished(1) {
        // SAFETY: this was the batch's last read, so the in-flight reference is this
        // callback's to release, once; `batch` is not used after.
        unsafe { drop(Arc::from_raw(user_data as *const BatchState)) };
    }
}

impl Endpoint {
    /// Closes the endpoint for batches that must be failed (deadline, dead peer) before their
    /// reads finished. With peer error handling the close is forced: UCX completes every
    /// outstanding read on it as cancelled, after which no byte of them can land. Without it
    /// a forced close is undefined behaviour (`ucp.h`: `UCP_EP_CLOSE_FLAG_FORCE` needs
    /// `UCP_ERR_HANDLING_MODE_PEER`), so the close flushes: reads that complete meanwhile
    /// complete, and one UCX still holds after [`CLOSE_TIMEOUT`] keeps its batch pending (and
    /// the remote keys alive) until it completes, as a forced close that UCX did not finish
    /// would.
    pub fn abort(mut self) {
        let force = self.peer_error_handling;
        self.close(force);
    }

    fn close(&mut self, force: bool) {
        if self.ep.is_null() {
            return;
        }
        let api = self.worker.api;
        let param = sys::ucp_request_param_t {
            op_attr_mask: if force { sys::UCP_OP_ATTR_FIELD_FLAGS } else { 0 },
            flags: if force { sys::UCP_EP_CLOSE_FLAG_FORCE } else { 0 },
            ..Default::default()
        };
        let guard = self.worker.guard();
        // SAFETY: ep is live and closed once (nulled below); a non-forced close flushes
        // outstanding reads, a forced one (only on a peer-error-handling endpoint, see
        // `abort`) cancels them; the lock is held.
        let sp = unsafe { (api.ucp_ep_close_nbx)(self.ep, &param) };
        drop(guard);
        self.ep = ptr::null_mut();
        let closed = match sys::status_ptr(sp) {
            StatusPtr::Done => true,
            StatusPtr::Failed(status) => {
                log::debug!("closing a UCX endpoint: {}", api.status_text(status));
                true
            }
            StatusPtr::Pending(req) => self.wait_for_close(req),
        };
        let outstanding = self.outstanding.load(Ordering::Acquire);
        if !closed || outstanding > 0 {
            // UCX requires a remote key to outlive every operation that uses it: these go
            // with the worker instead.
            log::warn!("UCX endpoint closed with {outstanding} batches of reads outstanding (close complete: {closed}); its remote keys are left to worker teardown");
            self.rkeys.clear();
            return;
        }
        let _g = self.worker.guard();
        for rkey in self.rkeys.drain(..) {
            // SAFETY: unpacked on this endpoint and destroyed once, after its close completed
            // with no read outstanding: UCX requires a remote key to outlive every operation
            // that uses it, and none is left.
            unsafe { (api.ucp_rkey_destroy)(rkey) };
        }
    }

    /// Progresses until the close request `req` completes (true) or [`CLOSE_TIMEOUT`] passes
    /// (false); the worker lock is taken per round, not held throughout.
    fn wait_for_close(&self, req: *mut c_void) -> bool {
        let api = self.worker.api;
        let deadline = Instant::now() + CLOSE_TIMEOUT;
        loop {
            {
                let _g = self.worker.guard();
                // SAFETY: worker live, lock held, req pending until its status changes.
                unsafe { (api.ucp_worker_progress)(self.worker.worker) };
                // SAFETY: as above; req is not freed before this check.
                if unsafe { (api.ucp_request_check_status)(req) } != sys::UCS_INPROGRESS {
                    // SAFETY: completed request, freed once.
                    unsafe { (api.ucp_request_free)(req) };
                    return true;
                }
                if Instant::now() >= deadline {
                    log::warn!("closing a UCX endpoint took over {CLOSE_TIMEOUT:?}; leaving it to worker teardown");
                    // SAFETY: freeing a pending request is allowed; UCX releases it later.
                    unsafe { (api.ucp_request_free)(req) };
                    return false;
                }
            }
            std::thread::yield_now();
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.close(false);
    }
}

/// Completion state of one batch of reads. It settles when its last read has completed (or
/// when it is failed with no read outstanding), never earlier: a failed batch is reported
/// only when UCX will not write any more of it, which is when the caller may reuse its memory.
pub struct BatchState {
    api: &'static Api,
    /// Reads posted and not completed, plus one while posting.
    unfinished: AtomicUsize,
    /// The first error: a read UCX failed, a post that failed, or [`BatchState::fail`]'s reason.
    failure: Mutex<Option<String>>,
    /// The outstanding-batch count of the endpoint the batch was posted on.
    endpoint_batches: OnceLock<Arc<AtomicUsize>>,
    /// Set once, when the batch settles; read without a lock by every poll.
    outcome: OnceLock<Result<(), String>>,
}

impl BatchState {
    pub fn new(worker: &Worker) -> Arc<BatchState> {
        Arc::new(BatchState {
            api: worker.api,
            unfinished: AtomicUsize::new(0),
            failure: Mutex::new(None),
            endpoint_batches: OnceLock::new(),
            outcome: OnceLock::new(),
        })
    }

    /// Counts `n` reads about to be posted (and the posting itself); each is ended by
    /// exactly one count of [`BatchState::reads_finished`].
    fn start_reads(&self, n: usize) {
        self.unfinished.fetch_add(n, Ordering::AcqRel);
    }

    /// Ends `n` reads; returns whether they were the batch's last, which settles it (and
    /// makes the caller the one to release the batch's in-flight reference).
    #[must_use]
    fn reads_finished(&self, n: usize) -> bool {
        if self.unfinished.fetch_sub(n, Ordering::AcqRel) != n {
            return false;
        }
        self.settle();
        if let Some(endpoint_batches) = self.endpoint_batches.get() {
            endpoint_batches.fetch_sub(1, Ordering::AcqRel);
        }
        true
    }

    fn record_read_error(&self, error: String) {
        self.failure.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(error);
    }

    /// Fails the batch for `reason`: at once when no read of it is outstanding, else when the
    /// last one completes (cancel them first with [`Endpoint::abort`]). A batch that settled
    /// already keeps its outcome.
    pub fn fail(&self, reason: String) {
        self.record_read_error(reason);
        if self.unfinished.load(Ordering::Acquire) == 0 {
            self.settle();
        }
    }

    /// Whether the batch has an error recorded (it may still have reads outstanding).
    pub fn has_failed(&self) -> bool {
        self.failure.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    /// Reads still outstanding (0 once settled).
    pub fn unfinished_reads(&self) -> usize {
        self.unfinished.load(Ordering::Acquire)
    }

    /// Records the outcome once; called when nothing is outstanding.
    fn settle(&self) {
        let outcome = match self.failure.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            Some(error) => Err(error),
            None => Ok(()),
        };
        // A batch that settled already keeps its outcome.
        let _ = self.outcome.set(outcome);
    }

    pub fn outcome(&self) -> Option<Result<(), String>> {
        self.outcome.get().cloned()
    }
}
