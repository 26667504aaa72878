//! Endpoints to peer workers and the batches of one-sided reads posted on them: each read is
//! checked against both sides' regions before anything is posted, completes on its own, and
//! its batch holds the local regions it writes into until its last read has ended.

use std::ffi::c_void;
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::sys::{self, Api, StatusPtr};
use super::{call_error, packed, BatchState, Read, UcxError, Worker, WorkerLock};
use crate::descriptors::RegionBounds;
use crate::handshake::MemoryType;

impl Worker {
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
        packed::parse_worker_address(peer_address, packed::unified_mode())
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
        let fault = Box::new(Fault { api: self.api, status: Mutex::new(None) });
        // SAFETY: zeroed reserve space and unused fields are valid.
        let mut params: sys::ucp_ep_params_t = unsafe { std::mem::zeroed() };
        params.field_mask =
            sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
        params.address = peer_address.as_ptr() as *const c_void;
        params.err_mode = if peer_error_handling {
            // An error of the endpoint is handed to `endpoint_failed` (UCX logs one it cannot
            // hand to anyone at ERROR), which records it for the next post to find.
            params.field_mask |= sys::UCP_EP_PARAM_FIELD_ERR_HANDLER;
            params.err_handler_cb = Some(endpoint_failed);
            params.err_handler_arg = &*fault as *const Fault as *mut c_void;
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
            fault,
        };
        // A lane over UCX's self transport reaches only the worker it belongs to: whatever
        // the address said, it resolved to this worker (see `check_not_this_process`).
        match endpoint.transports(&_g) {
            Ok(lanes) if !lanes.iter().any(|t| t == "self") => {}
            outcome => {
                drop(_g);
                drop(endpoint);
                return Err(outcome.err().unwrap_or_else(|| UcxError::Call {
                    call: "ucp_ep_create",
                    status: "the peer's worker address resolves to this very worker".to_owned(),
                }));
            }
        }
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

impl Endpoint {
    /// The transport of each of the endpoint's lanes, as UCX resolved the peer's address.
    fn transports(&self, _locked: &WorkerLock<'_>) -> Result<Vec<String>, UcxError> {
        let empty =
            sys::ucp_transport_entry_t { transport_name: ptr::null(), device_name: ptr::null() };
        let mut entries = [empty; sys::UCP_MAX_LANES];
        // SAFETY: all-zero is valid for every field (null pointers, zero counts).
        let mut attr: sys::ucp_ep_attr_t = unsafe { std::mem::zeroed() };
        attr.field_mask = sys::UCP_EP_ATTR_FIELD_TRANSPORTS;
        attr.transports_entries = entries.as_mut_ptr();
        attr.transports_num_entries = entries.len() as std::ffi::c_uint;
        attr.transports_entry_size = std::mem::size_of::<sys::ucp_transport_entry_t>();
        // SAFETY: ep is live and the worker lock is held; UCX fills at most `num_entries`
        // entries of `entry_size` bytes, all in `entries`, with strings it owns.
        let status = unsafe { (self.worker.api.ucp_ep_query)(self.ep, &mut attr) };
        self.worker.check("ucp_ep_query", status)?;
        let lanes = (attr.transports_num_entries as usize).min(entries.len());
        let name = |entry: &sys::ucp_transport_entry_t| match entry.transport_name.is_null() {
            true => String::new(),
            // SAFETY: a non-null name UCX set is a NUL-terminated string it keeps while the
            // endpoint lives.
            false => unsafe { std::ffi::CStr::from_ptr(entry.transport_name) }
                .to_string_lossy()
                .into_owned(),
        };
        Ok(entries[..lanes].iter().map(name).collect())
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
    /// Where UCX reports the endpoint's failure (its error handler's argument): boxed, so its
    /// address holds; UCX calls the handler only before the endpoint is closed, which `close`
    /// does before the box goes.
    fault: Box<Fault>,
}

/// An endpoint's failure, as UCX reported it.
struct Fault {
    api: &'static Api,
    status: Mutex<Option<String>>,
}

/// UCX's error handler of an endpoint with peer error handling: the endpoint failed (the peer
/// died, its connection broke); its outstanding reads complete with errors on their own.
/// Runs inside progress, under the worker lock: it only records the failure.
unsafe extern "C" fn endpoint_failed(
    arg: *mut c_void,
    _ep: sys::ucp_ep_h,
    status: sys::ucs_status_t,
) {
    // SAFETY: `arg` is the endpoint's boxed Fault, which outlives every call (see `fault`).
    let fault = unsafe { &*(arg as *const Fault) };
    let text = fault.api.status_text(status);
    fault.status.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(text);
}

// SAFETY: ep and rkeys are only used under the worker lock.
unsafe impl Send for Endpoint {}
unsafe impl Sync for Endpoint {}

/// How long closing an endpoint may take before it is abandoned to worker teardown.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

impl Endpoint {
    /// Why UCX failed the endpoint, if it did (only an endpoint with peer error handling says):
    /// no read can be posted on it any more.
    pub fn failure(&self) -> Option<String> {
        self.fault.status.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Posts every read of `batch`; each completes on its own (a read that completes at once,
    /// or a pending one through [`read_done`]), and the batch settles when the last one has.
    /// No flush: a batch never waits behind other batches' reads to the same peer.
    ///
    /// Every read is checked here, before anything is posted, to lie inside its local region
    /// and inside the peer region it names. On an error after posting began, the reads posted
    /// before it are still in flight (the batch stays pending until they
    /// complete, or until [`Endpoint::abort`] cancels them).
    ///
    /// The batch holds the local regions from here on ([`BatchState::hold_regions`]): UCX's
    /// reference to it, released after its last read, keeps them registered while any read
    /// may still write into them, whatever the caller drops meanwhile.
    pub fn post_reads(&self, reads: &[Read<'_>], batch: &Arc<BatchState>) -> Result<(), UcxError> {
        if let Err(status) = check_bounds(reads, &self.remote) {
            return Err(UcxError::Call { call: "ucp_get_nbx", status });
        }
        batch.hold_regions(reads);
        let api = self.worker.api;
        // A batch is posted on one endpoint, once; it counts there until its last read ends.
        if batch.endpoint_batches.set(Arc::clone(&self.outstanding)).is_ok() {
            self.outstanding.fetch_add(1, Ordering::AcqRel);
        }
        let guard = self.worker.guard();
        // The posting itself counts as one unfinished read, so the batch cannot settle before
        // its last read is posted; every read is counted up front (one atomic add per batch).
        batch.start_reads(reads.len() + 1);
        // One reference to the batch for all its pending reads' callbacks, so that a read
        // costs no reference count of its own: released by whoever ends the batch's last read.
        let in_flight = Arc::into_raw(Arc::clone(batch));
        let result = self.post_each(api, reads, batch, in_flight);
        drop(guard);
        if let Err(e) = &result {
            batch.record_read_error(e.to_string());
        }
        if batch.reads_finished(1) {
            // SAFETY: the posting ended the batch's last read, so no callback will use the
            // in-flight reference: it is released here, once, outside the worker lock (and the
            // caller's `batch` is another).
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
            // (which the batch holds, and the in-flight reference keeps the batch, until the
            // read ends) and the remote range in the region this rkey was unpacked for; the
            // lock is held. user_data stays valid
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
pub(super) fn check_bounds(reads: &[Read<'_>], remote: &[RegionBounds]) -> Result<(), String> {
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
    let api = batch.worker.api;
    if status != sys::UCS_OK {
        batch.record_read_error(format!("UCX read failed: {}", api.status_text(status)));
    }
    // SAFETY: the request belongs to this completed read and is freed once.
    unsafe { (api.ucp_request_free)(request) };
    if batch.reads_finished(1) {
        // SAFETY: this was the batch's last read, so the in-flight reference is this
        // callback's to release, once; `batch` is not used after.
        let in_flight = unsafe { Arc::from_raw(user_data as *const BatchState) };
        // The last reference goes to the worker (this runs under its lock, which unregistering
        // the batch's regions takes); the others' holders drop them outside it.
        if let Some(last) = Arc::into_inner(in_flight) {
            let worker = Arc::clone(&last.worker);
            worker.retire(last);
        }
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
