//! What an owner announces to its readers about the turns it holds: some of the fingerprints
//! its hold book indexes for lookups, as "held" and "freed" updates, so that a reader can ask
//! only the owners that may hold a prompt (see [`crate::held_index`]).
//!
//! Of each held turn, the first block, every [`ANNOUNCE_STRIDE`]-th block and the last two
//! (the last full block and a partial tail) are announced ([`announced`]), not every block:
//! chained fingerprints make any of them stand for every block before it, so a reader finds
//! the holder of a prompt that continues the turn, or shares at least its first block, and
//! learns how much it holds to within a stride (the owner's own lookup answers block-exact).
//! At 100 decode nodes of 14.4k held blocks each, every block announced would put 1.44M
//! fingerprints into each prefill node's index (past its cap of 2^20, and its scheduler's
//! copy's 2^18); a stride of 16 puts about 12 per 128-block turn.
//!
//! The book records every change of its lookup index here, numbered; a reader's connection
//! keeps a cursor and is sent the changes past it, or a snapshot of the whole index when it has
//! none yet or fell behind the bounded log. Pure state, except for [`FeedWatch`], which wakes
//! the threads that send the changes.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::BlockFingerprint;

/// The most fingerprints one update carries (held and freed together): its msgpack body then
/// stays under the frame's cap (`wire::MAX_HELD_FRAME_LEN`) at 9 bytes a fingerprint.
pub const MAX_FINGERPRINTS_PER_UPDATE: usize = 65_536;
/// Of a held turn's blocks, every this many is announced (with the first and the last two).
pub const ANNOUNCE_STRIDE: usize = 16;

/// The fingerprints of a held turn that are announced, in order: block 0, each block `i`
/// with `(i + 1) % ANNOUNCE_STRIDE == 0`, the last full block of its prompt (its first
/// `prompt_blocks`: a prefill node that handed the prompt off waits for it, `held_mirror.py`),
/// and the last two.
pub fn announced(fingerprints: &[BlockFingerprint], prompt_blocks: usize) -> Vec<BlockFingerprint> {
    let n = fingerprints.len();
    fingerprints
        .iter()
        .enumerate()
        .filter(|&(i, _)| {
            i == 0 || (i + 1) % ANNOUNCE_STRIDE == 0 || i + 1 == prompt_blocks || i + 2 >= n
        })
        .map(|(_, &fingerprint)| fingerprint)
        .collect()
}

/// The log keeps at most this many changes and this many fingerprints in them; a reader
/// further behind is sent a snapshot instead.
pub const MAX_LOGGED_CHANGES: usize = 4096;
pub const MAX_LOGGED_FINGERPRINTS: usize = 1 << 20;

/// One frame of announcements: what the owner's lookup index gained and lost. A fingerprint
/// is listed once per held turn that has it, so a reader counts them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldUpdate {
    /// Forget everything this owner announced before: a snapshot starts with this update.
    #[serde(default)]
    pub reset: bool,
    #[serde(default)]
    pub held: Vec<BlockFingerprint>,
    #[serde(default)]
    pub freed: Vec<BlockFingerprint>,
    /// The snapshot ends with this update: from here on the reader's view of the owner is
    /// complete (later updates keep it so).
    #[serde(default)]
    pub synced: bool,
}

#[derive(Debug)]
enum Change {
    Held(Vec<BlockFingerprint>),
    Freed(Vec<BlockFingerprint>),
}

impl Change {
    fn len(&self) -> usize {
        match self {
            Self::Held(fps) | Self::Freed(fps) => fps.len(),
        }
    }
}

/// The numbered, bounded log of the book's index changes.
#[derive(Debug, Default)]
pub(super) struct ChangeLog {
    /// The number of the log's first change.
    first: u64,
    changes: VecDeque<Change>,
    fingerprints: usize,
    watch: Arc<FeedWatch>,
}

impl ChangeLog {
    /// The number the next change will get: a cursor that has seen everything so far.
    pub(super) fn next(&self) -> u64 {
        self.first + self.changes.len() as u64
    }

    pub(super) fn watch(&self) -> &Arc<FeedWatch> {
        &self.watch
    }

    pub(super) fn held(&mut self, fingerprints: Vec<BlockFingerprint>) {
        self.record(Change::Held(fingerprints));
    }

    pub(super) fn freed(&mut self, fingerprints: Vec<BlockFingerprint>) {
        self.record(Change::Freed(fingerprints));
    }

    fn record(&mut self, change: Change) {
        if change.len() == 0 {
            return;
        }
        self.fingerprints += change.len();
        self.changes.push_back(change);
        while self.changes.len() > MAX_LOGGED_CHANGES || self.fingerprints > MAX_LOGGED_FINGERPRINTS
        {
            let Some(oldest) = self.changes.pop_front() else { break };
            self.fingerprints -= oldest.len();
            self.first += 1;
        }
        self.watch.moved_to(self.next());
    }

    /// The updates past `cursor`, or `None` when the log no longer reaches back to it.
    pub(super) fn since(&self, cursor: u64) -> Option<Vec<HeldUpdate>> {
        let skip = usize::try_from(cursor.checked_sub(self.first)?).ok()?;
        if skip > self.changes.len() {
            return None;
        }
        let mut updates = Chunker::default();
        for change in self.changes.iter().skip(skip) {
            match change {
                Change::Held(fps) => fps.iter().for_each(|fp| updates.push(*fp, true)),
                Change::Freed(fps) => fps.iter().for_each(|fp| updates.push(*fp, false)),
            }
        }
        Some(updates.finish(false))
    }
}

/// Fills updates up to [`MAX_FINGERPRINTS_PER_UPDATE`] each.
#[derive(Default)]
pub(super) struct Chunker {
    done: Vec<HeldUpdate>,
    current: HeldUpdate,
}

impl Chunker {
    /// A snapshot: its first update resets the reader's view.
    pub(super) fn snapshot() -> Self {
        Self { done: Vec::new(), current: HeldUpdate { reset: true, ..HeldUpdate::default() } }
    }

    pub(super) fn push(&mut self, fingerprint: BlockFingerprint, held: bool) {
        if self.current.held.len() + self.current.freed.len() >= MAX_FINGERPRINTS_PER_UPDATE {
            self.done.push(std::mem::take(&mut self.current));
        }
        if held {
            self.current.held.push(fingerprint);
        } else {
            self.current.freed.push(fingerprint);
        }
    }

    /// The updates; with `synced` the last one says the view is complete.
    pub(super) fn finish(mut self, synced: bool) -> Vec<HeldUpdate> {
        let empty = self.current == HeldUpdate::default();
        if !empty || synced {
            self.current.synced = synced;
            self.done.push(self.current);
        }
        self.done
    }
}

/// A position that threads wait to move past: the book's change log (waking the threads that
/// send its changes), or the count of an engine's lookup answers (waking a worker waiting for
/// any of them).
#[derive(Debug, Default)]
pub struct FeedWatch {
    next: Mutex<u64>,
    moved: Condvar,
}

impl FeedWatch {
    fn moved_to(&self, next: u64) {
        *self.next.lock().unwrap_or_else(PoisonError::into_inner) = next;
        self.moved.notify_all();
    }

    /// Moves one past where it was, waking every waiting thread.
    pub fn advance(&self) {
        *self.next.lock().unwrap_or_else(PoisonError::into_inner) += 1;
        self.moved.notify_all();
    }

    /// Where it is now: read it before looking at what it counts, then wait past it, and no
    /// move in between is missed.
    pub fn position(&self) -> u64 {
        *self.next.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Blocks until it is past `cursor`, `stop` is set (and [`FeedWatch::wake`] called after
    /// it), or `wait` passes (or a spurious wake-up); returns where it is.
    pub fn wait_past(&self, cursor: u64, wait: Duration, stop: &AtomicBool) -> u64 {
        let next = self.next.lock().unwrap_or_else(PoisonError::into_inner);
        // Checked under the lock `wake` takes: a stop set before a wake is never missed.
        if *next > cursor || stop.load(Ordering::Acquire) {
            return *next;
        }
        *self.moved.wait_timeout(next, wait).unwrap_or_else(PoisonError::into_inner).0
    }

    /// Wakes every waiting thread (one of them was told to stop).
    pub fn wake(&self) {
        let _guard = self.next.lock().unwrap_or_else(PoisonError::into_inner);
        self.moved.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_turn_announces_its_first_block_every_strides_last_and_its_last_two() {
        let turn: Vec<u64> = (0..40).collect();
        assert_eq!(announced(&turn, 0), vec![0, 15, 31, 38, 39]);
        assert_eq!(announced(&turn, 21), vec![0, 15, 20, 31, 38, 39], "its prompt's end");
        assert_eq!(announced(&turn, 500), vec![0, 15, 31, 38, 39]);
        assert_eq!(announced(&turn[..16], 16), vec![0, 14, 15]);
        assert_eq!(announced(&turn[..2], 0), vec![0, 1]);
        assert_eq!(announced(&turn[..1], 1), vec![0]);
        assert!(announced(&[], 3).is_empty());
        // Bounded by the turn: a 1M-token turn of 16-token blocks announces about 1 in 16.
        let long: Vec<u64> = (0..65_536).collect();
        assert_eq!(announced(&long, 100).len(), 65_536 / ANNOUNCE_STRIDE + 3);
    }

    #[test]
    fn a_waiter_wakes_at_the_first_move_past_what_it_saw_and_not_before() {
        let never = AtomicBool::new(false);
        let watch = Arc::new(FeedWatch::default());
        // Nothing past 0 yet: the wait runs out.
        assert_eq!(watch.wait_past(0, Duration::from_millis(5), &never), 0);
        watch.advance();
        // A move that came before the wait began is not missed.
        assert_eq!(watch.wait_past(0, Duration::from_secs(10), &never), 1);
        let mover = Arc::clone(&watch);
        let move_later = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            mover.advance();
        });
        let started = std::time::Instant::now();
        assert_eq!(watch.wait_past(1, Duration::from_secs(10), &never), 2);
        let waited = started.elapsed();
        assert!(waited >= Duration::from_millis(20) && waited < Duration::from_secs(10));
        move_later.join().unwrap();
    }

    #[test]
    fn a_cursor_gets_the_changes_past_it_until_the_log_no_longer_reaches_it() {
        let mut log = ChangeLog::default();
        assert_eq!(log.since(0), Some(vec![]));
        log.held(vec![1, 2]);
        log.freed(vec![1]);
        log.held(vec![]);
        assert_eq!(log.next(), 2, "an empty change is not logged");
        let all = log.since(0).unwrap();
        assert_eq!(
            all,
            vec![HeldUpdate { held: vec![1, 2], freed: vec![1], ..Default::default() }]
        );
        assert_eq!(log.since(1).unwrap()[0].held, Vec::<u64>::new());
        assert_eq!(log.since(2), Some(vec![]));
        assert_eq!(log.since(3), None, "a cursor from the future");
        for n in 0..MAX_LOGGED_CHANGES as u64 {
            log.held(vec![n]);
        }
        assert_eq!(log.since(0), None, "fell behind the log");
        assert_eq!(log.since(log.next() - 1).unwrap()[0].held.len(), 1);
        // Fingerprints bound it too.
        log.held(vec![7; MAX_LOGGED_FINGERPRINTS]);
        assert_eq!(log.changes.len(), 1);
        assert_eq!(log.fingerprints, MAX_LOGGED_FINGERPRINTS);
    }

    #[test]
    fn updates_are_cut_at_their_bound_and_a_snapshot_is_framed() {
        let mut chunks = Chunker::snapshot();
        for fp in 0..(MAX_FINGERPRINTS_PER_UPDATE as u64 + 3) {
            chunks.push(fp, true);
        }
        let updates = chunks.finish(true);
        assert_eq!(updates.len(), 2);
        assert!(updates[0].reset && !updates[0].synced);
        assert_eq!(updates[0].held.len(), MAX_FINGERPRINTS_PER_UPDATE);
        assert!(!updates[1].reset && updates[1].synced);
        assert_eq!(updates[1].held, vec![65_536, 65_537, 65_538]);
        // An empty snapshot is one update that resets and syncs.
        assert_eq!(
            Chunker::snapshot().finish(true),
            vec![HeldUpdate { reset: true, synced: true, ..Default::default() }]
        );
    }

    #[test]
    fn the_watch_wakes_waiters_when_the_log_moves() {
        let log = Arc::new(Mutex::new(ChangeLog::default()));
        let watch = Arc::clone(log.lock().unwrap().watch());
        let started = std::time::Instant::now();
        let writer = {
            let log = Arc::clone(&log);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                log.lock().unwrap().held(vec![1]);
            })
        };
        let running = AtomicBool::new(false);
        watch.wait_past(0, Duration::from_secs(30), &running);
        assert!(started.elapsed() < Duration::from_secs(10));
        writer.join().unwrap();
        // Past the cursor already: no wait at all.
        watch.wait_past(0, Duration::from_secs(30), &running);
        assert!(started.elapsed() < Duration::from_secs(10));
        // Told to stop: no wait either, whether the wake came before or during the wait.
        let stop = AtomicBool::new(true);
        watch.wait_past(1, Duration::from_secs(30), &stop);
        let stopping = AtomicBool::new(false);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                stopping.store(true, Ordering::Release);
                watch.wake();
            });
            watch.wait_past(1, Duration::from_secs(30), &stopping);
        });
        assert!(started.elapsed() < Duration::from_secs(10));
    }
}
