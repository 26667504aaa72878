//! The engine's own threads: progress (UCX, deadlines, the notifications of batches nobody
//! waits on) and the notifier, which writes notifications to the owners' links; and how
//! `close` waits for the reads still outstanding.

use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Weak};
use std::time::{Duration, Instant};

use super::read::{settle_all, Outgoing};
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

/// The notifier thread: writes queued notifications to their peers' side-channel links, in
/// order, until the engine closes. A peer whose socket does not take the write within the
/// side channel's write timeout loses its link (and is reconnected by the next `connect`).
pub(super) fn send_notifications(queue: &mpsc::Receiver<Outgoing>) {
    for Outgoing { peer, payload } in queue {
        if let Err(e) = peer.link.notify(&payload) {
            log::warn!("read done but notifying peer {} failed: {e}", peer.meta.engine_id);
        }
    }
}

/// How long `close` waits for same-host copies and progresses UCX for reads its aborts did not
/// cancel; past it the batches of those reads keep the memory they target registered, and
/// close returns without them.
pub(super) const CLOSE_DRAIN: Duration = Duration::from_secs(2);

/// Progresses until no in-flight batch has a read outstanding, or `deadline` passes (logged).
pub(super) fn drain_reads(shared: &Shared, deadline: Instant) {
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
