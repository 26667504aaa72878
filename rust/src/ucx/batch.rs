//! A batch of reads (UCX or same-host) as its reads end: it holds the local regions they
//! write into until it is dropped, and settles once, when its last read has ended, telling its
//! engine then.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use super::{MemRegion, Worker};

/// One contiguous read: `len` bytes from the peer's `remote_addr` (inside the peer region
/// `remote_region`) into `local_addr` (inside `local`).
pub struct Read<'a> {
    pub local_addr: u64,
    pub local: &'a Arc<MemRegion>,
    pub remote_addr: u64,
    pub remote_region: usize,
    pub len: u64,
}

/// Completion state of one batch of reads. It settles when its last read has completed (or
/// when it is failed with no read outstanding), never earlier: a failed batch is reported
/// only when UCX will not write any more of it, which is when the caller may reuse its memory.
pub struct BatchState {
    pub(super) worker: Arc<Worker>,
    /// The registered regions its reads write into, held until the batch is dropped (after its
    /// last read ended): posting a read adds its region.
    regions: Mutex<Vec<Arc<MemRegion>>>,
    /// Reads posted and not completed, plus one while posting.
    unfinished: AtomicUsize,
    /// The first error: a read UCX failed, a post that failed, or [`BatchState::fail`]'s reason.
    failure: Mutex<Option<String>>,
    /// The outstanding-batch count of the endpoint the batch was posted on.
    pub(super) endpoint_batches: OnceLock<Arc<AtomicUsize>>,
    /// Set once, when the batch settles, with the time it did; read without a lock by every
    /// poll.
    outcome: OnceLock<(Result<(), String>, Instant)>,
    /// Where it reports, once, that it settled, and its number there.
    completions: Arc<Completions>,
    number: u64,
}

/// An engine's completion queue: the numbers of the batches that settled, each pushed once by
/// its batch wherever it settles (a UCX callback, a copy thread, [`BatchState::fail`]), taken
/// in bulk by the engine. Never blocks a batch for longer than a push.
///
/// Aligned to its own cache lines: every batch's reference count sits beside it (in its
/// `Arc`), and the threads that push would otherwise pull that line from the poster's core.
#[derive(Default)]
#[repr(align(128))]
pub struct Completions(Mutex<Vec<u64>>);

impl Completions {
    /// Reports batch `number` settled.
    pub fn settled(&self, number: u64) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).push(number);
    }

    /// Swaps the numbers reported since the last call into `into`, whose contents (emptied by
    /// the caller) become the next queue: neither side allocates once they have grown.
    pub fn take(&self, into: &mut Vec<u64>) {
        std::mem::swap(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()), into);
    }
}

impl BatchState {
    /// A batch of reads into `worker`'s regions, reported to `completions` as `number` when
    /// it settles.
    pub fn new(
        worker: &Arc<Worker>,
        completions: Arc<Completions>,
        number: u64,
    ) -> Arc<BatchState> {
        Arc::new(BatchState {
            worker: Arc::clone(worker),
            regions: Mutex::new(Vec::new()),
            unfinished: AtomicUsize::new(0),
            failure: Mutex::new(None),
            endpoint_batches: OnceLock::new(),
            outcome: OnceLock::new(),
            completions,
            number,
        })
    }

    /// Holds the local region of each of `reads` (once each) for as long as the batch lives.
    pub(super) fn hold_regions(&self, reads: &[Read<'_>]) {
        let mut regions = self.regions.lock().unwrap_or_else(|p| p.into_inner());
        for read in reads {
            // Reads are segment-major: nearly always the region of the read before.
            if !regions.last().is_some_and(|r| Arc::ptr_eq(r, read.local))
                && !regions.iter().any(|r| Arc::ptr_eq(r, read.local))
            {
                regions.push(Arc::clone(read.local));
            }
        }
    }

    /// Counts `n` reads about to be posted (and the posting itself); each is ended by
    /// exactly one count of [`BatchState::reads_finished`].
    pub(super) fn start_reads(&self, n: usize) {
        self.unfinished.fetch_add(n, Ordering::AcqRel);
    }

    /// Ends `n` reads; returns whether they were the batch's last, which settles it (and
    /// makes the caller the one to release the batch's in-flight reference).
    #[must_use]
    pub(super) fn reads_finished(&self, n: usize) -> bool {
        if self.unfinished.fetch_sub(n, Ordering::AcqRel) != n {
            return false;
        }
        self.settle();
        if let Some(endpoint_batches) = self.endpoint_batches.get() {
            endpoint_batches.fetch_sub(1, Ordering::AcqRel);
        }
        true
    }

    pub(super) fn record_read_error(&self, error: String) {
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

    /// Whether every region it writes into holds the owner of its memory, which its reads
    /// then cannot outlive ([`super::RegionMemory::kept_alive_by`]).
    pub fn writes_only_memory_it_keeps(&self) -> bool {
        self.regions.lock().unwrap_or_else(|p| p.into_inner()).iter().all(|r| r.holds_its_memory())
    }

    /// Records the outcome once; called when nothing is outstanding.
    fn settle(&self) {
        let outcome = match self.failure.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            Some(error) => Err(error),
            None => Ok(()),
        };
        // A batch that settled already keeps its outcome.
        if self.outcome.set((outcome, Instant::now())).is_ok() {
            self.completions.settled(self.number);
        }
    }

    pub fn outcome(&self) -> Option<Result<(), String>> {
        self.outcome.get().map(|(outcome, _)| outcome.clone())
    }

    /// The outcome and when the batch settled (its last read ended, or it failed with none
    /// outstanding).
    pub fn settled(&self) -> Option<(Result<(), String>, Instant)> {
        self.outcome.get().cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::descriptors::RegionBounds;
    use crate::ucx::RegionMemory;

    /// A worker's own address: UCX reads this process over its `self`/shared-memory transports.
    #[test]
    fn a_batch_keeps_the_region_it_writes_into_registered_until_it_ends() {
        let worker = Worker::new("batch-holds-regions", None).expect("UCX loads");
        let source: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
        let mut dest = vec![0u8; 4096];
        // SAFETY: both buffers are this test's, declared before the regions and batch, so
        // they outlive them; `dest` is read only once the batch settled.
        let (from, into) = unsafe {
            (
                RegionMemory::new(source.as_ptr() as u64, 4096),
                RegionMemory::new(dest.as_mut_ptr() as u64, 4096),
            )
        };
        // Another worker of this process owns the source: an endpoint never reaches its own.
        let owner = Worker::new("batch-holds-regions-owner", None).expect("UCX loads");
        let from = owner.register(from).unwrap();
        let into = Arc::new(worker.register(into).unwrap());
        let bounds = RegionBounds { addr: from.addr, len: from.len };
        let endpoint = worker
            .connect(owner.address(), Arc::from([bounds]), &[(&from.rkey, from.memory)], false)
            .unwrap();
        let batch = BatchState::new(&worker, Arc::default(), 0);
        let read = Read {
            local_addr: into.addr,
            local: &into,
            remote_addr: from.addr,
            remote_region: 0,
            len: 4096,
        };
        endpoint.post_reads(&[read], &batch).unwrap();
        let registered = Arc::downgrade(&into);
        drop(into);
        assert!(registered.upgrade().is_some(), "the caller's region went, the batch's stays");
        while batch.outcome().is_none() {
            worker.progress();
        }
        assert_eq!(batch.outcome(), Some(Ok(())));
        assert_eq!(dest, source);
        drop(batch);
        assert!(registered.upgrade().is_none(), "unregistered once the batch is gone");
    }
}
