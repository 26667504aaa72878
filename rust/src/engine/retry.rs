//! The engine's retry thread: asks made again when they are due (a lookup an owner answered
//! "not yet", a connection whose backoff has passed), earliest first, without a thread each.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::sync::mpsc;
use std::time::Instant;

/// An ask to make again when it is due (an owner answered "not yet").
pub(super) struct Retry {
    pub(super) due: Instant,
    pub(super) ask: Box<dyn FnOnce() + Send>,
}

/// A [`Retry`] in the queue, earliest (then first queued) first.
struct Queued(Retry, u64);

impl PartialEq for Queued {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Queued {}

impl PartialOrd for Queued {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Queued {
    fn cmp(&self, other: &Self) -> Ordering {
        // `BinaryHeap` pops the greatest: the earliest due is the greatest.
        (other.0.due, other.1).cmp(&(self.0.due, self.1))
    }
}

/// The engine's retry thread: makes each queued ask when it is due, in order, until `stopped`
/// (checked at every wake-up: the engine's close sends a no-op [`Retry`] to wake it, and what
/// is queued is then dropped, no owner asked again) or every sender is gone and nothing is
/// queued. It sleeps while nothing is queued.
pub(super) fn retry_loop(queue: &mpsc::Receiver<Retry>, stopped: impl Fn() -> bool) {
    let mut queued: BinaryHeap<Queued> = BinaryHeap::new();
    let mut next_seq = 0u64;
    let mut senders_gone = false;
    loop {
        if stopped() {
            return;
        }
        let now = Instant::now();
        while queued.peek().is_some_and(|next| next.0.due <= now) {
            if let Some(Queued(retry, _)) = queued.pop() {
                (retry.ask)();
            }
        }
        let wait = queued.peek().map(|next| next.0.due.saturating_duration_since(now));
        let received = match (wait, senders_gone) {
            (None, true) => return,
            (Some(wait), true) => {
                std::thread::sleep(wait);
                continue;
            }
            (None, false) => queue.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
            (Some(wait), false) => queue.recv_timeout(wait),
        };
        match received {
            Ok(retry) => {
                queued.push(Queued(retry, next_seq));
                next_seq += 1;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => senders_gone = true,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_retry_thread_asks_again_in_due_order_and_ends_with_its_senders() {
        let (retries, queue) = mpsc::channel();
        let thread = std::thread::spawn(move || retry_loop(&queue, || false));
        let (done, asked) = mpsc::channel();
        let t0 = Instant::now();
        for (name, after_ms) in [("late", 60), ("early", 20), ("early-too", 20)] {
            let done = done.clone();
            let ask = Box::new(move || {
                let _ = done.send((name, Instant::now()));
            });
            let due = t0 + Duration::from_millis(after_ms);
            retries.send(Retry { due, ask }).unwrap();
        }
        drop(retries);
        let order: Vec<(&str, Instant)> = (0..3).map(|_| asked.recv().unwrap()).collect();
        let names: Vec<&str> = order.iter().map(|(name, _)| *name).collect();
        assert_eq!(names, ["early", "early-too", "late"]);
        assert!(order[2].1 >= t0 + Duration::from_millis(60), "not before it was due");
        // Every sender gone and nothing queued: the thread ends.
        thread.join().unwrap();
    }

    #[test]
    fn the_retry_thread_ends_when_its_engine_closes_and_asks_nothing_more() {
        let (retries, queue) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            retry_loop(&queue, || stopped.load(std::sync::atomic::Ordering::Acquire))
        });
        let (done, asked) = mpsc::channel::<()>();
        let due = Instant::now() + Duration::from_millis(300);
        let ask = Box::new(move || done.send(()).unwrap());
        retries.send(Retry { due, ask }).unwrap();
        stop.store(true, std::sync::atomic::Ordering::Release);
        // Woken as the engine's close wakes it, it ends though a sender lives and an ask is
        // queued.
        retries.send(Retry { due: Instant::now(), ask: Box::new(|| ()) }).unwrap();
        thread.join().unwrap();
        assert!(asked.recv().is_err(), "the queued ask was dropped, never made");
        drop(retries);
    }
}
