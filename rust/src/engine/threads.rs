//! The engine's progress thread (UCX, deadlines, the notifications of batches nobody waits
//! on), and how `close` waits for the reads still outstanding.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::read::settle_all;
use super::{lock, Shared};

/// Background progress: drives UCX (an owner must progress for tcp-emulated reads), enforces
/// deadlines and sends read-done notifications for batches nobody waits on. Between rounds it
/// sleeps on the worker's event fd, so an idle engine costs no CPU and still answers at once.
pub(super) fn progress_loop(shared: Weak<Shared>) {
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

/// How long `close` waits for same-host copies and progresses UCX for reads its aborts did not
/// end, when those write only into memory whose owner the engine holds: past it they keep that
/// owner alive, and close returns without them.
pub(super) const CLOSE_DRAIN: Duration = Duration::from_secs(2);

/// How often `close` says what it still waits for.
const DRAIN_LOG_EVERY: Duration = Duration::from_secs(10);

/// Progresses until no in-flight batch has a read outstanding. Past `deadline` it returns once
/// every batch still outstanding writes only into memory whose owner it holds (which keeps that
/// memory allocated until its reads end); a read into memory registered without its owner,
/// which the caller keeps only until close returns, is waited for however long it takes (a
/// force-closed endpoint's reads end without the peer; a flushed endpoint's read to a frozen
/// peer, or a same-host copy blocked in the kernel, ends when the peer serves it or dies).
pub(super) fn drain_reads(shared: &Shared, deadline: Instant) {
    let mut next_log = deadline;
    loop {
        shared.worker.progress();
        let (mut outstanding, mut unowned) = (0usize, 0usize);
        for inflight in lock(&shared.inflight).iter() {
            let reads = inflight.batch.unfinished_reads();
            outstanding += reads;
            if reads > 0 && !inflight.batch.writes_only_memory_it_keeps() {
                unowned += 1;
            }
        }
        if outstanding == 0 {
            return;
        }
        let now = Instant::now();
        if now >= deadline && unowned == 0 {
            log::error!("closing with {outstanding} reads (UCX or same-host) not completed after {CLOSE_DRAIN:?}: the memory they write into stays registered, and its owner alive, until they end");
            return;
        }
        if now >= next_log {
            log::error!("closing waits for {unowned} batches whose reads ({outstanding} in all) may still write into memory registered without its owner: until their peers serve or fail them");
            next_log = now + DRAIN_LOG_EVERY;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}
