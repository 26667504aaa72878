//! Safe wrappers over UCP: one context + worker per engine, registered memory, endpoints with
//! their unpacked remote keys, and batches of one-sided reads, each read completed on its own.
//!
//! Same-host peers are read without UCX ([`crate::same_host`]), a batch per system call
//! ([`process_read`]), once the kernel shows which process they are ([`peer_process`]); a
//! worker address that reaches this very process is refused ([`this_process`]).
//!
//! All `unsafe` in the crate lives in this module. Every UCP call on a worker (and on its
//! context) is made while holding [`Worker::lock`]: the worker is created in UCX's
//! `SERIALIZED` thread mode, which allows any thread as long as calls never overlap.
//!
//! Its safe functions have no contract a caller could break; the one promise nothing here can
//! check, that a raw address range is memory this process keeps, is made once, by
//! constructing a [`RegionMemory`] (an `unsafe fn`), where the range comes from: the Python
//! binding, which receives tensors' addresses. Everything after is held by the types: a
//! [`MemRegion`] stays registered while a batch that writes into it exists (the batch holds it,
//! [`BatchState`]), so neither a UCX read ([`Endpoint::post_reads`]) nor a same-host copy
//! ([`CheckedCopy`]) can outlive the registration of the memory it writes.

mod batch;
mod endpoint;
pub mod packed;
mod peer_process;
mod process_read;
mod sys;
mod this_process;

use std::ffi::{c_int, c_void, CString};
use std::path::Path;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::descriptors::RegionBounds;
use crate::handshake::MemoryType;
pub use batch::{BatchState, Completions, Read};
pub use endpoint::Endpoint;
pub use peer_process::{pid_namespace, OpenError, PeerProcess};
pub use process_read::{CheckedCopy, Piece, MAX_BYTES_PER_CALL, MAX_RANGES_PER_CALL};
use sys::Api;
pub use this_process::check_not_this_process;

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
    /// Batches whose last reference a completion callback released under `lock`: dropped
    /// (unregistering the regions they held) once the lock is released ([`WorkerLock`]).
    retired: Mutex<Vec<BatchState>>,
    /// Whether `retired` may hold any, so that releasing the lock costs no second lock.
    has_retired: AtomicBool,
    address: Vec<u8>,
    /// Owned by UCX (closed with the worker); readable when the worker has events.
    event_fd: Option<c_int>,
    /// Threads inside a [`Foreground`] section, driving progress themselves.
    foreground: AtomicUsize,
    /// Counts the worker as one of this process's while it lives.
    _registered: this_process::Registered,
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
            retired: Mutex::new(Vec::new()),
            has_retired: AtomicBool::new(false),
            event_fd,
            foreground: AtomicUsize::new(0),
            _registered: this_process::Registered::new(&address),
            address,
        }))
    }

    /// This worker's address, which peers need to create an endpoint to it.
    pub fn address(&self) -> &[u8] {
        &self.address
    }

    fn guard(&self) -> WorkerLock<'_> {
        WorkerLock {
            worker: self,
            held: Some(self.lock.lock().unwrap_or_else(|poisoned| poisoned.into_inner())),
        }
    }

    /// Keeps `batch`, whose last reference was released under the worker lock, until the lock
    /// is released: dropping it there would unregister its regions, which takes the lock.
    fn retire(&self, batch: BatchState) {
        self.retired.lock().unwrap_or_else(|p| p.into_inner()).push(batch);
        self.has_retired.store(true, Ordering::Release);
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

    /// Registers `memory` (host or GPU memory; UCX detects which) for remote reads and as the
    /// destination of ours. A host range must be mapped in this process, page by page (checked
    /// here); a GPU range must be one UCX's CUDA support recognizes. That it stays so is
    /// `memory`'s promise ([`RegionMemory::new`]).
    pub fn register(self: &Arc<Self>, memory: RegionMemory) -> Result<MemRegion, UcxError> {
        let RegionMemory { addr, len, owner } = memory;
        let _g = self.guard();
        // SAFETY: zeroed reserve space and unused fields are valid.
        let mut params: sys::ucp_mem_map_params_t = unsafe { std::mem::zeroed() };
        params.field_mask =
            sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH;
        params.address = addr as *mut c_void;
        params.length = len as usize;
        let mut memh = ptr::null_mut();
        // SAFETY: `memory` vouches that the range is memory of this process, mapped while it is
        // registered (RegionMemory::new); UCX validates what it can and fails otherwise.
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
        Ok(MemRegion { worker: Arc::clone(self), memh, addr, len, memory, rkey, owner })
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
        // SAFETY: every MemRegion, Endpoint and BatchState holds an Arc<Worker>, so none is
        // left (nor a retired batch); the
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

/// The worker lock, held; on release it drops the batches retired meanwhile
/// ([`Worker::retire`]), outside the lock.
struct WorkerLock<'a> {
    worker: &'a Worker,
    held: Option<MutexGuard<'a, ()>>,
}

impl Drop for WorkerLock<'_> {
    fn drop(&mut self) {
        drop(self.held.take());
        // A load first: the flag is nearly always clear, and a write on every release would
        // pull its cache line away from the other threads taking the lock.
        if self.worker.has_retired.load(Ordering::Acquire)
            && self.worker.has_retired.swap(false, Ordering::AcqRel)
        {
            let retired =
                std::mem::take(&mut *self.worker.retired.lock().unwrap_or_else(|p| p.into_inner()));
            drop(retired);
        }
    }
}

/// A range of this process's memory that its creator vouches for, to be registered
/// ([`Worker::register`]) and then read by peers and written by our reads at any time.
///
/// ```compile_fail,E0133
/// // Safe code cannot name memory for the engine to write into: the promise is an `unsafe fn`.
/// let buffer = vec![0u8; 4096];
/// let memory = kvduplex::engine::RegionMemory::new(buffer.as_ptr() as u64, 4096);
/// ```
pub struct RegionMemory {
    addr: u64,
    len: u64,
    /// What keeps the range allocated ([`RegionMemory::kept_alive_by`]), if the engine holds it.
    owner: Option<MemoryOwner>,
}

/// The owner of a registered range's memory (a Python tensor, a buffer): held with the region,
/// and so for as long as any read may still write into the range.
pub type MemoryOwner = Box<dyn std::any::Any + Send + Sync>;

impl RegionMemory {
    /// # Safety
    /// `[addr, addr+len)` must be memory of this process (host memory, or GPU memory that UCX's
    /// CUDA support recognizes) that stays allocated, and is used for nothing else than the
    /// blocks it holds, for as long as it is registered: until the engine it is registered
    /// with has closed ([`crate::engine::Engine::close`] returned, or the engine dropped; close
    /// returns only once no read can write into such memory any more, however long that
    /// takes). Peers read it, and the engine's reads write into it, whenever it is registered;
    /// a reader must not touch the blocks of a batch until that batch has settled.
    pub unsafe fn new(addr: u64, len: u64) -> RegionMemory {
        RegionMemory { addr, len, owner: None }
    }

    /// Memory that `owner` keeps allocated: the region holds `owner` for as long as a read may
    /// still write into it, past the engine's close when a read that close cannot stop (a
    /// same-host copy blocked in the kernel, a read UCX could not cancel) is still out. Close
    /// then returns after a bounded wait.
    ///
    /// # Safety
    /// As [`RegionMemory::new`], except that the range must stay allocated for as long as
    /// `owner` lives, rather than until the engine closed; once it closed, the blocks of the
    /// batches that had not settled may still be written until the engine drops `owner`.
    pub unsafe fn kept_alive_by(addr: u64, len: u64, owner: MemoryOwner) -> RegionMemory {
        RegionMemory { addr, len, owner: Some(owner) }
    }

    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Memory registered with UCX; unregistered on drop. Every batch that writes into a region
/// holds it ([`BatchState`]), so it stays registered while any of their reads may still land.
pub struct MemRegion {
    worker: Arc<Worker>,
    memh: sys::ucp_mem_h,
    pub addr: u64,
    pub len: u64,
    pub memory: MemoryType,
    /// The packed remote key a peer needs to read this region.
    pub rkey: Vec<u8>,
    /// Keeps the memory allocated; dropped after the region is unregistered.
    owner: Option<MemoryOwner>,
}

// SAFETY: memh is only used under the worker lock (in Drop and when posting reads).
unsafe impl Send for MemRegion {}
unsafe impl Sync for MemRegion {}

impl MemRegion {
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        RegionBounds { addr: self.addr, len: self.len }.contains(addr, len)
    }

    /// Whether the region holds the owner of its memory ([`RegionMemory::kept_alive_by`]).
    pub fn holds_its_memory(&self) -> bool {
        self.owner.is_some()
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

/// Progress rounds per taking of the worker lock: a small batch's reads (one per round over
/// shared memory) complete under one lock, and a large one's still leave the lock to posting
/// threads every few tens of microseconds.
const ROUNDS_PER_LOCK: usize = 32;
