//! The engine's batches in flight, found without scanning them: a batch that settles puts its
//! number on a completion queue ([`Completions`], from wherever it settles: a UCX callback, a
//! copy thread, a failure), and deadlines wait in a heap ordered by time. So the progress thread's round costs what settled or fell due since the last one,
//! O(log n) each, whatever the number n in flight, and a finished batch leaves in O(1).
//!
//! This replaced a list the progress thread copied and scanned whole every millisecond while
//! anything was pending, and removed each finished batch from by a scan. Time is passed in, so
//! the rules are tested without sockets or UCX (below); the engine's batches are
//! [`super::peer::Inflight`]s, settled and expired by `read.rs`.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::time::Instant;

use crate::ucx::Completions;

pub(super) struct InflightBook<B> {
    next: u64,
    batches: HashMap<u64, B, BuildHasherDefault<NumberHash>>,
    /// (deadline, number) of tracked batches, earliest first; an entry whose batch left the
    /// book stays until it comes up, or until the heap is rebuilt ([`InflightBook::track`]).
    deadlines: BinaryHeap<Reverse<(Instant, u64)>>,
    /// The completion queue of the batches it tracks.
    settled: Arc<Completions>,
    /// The queue's last contents, emptied: swapped in for the next round, so that neither
    /// allocates once grown.
    spare: Vec<u64>,
}

/// Batch numbers are the book's own, consecutive and never chosen by a peer: a multiplication
/// spreads them over the table (SipHash, the default, costs more than the rest of a lookup).
#[derive(Default)]
struct NumberHash(u64);

impl Hasher for NumberHash {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(self.0 << 8 | u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

impl<B: Clone> InflightBook<B> {
    pub(super) fn new() -> Self {
        Self {
            next: 0,
            batches: HashMap::default(),
            deadlines: BinaryHeap::new(),
            settled: Arc::default(),
            spare: Vec::new(),
        }
    }

    /// The number of the next batch, and the queue it reports to when it settles (before it
    /// is tracked: the batch needs both when it is made).
    pub(super) fn reserve(&mut self) -> (u64, Arc<Completions>) {
        self.next += 1;
        (self.next, Arc::clone(&self.settled))
    }

    /// Tracks batch `number` until it settles or the book is cleared; its deadline comes up in
    /// [`InflightBook::due`] once.
    pub(super) fn track(&mut self, number: u64, batch: B, deadline: Instant) {
        self.batches.insert(number, batch);
        // Entries of batches that left: rebuilt from those tracked when they are most of the
        // heap, which keeps it within twice the batches in flight at O(1) a batch.
        if self.deadlines.len() >= 2 * self.batches.len() + 64 {
            let batches = &self.batches;
            self.deadlines.retain(|Reverse((_, n))| batches.contains_key(n));
        }
        self.deadlines.push(Reverse((deadline, number)));
    }

    /// Stops tracking batch `number` (it settled); nothing if it was not tracked.
    pub(super) fn remove(&mut self, number: u64) -> Option<B> {
        self.batches.remove(&number)
    }

    /// The tracked batches whose deadline is `now` or earlier and not reported yet, earliest
    /// first; each is reported once (whether it settled meanwhile is the caller's to check).
    pub(super) fn due(&mut self, now: Instant) -> Vec<B> {
        let mut due = Vec::new();
        while let Some(&Reverse((deadline, number))) = self.deadlines.peek() {
            if deadline > now {
                break;
            }
            self.deadlines.pop();
            if let Some(batch) = self.batches.get(&number) {
                due.push(batch.clone());
            }
        }
        due
    }

    /// The batches that settled since the last call and were still tracked, no longer tracked.
    pub(super) fn take_settled(&mut self) -> Vec<B> {
        self.settled.take(&mut self.spare);
        let settled = self.spare.iter().filter_map(|n| self.batches.remove(n)).collect();
        self.spare.clear();
        settled
    }

    pub(super) fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &B> {
        self.batches.values()
    }

    /// Forgets every batch (the engine closed and drained them).
    pub(super) fn clear(&mut self) {
        self.batches.clear();
        self.deadlines.clear();
        self.settled.take(&mut self.spare);
        self.spare.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn deadlines_come_up_in_order_once_and_only_for_batches_still_tracked() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut book = InflightBook::new();
        for (name, ms) in [("c", 30), ("a", 10), ("d", 40), ("b", 20)] {
            let (n, _) = book.reserve();
            book.track(n, name, at(ms));
        }
        assert!(book.due(at(9)).is_empty());
        assert_eq!(book.due(at(20)), ["a", "b"], "earliest first");
        assert!(book.due(at(25)).is_empty(), "each reported once");
        // "c" finished before its deadline.
        let c = 1;
        assert_eq!(book.remove(c), Some("c"));
        assert_eq!(book.due(at(100)), ["d"]);
        assert!(!book.is_empty(), "a due batch stays tracked until it settles");
    }

    #[test]
    fn a_settled_batch_is_delivered_once_by_the_queue_even_after_its_deadline() {
        let t0 = Instant::now();
        let mut book = InflightBook::new();
        let (late, queue) = book.reserve();
        book.track(late, "late", t0);
        let (other, _) = book.reserve();
        book.track(other, "other", t0 + Duration::from_secs(1));
        assert_eq!(book.due(t0), ["late"]);
        assert!(book.take_settled().is_empty());
        // Its last read comes back after its deadline, from another thread.
        std::thread::spawn(move || queue.settled(late)).join().unwrap();
        assert_eq!(book.take_settled(), ["late"]);
        assert!(book.take_settled().is_empty());
        assert_eq!(book.iter().collect::<Vec<_>>(), [&"other"]);
    }

    #[test]
    fn a_finished_batch_among_many_leaves_alone_and_the_heap_stays_bounded() {
        let t0 = Instant::now();
        let mut book = InflightBook::new();
        let mut numbers = HashMap::new();
        for i in 0..1024u64 {
            let (n, queue) = book.reserve();
            book.track(n, i, t0 + Duration::from_secs(10 + i));
            numbers.insert(i, (n, queue));
        }
        let (n, queue) = numbers.remove(&500).unwrap();
        queue.settled(n);
        assert_eq!(book.take_settled(), [500]);
        assert_eq!(book.iter().count(), 1023);
        assert!(book.iter().all(|&i| i != 500));
        // Batches waited for by their callers leave by number, not through the queue; their
        // deadlines, far off, do not pile up.
        for i in 0..100_000u64 {
            let (n, _) = book.reserve();
            book.track(n, 2000 + i, t0 + Duration::from_secs(3600));
            assert_eq!(book.remove(n), Some(2000 + i));
        }
        assert!(book.deadlines.len() <= 2 * 1023 + 64 + 1, "{}", book.deadlines.len());
        let due = book.due(t0 + Duration::from_secs(10 + 1023));
        assert_eq!(due.len(), 1023);
        assert!(due.windows(2).all(|w| w[0] < w[1]), "in deadline order");
        book.clear();
        assert!(book.is_empty() && book.take_settled().is_empty());
    }
}
