//! Reading: a batch is planned, bounds-checked and posted ([`Engine::read_blocks`]), tracked
//! while in flight ([`Inflight`]: deadline, peer, the notification that follows its last byte),
//! and settled by whoever sees it end first: its [`Transfer`]'s caller or the progress thread.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::peer::Inflight;
use super::routes::{resolve, unroute};
use super::{lock, Engine, EngineError, Shared};
use crate::clock::deadline_after;
use crate::descriptors::{check_remote_bounds, plan_reads, plan_segment_reads, BlockSlice};
use crate::handshake::MemoryType;
use crate::ucx::{BatchState, Read};

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
        let same_host = peer
            .same_host
            .as_ref()
            .filter(|_| reads.iter().all(|r| r.local.memory == MemoryType::Host));
        // Numbered and tracked under one hold of the book's lock.
        let mut book = lock(&self.shared.inflight);
        let (number, completions) = book.reserve();
        let batch = BatchState::new(&self.shared.worker, completions, number);
        let inflight = Arc::new(Inflight {
            number,
            batch: Arc::clone(&batch),
            peer: Arc::clone(&peer),
            deadline: deadline_after(timeout),
            notify: Mutex::new(notify),
            abort_reason: Mutex::new(None),
            same_host: same_host.is_some(),
        });
        book.track(number, Arc::clone(&inflight), inflight.deadline);
        drop(book);
        if peer.post(&self.shared, &inflight, &reads, same_host) {
            unroute(&self.shared, &peer);
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

    /// Queues `payload` for a connected peer without reading anything, on that peer's own
    /// link ([`crate::side_channel::PeerLink::notify`]): in order with the read-done
    /// notifications of batches that finished before this call, written by the link's thread,
    /// so a peer that does not read delays only its own (a write that fails ends its link).
    pub fn notify(&self, peer_id: &str, payload: &[u8]) -> Result<(), EngineError> {
        let peer = resolve(&self.shared, peer_id)?;
        Ok(peer.link.notify(payload)?)
    }
}

/// Index of the first region satisfying `fits`, trying `hint` before scanning.
fn find_region<T>(regions: &[T], hint: usize, fits: impl Fn(&T) -> bool) -> Option<usize> {
    if regions.get(hint).is_some_and(&fits) {
        return Some(hint);
    }
    regions.iter().position(fits)
}

/// Fails those of `due` that passed their deadline by `now` unsettled, whatever their peer's
/// state: through the connection each was posted on ([`super::peer::Peer::expire`]: alone for a
/// same-host batch, by closing the connection for a UCX one). A batch that connection no longer
/// tracks was failed when it closed, and settles when its last read comes back.
fn expire(shared: &Shared, due: &[Arc<Inflight>], now: Instant) {
    let passed = |i: &&Arc<Inflight>| now >= i.deadline && i.batch.outcome().is_none();
    // Nearly always none: `Transfer::wait` asks on every round.
    if !due.iter().any(|i| passed(&i)) {
        return;
    }
    let mut due: Vec<Arc<Inflight>> = due.iter().filter(passed).cloned().collect();
    // By connection, each asked once.
    due.sort_by_key(|i| Arc::as_ptr(&i.peer));
    for on_peer in due.chunk_by(|a, b| Arc::ptr_eq(&a.peer, &b.peer)) {
        let peer = &on_peer[0].peer;
        if peer.expire(on_peer, now) {
            unroute(shared, peer);
        }
    }
}

/// Settles what finished or passed its deadline since the last call, found by the in-flight
/// book's completion queue and deadline heap ([`super::inflight`]); returns whether any batch
/// is still pending.
pub(super) fn settle_all(shared: &Shared) -> bool {
    let now = Instant::now();
    let due = lock(&shared.inflight).due(now);
    expire(shared, &due, now);
    // Those that settled, expired just now or not.
    let settled = lock(&shared.inflight).take_settled();
    for inflight in &settled {
        notify_done(inflight);
    }
    !lock(&shared.inflight).is_empty()
}

/// Queues the batch's notification (once, only on success) on its peer's link. Called on the
/// progress thread and in `Transfer::poll`/`wait`, neither of which may block on a socket: the
/// link's own thread writes it.
fn notify_done(inflight: &Inflight) {
    if let Some(Ok(())) = inflight.result() {
        if let Some(payload) = lock(&inflight.notify).take() {
            if let Err(e) = inflight.peer.link.notify(&payload) {
                log::warn!(
                    "read done but peer {} was not notified: {e}",
                    inflight.peer.meta.engine_id
                );
            }
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
        expire(&self.shared, std::slice::from_ref(&self.inflight), Instant::now());
        let outcome = self.inflight.result()?;
        notify_done(&self.inflight);
        lock(&self.shared.inflight).remove(self.inflight.number);
        Some(outcome.map_err(|error| {
            let reason = lock(&self.inflight.abort_reason).clone();
            EngineError::Transfer(
                reason.unwrap_or_else(|| {
                    format!("{error} (peer {})", self.inflight.peer.meta.engine_id)
                }),
            )
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
