//! One peer connection's transport and the batches posted on it, owned under one lock: the one
//! owner of whether the connection is open. Posting and closing both take that lock, so a
//! batch is either tracked before the connection closes (and failed by that close) or refused
//! by it; there is no window in which a batch is posted and then missed.
//!
//! Time is passed in ([`Connection::expire`]) and the transport is a parameter, so the rules
//! are tested without sockets or UCX (the tests below race posts against closes); the engine's
//! transport is a peer's UCX endpoint and same-host copy queue (`peer.rs`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use super::lock;

/// What a connection needs of a batch it tracks.
pub(super) trait Tracked {
    fn deadline(&self) -> Instant;
    /// Its outcome is final: nothing of it is outstanding any more.
    fn settled(&self) -> bool;
    /// Failing it alone stops its reads (a same-host copy stops at its next call); otherwise
    /// only cancelling the whole transport does (UCX reads on an endpoint).
    fn fails_alone(&self) -> bool;
    /// Fails it for `reason`; it settles once none of its reads is outstanding.
    fn fail(&self, reason: &str);
    /// It was failed (it may still have reads outstanding).
    fn failed(&self) -> bool;
}

/// A connection's means of reading: cancelled once, when the connection closes.
pub(super) trait Transport {
    /// Cancels every read posted on it; each of their batches settles once UCX (or the copy)
    /// has released its last read.
    fn cancel(self);
}

/// Why a batch could not be started, and whether some of its reads may be in flight anyway.
pub(super) enum PostError {
    NothingPosted(String),
    /// A post failed after earlier reads of the batch were posted: they may still write.
    MaybePartial(String),
}

pub(super) struct Connection<T, B> {
    state: Mutex<State<T, B>>,
    /// Mirrors `state.transport.is_some()`, written under the lock, read without it by those
    /// that only route (is this connection still the one to use).
    open: AtomicBool,
}

struct State<T, B> {
    /// `None` once closed.
    transport: Option<T>,
    /// Why it closed.
    closed_for: String,
    /// Batches started on it, those that settled swept out now and then (`post`).
    batches: Vec<B>,
    /// How many `batches` held after the last sweep: the next comes once it doubled, so
    /// posting costs O(1) a batch however many are in flight.
    swept_to: usize,
}

impl<T: Transport, B: Tracked> Connection<T, B> {
    pub(super) fn new(transport: T) -> Self {
        let state = State {
            transport: Some(transport),
            closed_for: String::new(),
            batches: vec![],
            swept_to: 0,
        };
        Self { state: Mutex::new(state), open: AtomicBool::new(true) }
    }

    pub(super) fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    /// Starts `batch` with `start` and tracks it, under the lock [`Connection::close`] takes.
    /// A closed connection refuses it, and a start that fails fails it (one that may have left
    /// reads in flight closes the connection, which cancels them). Returns whether the
    /// connection closed here.
    pub(super) fn post(
        &self,
        batch: B,
        start: impl FnOnce(&mut T) -> Result<(), PostError>,
    ) -> bool {
        let mut state = lock(&self.state);
        let Some(transport) = state.transport.as_mut() else {
            batch.fail(&format!("the connection closed: {}", state.closed_for));
            return false;
        };
        let started = start(transport);
        if state.batches.len() >= 2 * state.swept_to.max(32) {
            state.batches.retain(|b| !b.settled());
            state.swept_to = state.batches.len();
        }
        match started {
            Ok(()) => {
                state.batches.push(batch);
                false
            }
            Err(PostError::NothingPosted(e)) => {
                batch.fail(&e);
                false
            }
            Err(PostError::MaybePartial(e)) => {
                state.batches.push(batch);
                self.close_locked(state, &format!("posting a read failed: {e}"));
                true
            }
        }
    }

    /// Closes the connection: no batch starts on it any more, every batch started on it is
    /// failed and its transport cancelled. Returns false if it was closed already.
    pub(super) fn close(&self, reason: &str) -> bool {
        let state = lock(&self.state);
        if state.transport.is_none() {
            return false;
        }
        self.close_locked(state, reason);
        true
    }

    /// Fails those of `due`, batches started on this connection, that passed their deadline by
    /// `now` unsettled: alone where that stops its reads, else by closing the connection (the
    /// one way to stop reads on a UCX endpoint: cancelling them, which fails every batch on
    /// it). `reason` says why, by batch. Returns how many batches it failed alone and whether
    /// it closed.
    pub(super) fn expire(
        &self,
        due: &[B],
        now: Instant,
        reason: impl Fn(&B) -> String,
    ) -> (usize, bool) {
        let state = lock(&self.state);
        let (mut failed_alone, mut close_for) = (0, None);
        for batch in due.iter().filter(|b| !b.settled() && now >= b.deadline()) {
            if batch.fails_alone() {
                // Once: its copy stops at its next call, and settles it then.
                if !batch.failed() {
                    batch.fail(&reason(batch));
                    failed_alone += 1;
                }
            } else {
                close_for.get_or_insert_with(|| reason(batch));
            }
        }
        match close_for {
            Some(why) if state.transport.is_some() => {
                self.close_locked(state, &why);
                (failed_alone, true)
            }
            _ => (failed_alone, false),
        }
    }

    /// Fails every batch first (so each records why before its reads come back cancelled),
    /// then cancels the transport; the lock is released before the cancel, which may wait
    /// for UCX, and no post can reach the taken transport.
    fn close_locked(&self, mut state: std::sync::MutexGuard<'_, State<T, B>>, reason: &str) {
        let Some(transport) = state.transport.take() else { return };
        self.open.store(false, Ordering::Release);
        state.closed_for = reason.to_owned();
        let batches = std::mem::take(&mut state.batches);
        drop(state);
        for batch in &batches {
            batch.fail(reason);
        }
        transport.cancel();
    }
}

/// A batch's result as its caller sees it: what its reads came to, but a failure for one that
/// settled after `deadline`. The owner holds the blocks until the deadline only, so a byte
/// that arrived later may be of reused blocks, and the batch must not count as read.
pub(super) fn verdict(
    outcome: Result<(), String>,
    settled_at: Instant,
    deadline: Instant,
) -> Result<(), String> {
    match outcome {
        Ok(()) if settled_at > deadline => {
            Err("the deadline passed before the last byte arrived".to_owned())
        }
        outcome => outcome,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Barrier};
    use std::time::Duration;

    /// A batch of one read, as the engine's: failed reads settle when nothing of them is
    /// outstanding, and a batch failed while its read is out settles when the read comes back.
    #[derive(Default)]
    struct Batch {
        state: Mutex<BatchState>,
        deadline: Option<Instant>,
        alone: bool,
    }

    #[derive(Default)]
    struct BatchState {
        outstanding: bool,
        failed: Option<String>,
        settled: Option<(Result<(), String>, Instant)>,
    }

    impl Batch {
        fn new(deadline: Instant, alone: bool) -> Arc<Batch> {
            Arc::new(Batch { deadline: Some(deadline), alone, ..Batch::default() })
        }

        /// Its read came back, done or cancelled.
        fn read_ended(&self, cancelled: bool, now: Instant) {
            let mut s = lock(&self.state);
            if !std::mem::take(&mut s.outstanding) {
                return;
            }
            if cancelled {
                s.failed.get_or_insert_with(|| "cancelled".to_owned());
            }
            let outcome = s.failed.clone().map_or(Ok(()), Err);
            s.settled.get_or_insert((outcome, now));
        }

        fn verdict(&self) -> Option<Result<(), String>> {
            let s = lock(&self.state);
            s.settled.clone().map(|(outcome, at)| verdict(outcome, at, self.deadline.unwrap()))
        }
    }

    impl Tracked for Arc<Batch> {
        fn deadline(&self) -> Instant {
            self.deadline.unwrap()
        }
        fn settled(&self) -> bool {
            lock(&self.state).settled.is_some()
        }
        fn fails_alone(&self) -> bool {
            self.alone
        }
        fn fail(&self, reason: &str) {
            let mut s = lock(&self.state);
            s.failed.get_or_insert_with(|| reason.to_owned());
            if !s.outstanding {
                let failed = Err(s.failed.clone().unwrap());
                s.settled.get_or_insert((failed, Instant::now()));
            }
        }
        fn failed(&self) -> bool {
            lock(&self.state).failed.is_some()
        }
    }

    /// Reads in flight on a transport. Cancelling a `force` one ends them as cancelled, as
    /// force-closing a UCX endpoint with peer error handling does; cancelling another does
    /// nothing, as closing an endpoint without it does to a read that a frozen peer has not
    /// served: the read stays out, and its batch settles only when it comes back.
    #[derive(Default, Clone)]
    struct Reads {
        out: Arc<Mutex<Vec<Arc<Batch>>>>,
        force: bool,
    }

    impl Transport for Reads {
        fn cancel(self) {
            if self.force {
                for batch in lock(&self.out).drain(..) {
                    batch.read_ended(true, Instant::now());
                }
            }
        }
    }

    impl Reads {
        fn force() -> Reads {
            Reads { force: true, ..Reads::default() }
        }

        fn start(&self, batch: &Arc<Batch>) {
            lock(&batch.state).outstanding = true;
            lock(&self.out).push(Arc::clone(batch));
        }
    }

    #[test]
    fn a_closed_connection_refuses_batches_and_close_fails_those_it_tracks() {
        let t0 = Instant::now();
        let conn = Connection::new(Reads::force());
        let first = Batch::new(t0 + Duration::from_secs(1), false);
        assert!(!conn.post(Arc::clone(&first), |r| {
            r.start(&first);
            Ok(())
        }));
        assert!(conn.close("peer gone"));
        assert!(!conn.is_open() && !conn.close("again"));
        assert_eq!(first.verdict(), Some(Err("peer gone".to_owned())));
        let late = Batch::new(t0 + Duration::from_secs(1), false);
        let mut started = false;
        conn.post(Arc::clone(&late), |_| {
            started = true;
            Ok(())
        });
        assert!(!started, "nothing starts on a closed connection");
        assert_eq!(late.verdict(), Some(Err("the connection closed: peer gone".to_owned())));
    }

    #[test]
    fn a_partial_post_closes_the_connection_and_a_failed_start_fails_only_its_batch() {
        let t0 = Instant::now();
        let conn = Connection::new(Reads::force());
        let other = Batch::new(t0 + Duration::from_secs(1), false);
        conn.post(Arc::clone(&other), |r| {
            r.start(&other);
            Ok(())
        });
        let refused = Batch::new(t0 + Duration::from_secs(1), false);
        conn.post(Arc::clone(&refused), |_| Err(PostError::NothingPosted("bad".to_owned())));
        assert_eq!(refused.verdict(), Some(Err("bad".to_owned())));
        assert!(conn.is_open() && other.verdict().is_none());
        let partial = Batch::new(t0 + Duration::from_secs(1), false);
        assert!(conn.post(Arc::clone(&partial), |r| {
            r.start(&partial);
            Err(PostError::MaybePartial("out of memory".to_owned()))
        }));
        assert!(!conn.is_open());
        for batch in [&other, &partial] {
            assert_eq!(
                batch.verdict(),
                Some(Err("posting a read failed: out of memory".to_owned()))
            );
        }
    }

    #[test]
    fn expiry_fails_a_same_host_batch_alone_and_closes_for_a_ucx_one() {
        let t0 = Instant::now();
        let conn = Connection::new(Reads::force());
        let copy = Batch::new(t0 + Duration::from_millis(10), true);
        let copying = Batch::new(t0 + Duration::from_millis(10), true);
        let ucx = Batch::new(t0 + Duration::from_millis(20), false);
        for batch in [&copy, &ucx, &copying] {
            conn.post(Arc::clone(batch), |r| {
                if !batch.alone {
                    r.start(batch);
                }
                Ok(())
            });
        }
        // A copy under way: failed at its deadline, settled only once the copy stops.
        lock(&copying.state).outstanding = true;
        let why = |_: &Arc<Batch>| "deadline".to_owned();
        let all = [copy.clone(), ucx.clone(), copying.clone()];
        let expire = |ms| conn.expire(&all, t0 + Duration::from_millis(ms), why);
        assert_eq!(expire(5), (0, false));
        assert_eq!(expire(10), (2, false));
        assert_eq!(copy.verdict(), Some(Err("deadline".to_owned())));
        assert_eq!(copying.verdict(), None, "settles when its copy stops");
        assert_eq!(expire(11), (0, false), "failed once");
        assert!(conn.is_open() && ucx.verdict().is_none());
        assert_eq!(expire(20), (0, true));
        assert_eq!(ucx.verdict(), Some(Err("deadline".to_owned())));
    }

    #[test]
    fn settled_batches_are_swept_in_bulk_and_one_still_out_is_kept_among_many() {
        let t0 = Instant::now();
        let reads = Reads::force();
        let conn = Connection::new(reads.clone());
        let batches: Vec<_> =
            (0..1024).map(|_| Batch::new(t0 + Duration::from_secs(1), false)).collect();
        for batch in &batches {
            conn.post(Arc::clone(batch), |r| {
                r.start(batch);
                Ok(())
            });
        }
        for (i, batch) in batches.iter().enumerate() {
            if i != 500 {
                batch.read_ended(false, t0);
            }
        }
        for _ in 0..1024 {
            let batch = Batch::new(t0 + Duration::from_secs(1), false);
            conn.post(Arc::clone(&batch), |r| {
                r.start(&batch);
                Ok(())
            });
            batch.read_ended(false, t0);
        }
        let tracked = lock(&conn.state).batches.len();
        assert!(tracked < 1024, "settled batches swept: {tracked} tracked");
        assert!(batches[500].verdict().is_none());
        conn.close("peer gone");
        assert_eq!(batches[500].verdict(), Some(Err("peer gone".to_owned())));
        assert_eq!(batches[499].verdict(), Some(Ok(())));
    }

    #[test]
    fn a_batch_that_settles_after_its_deadline_fails() {
        let t0 = Instant::now();
        let deadline = t0 + Duration::from_millis(10);
        assert_eq!(verdict(Ok(()), deadline, deadline), Ok(()));
        assert!(verdict(Ok(()), deadline + Duration::from_nanos(1), deadline).is_err());
        assert_eq!(verdict(Err("x".to_owned()), t0, deadline), Err("x".to_owned()));
    }

    /// Posts race closes (a peer's death, a deadline) on 100,000 connections. When a close
    /// returns, every batch started on its connection is failed or read: a batch it missed
    /// would wait for its read, and, with a peer that serves the read late, count as read after
    /// its deadline. Then every read still out comes back (the peer wakes up, after every
    /// deadline): none of those batches counts as read.
    #[test]
    fn posts_racing_closes_leave_no_batch_past_its_deadline() {
        const ITERATIONS: usize = 100_000;
        const POSTERS: usize = 2;
        type Conn = Connection<Reads, Arc<Batch>>;
        type Current = Arc<Mutex<Option<(Arc<Conn>, Reads)>>>;
        let barrier = Arc::new(Barrier::new(POSTERS + 2));
        let current: Current = Arc::default();
        let batches: Arc<Mutex<Vec<Arc<Batch>>>> = Arc::default();
        let mut threads = Vec::new();
        for poster in 0..POSTERS {
            let (barrier, current, batches) =
                (Arc::clone(&barrier), Arc::clone(&current), Arc::clone(&batches));
            threads.push(std::thread::spawn(move || {
                for i in 0..ITERATIONS {
                    barrier.wait();
                    let (conn, _) = lock(&current).clone().unwrap();
                    let batch = Batch::new(Instant::now() + Duration::from_millis(1), false);
                    conn.post(Arc::clone(&batch), |r| {
                        r.start(&batch);
                        Ok(())
                    });
                    // Every other read completes at once, maybe before its connection closes.
                    if (i + poster) % 2 == 0 {
                        batch.read_ended(false, Instant::now());
                    }
                    lock(&batches).push(batch);
                    barrier.wait();
                }
            }));
        }
        {
            let (barrier, current) = (Arc::clone(&barrier), Arc::clone(&current));
            threads.push(std::thread::spawn(move || {
                for i in 0..ITERATIONS {
                    barrier.wait();
                    let (conn, reads) = lock(&current).clone().unwrap();
                    if i % 3 == 0 {
                        conn.close("peer gone");
                    } else {
                        // As the progress thread's expiry does, some deadlines not passed yet.
                        let now = Instant::now() + Duration::from_micros(i as u64 % 1500);
                        let started = lock(&reads.out).clone();
                        conn.expire(&started, now, |_| "deadline".to_owned());
                        conn.close("engine closed");
                    }
                    barrier.wait();
                }
            }));
        }
        let mut missed = 0;
        let mut late = Vec::new();
        for _ in 0..ITERATIONS {
            let reads = Reads::default();
            *lock(&current) = Some((Arc::new(Connection::new(reads.clone())), reads.clone()));
            barrier.wait();
            barrier.wait();
            for batch in lock(&reads.out).drain(..) {
                let s = lock(&batch.state);
                let outstanding = s.outstanding;
                missed += usize::from(outstanding && s.failed.is_none());
                drop(s);
                if outstanding {
                    late.push(batch);
                }
            }
        }
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(missed, 0, "batches started on a connection that closed without failing them");
        std::thread::sleep(Duration::from_millis(2));
        for batch in &late {
            batch.read_ended(false, Instant::now());
        }
        let batches = lock(&batches);
        assert_eq!(batches.len(), ITERATIONS * POSTERS);
        let (mut read, mut failed) = (0, 0);
        for batch in batches.iter() {
            match batch.verdict() {
                None => panic!("a batch never settled"),
                Some(Ok(())) => read += 1,
                Some(Err(_)) => failed += 1,
            }
        }
        eprintln!("{read} batches read, {failed} failed");
        assert!(read > 0 && failed > 0, "both outcomes happen: {read} read, {failed} failed");
        for batch in &late {
            let s = lock(&batch.state);
            let (outcome, at) = s.settled.clone().unwrap();
            assert!(
                verdict(outcome, at, batch.deadline.unwrap()).is_err(),
                "a batch read after its deadline counts as read"
            );
        }
    }
}
