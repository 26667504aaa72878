//! Lookups of held turns: one question fanned out to several owners at once, their answers
//! collected as they come ([`LookupFanOut`]), and the owner's side that answers them from its
//! hold book ([`lookup_handler`]). Owners announce what their lookups can find ([`BookFeed`]);
//! a reader keeps it in its [`HeldIndex`] ([`IndexFeed`]) and asks only the owners that may
//! hold the prompt ([`unasked`]).

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::sync::atomic::AtomicBool;
use std::sync::{mpsc, Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::peer::Peer;
use super::routes::ready_peer;
use super::{lock, Shared};
use crate::held_index::{HeldIndex, OwnerSlot, OwnerState};
use crate::holds::feed::{FeedWatch, HeldUpdate};
use crate::holds::{BlockFingerprint, HoldBook, LookupMatch, LookupReply};
use crate::side_channel::{HeldSink, HeldSource, LookupOutcome};

/// One owner's answer to a lookup: `(owner engine id, its match)`, or why there is none.
#[derive(Clone, Debug)]
pub struct LookupAnswer {
    /// The side channel asked ("host:port").
    pub address: String,
    pub outcome: Result<(String, Option<LookupMatch>), String>,
}

/// How long after its deadline a lookup still takes an owner's reply: the caller reports the
/// lookup at its deadline and keeps polling, to hand back the claim of a reply that came late.
pub const LATE_REPLY_WINDOW: Duration = Duration::from_secs(60);

/// A grant of a hold the owner has not taken yet, or a lookup of a turn it still computes, is
/// asked again after 2 ms, then after twice the previous wait up to 64 ms, until its timeout
/// (an owner takes a hold one engine step after the request ends, and a busy engine's step can
/// take long: its workers were seen without a core for seconds on an overloaded host, where a
/// shorter window missed pulls). The asks wait on the engine's retry thread ([`retry_loop`]).
pub const NOT_YET_FIRST_RETRY: Duration = Duration::from_millis(2);
pub const NOT_YET_MAX_RETRY: Duration = Duration::from_millis(64);

/// What a lookup asks every target.
pub(super) struct LookupQuestion {
    pub(super) fingerprints: Vec<BlockFingerprint>,
    pub(super) request_id: Option<String>,
    /// The end of the prompt handed to a decode node that this lookup's prompt continues.
    pub(super) continues: Option<BlockFingerprint>,
    /// A "not yet" is asked again until then.
    pub(super) retry_until: Instant,
}

/// A lookup sent to several owners at once; answers arrive as the owners reply.
#[derive(Clone)]
pub struct LookupFanOut {
    /// The side channels asked ("host:port"), by target.
    pub(super) addresses: Arc<Vec<String>>,
    question: Arc<LookupQuestion>,
    answers: Arc<Mutex<Vec<Option<LookupAnswer>>>>,
    /// Replies are taken until then; an owner silent past it never answers.
    gives_up_at: Instant,
    /// Targets asked; the others were answered from the index ([`unasked`]).
    asked: usize,
    /// Moved by every answer of every lookup of the engine ([`super::Engine::lookup_answers`]).
    answered: Arc<FeedWatch>,
    /// Where an ask answered "not yet" goes to be asked again ([`retry_loop`]).
    retries: mpsc::Sender<Retry>,
}

impl LookupFanOut {
    pub(super) fn new(
        addresses: Vec<String>,
        question: Arc<LookupQuestion>,
        gives_up_at: Instant,
        asked: usize,
        answered: Arc<FeedWatch>,
        retries: mpsc::Sender<Retry>,
    ) -> Self {
        let answers = Arc::new(Mutex::new(vec![None; addresses.len()]));
        let addresses = Arc::new(addresses);
        Self { addresses, question, answers, gives_up_at, asked, answered, retries }
    }

    /// How many targets were asked: the others could not hold the prompt, by what they
    /// announced, and are answered with no match at once.
    pub fn asked(&self) -> usize {
        self.asked
    }

    /// Answers so far, by target; `None` where the owner may still answer.
    pub fn answers(&self) -> Vec<Option<LookupAnswer>> {
        self.answers_at(Instant::now())
    }

    fn answers_at(&self, now: Instant) -> Vec<Option<LookupAnswer>> {
        let mut answers = lock(&self.answers);
        if now >= self.gives_up_at {
            for (address, answer) in self.addresses.iter().zip(answers.iter_mut()) {
                answer.get_or_insert_with(|| LookupAnswer {
                    address: address.clone(),
                    outcome: Err("the owner did not reply".to_owned()),
                });
            }
        }
        answers.clone()
    }

    /// Target `index`'s answer, unless it has one already.
    pub(super) fn answer(
        &self,
        index: usize,
        outcome: Result<(String, Option<LookupMatch>), String>,
    ) {
        let mut answers = lock(&self.answers);
        if answers[index].is_none() {
            answers[index] = Some(LookupAnswer { address: self.addresses[index].clone(), outcome });
            drop(answers);
            self.answered.advance();
        }
    }

    /// Sends the lookup to `peer`, target `index`, without waiting for its reply; a "not yet"
    /// is asked again after `retry` (see [`NOT_YET_FIRST_RETRY`]) until `retry_until`, from
    /// the engine's retry thread: the link's thread, which takes the reply, also reads the
    /// owner's other replies and keeps the link's heartbeats, and never waits.
    pub(super) fn ask(&self, index: usize, peer: &Arc<Peer>, retry: Duration) {
        let (fan_out, again) = (self.clone(), Arc::downgrade(peer));
        let owner = peer.meta.engine_id.clone();
        let on_reply = Box::new(move |outcome: LookupOutcome| match outcome {
            Ok(reply) if reply.not_yet && Instant::now() + retry < fan_out.question.retry_until => {
                let retries = fan_out.retries.clone();
                let (due, closed) = (Instant::now() + retry, fan_out.clone());
                let ask = Box::new(move || match again.upgrade() {
                    Some(peer) => fan_out.ask(index, &peer, (retry * 2).min(NOT_YET_MAX_RETRY)),
                    None => fan_out.answer(index, Err("the owner went away".to_owned())),
                });
                if retries.send(Retry { due, ask }).is_err() {
                    closed.answer(index, Err("the engine closed".to_owned()));
                }
            }
            outcome => fan_out.answer(
                index,
                outcome.map(|reply| (owner, reply.found)).map_err(|e| e.to_string()),
            ),
        });
        let question = &self.question;
        let timeout = self.gives_up_at.saturating_duration_since(Instant::now());
        peer.link.send_lookup(
            question.fingerprints.clone(),
            question.request_id.clone(),
            question.continues,
            timeout,
            on_reply,
        );
    }
}

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

/// Answers side-channel lookups and grants from the hold book, claiming what matches for
/// the asking engine.
pub(super) fn lookup_handler(
    holds: Weak<Mutex<HoldBook>>,
    claim: Duration,
) -> crate::side_channel::LookupHandler {
    Arc::new(move |reader, request| {
        let Some(holds) = holds.upgrade() else {
            return LookupReply { id: request.id, found: None, not_yet: false };
        };
        let asked = request.fingerprints.len();
        match &request.request_id {
            Some(name) if name.len() > crate::holds::MAX_REQUEST_ID_BYTES => {
                log::warn!("grant refused to {reader}: a request id of {} bytes", name.len());
                LookupReply { id: request.id, found: None, not_yet: false }
            }
            Some(name) => {
                // The book's lock ends with this statement: logging (through Python) never
                // holds it.
                let granted =
                    lock(&holds).grant(reader, name, &request.fingerprints, claim, Instant::now());
                match granted {
                    Ok(m) => {
                        log::debug!(
                            "granted {reader} {} of {asked} blocks of request {name} (claim {})",
                            m.matched_blocks,
                            m.claim_id
                        );
                        LookupReply { id: request.id, found: Some(m), not_yet: false }
                    }
                    Err(refusal) => {
                        let not_yet = refusal == crate::holds::Refusal::NotHeldYet;
                        if not_yet {
                            log::debug!("grant of request {name} to {reader}: not held (yet)");
                        } else {
                            log::info!(
                                "grant of request {name}'s blocks refused to {reader}: {refusal}"
                            );
                        }
                        LookupReply { id: request.id, found: None, not_yet }
                    }
                }
            }
            None => {
                let mut book = lock(&holds);
                if book.awaited(&request.fingerprints, request.continues) {
                    drop(book);
                    log::debug!("lookup from {reader}: the turn it continues is not held yet");
                    return LookupReply { id: request.id, found: None, not_yet: true };
                }
                let found = book.lookup(reader, &request.fingerprints, claim, Instant::now());
                drop(book);
                match &found {
                    Some(m) => log::debug!(
                        "lookup from {reader}: {} of {asked} blocks held by request {} (claim {})",
                        m.matched_blocks,
                        m.owner_request_id,
                        m.claim_id
                    ),
                    None => log::debug!("lookup from {reader}: none of {asked} blocks held"),
                }
                LookupReply { id: request.id, found, not_yet: false }
            }
        }
    })
}

/// The owners a lookup asks whatever they announced.
pub(super) enum MustAsk {
    All,
    /// The owners with these engine ids; every owner when there are some and none of them
    /// is a connected target.
    Engines(Vec<String>),
}

/// The targets a lookup need not ask, each with its owner's engine id: those
/// [`HeldIndex::narrow`] passes over (synced owners that announced none of the prompt's
/// longest announced prefix, while another announced it), that have a live connection to
/// answer for and that `must_ask` does not name.
pub(super) fn unasked(
    shared: &Shared,
    addresses: &[String],
    fingerprints: &[BlockFingerprint],
    must_ask: MustAsk,
) -> Vec<Option<String>> {
    let MustAsk::Engines(engines) = must_ask else {
        return vec![None; addresses.len()];
    };
    let owner =
        |address: &String| ready_peer(shared, address).map(|peer| peer.meta.engine_id.clone());
    // Only a lookup that names engines looks at every target's owner up front (once).
    let owners: Option<Vec<Option<String>>> =
        (!engines.is_empty()).then(|| addresses.iter().map(owner).collect());
    let must: Vec<bool> = owners
        .iter()
        .flatten()
        .map(|id| id.as_ref().is_some_and(|id| engines.contains(id)))
        .collect();
    if owners.is_some() && !must.contains(&true) {
        // Handed to engines this lookup cannot tell among its targets: ask them all.
        return vec![None; addresses.len()];
    }
    let ask = lock(&shared.held_index).narrow(addresses, fingerprints, &must);
    match owners {
        Some(owners) => {
            owners.into_iter().zip(ask).map(|(id, ask)| if ask { None } else { id }).collect()
        }
        None => addresses
            .iter()
            .zip(ask)
            .map(|(address, ask)| if ask { None } else { owner(address) })
            .collect(),
    }
}

/// Announces an engine's hold book to the readers connected to its side channel.
pub(super) struct BookFeed {
    holds: Weak<Mutex<HoldBook>>,
    watch: Arc<FeedWatch>,
}

impl BookFeed {
    pub(super) fn new(holds: &Arc<Mutex<HoldBook>>) -> Self {
        Self { watch: lock(holds).feed_watch(), holds: Arc::downgrade(holds) }
    }
}

impl HeldSource for BookFeed {
    fn updates_since(&self, cursor: Option<u64>) -> (u64, Vec<HeldUpdate>) {
        match self.holds.upgrade() {
            Some(holds) => lock(&holds).held_since(cursor),
            None => (cursor.unwrap_or(0), Vec::new()),
        }
    }

    fn wait_past(&self, cursor: u64, wait: Duration, stop: &AtomicBool) {
        self.watch.wait_past(cursor, wait, stop);
    }

    fn wake(&self) {
        self.watch.wake();
    }
}

/// One link's announcements, fed into the engine's index; forgotten when dropped (the link
/// ended, or its handshake failed before it began).
pub(super) struct IndexFeed {
    index: Arc<Mutex<HeldIndex>>,
    slot: OwnerSlot,
    address: String,
}

impl IndexFeed {
    /// The index's entry for a new connection to the owner at `address`.
    pub(super) fn open(index: &Arc<Mutex<HeldIndex>>, address: &str) -> Self {
        let slot = lock(index).open(address);
        Self { index: Arc::clone(index), slot, address: address.to_owned() }
    }

    pub(super) fn into_sink(self) -> HeldSink {
        Box::new(move |update| {
            let (overflowed, state) = {
                let mut index = lock(&self.index);
                (index.apply(self.slot, &update), index.state(&self.address))
            };
            if overflowed {
                log::warn!(
                    "the owner at {} announced more than the index keeps of one owner ({} \
                     fingerprints): it is asked on every lookup until it reconnects",
                    self.address,
                    crate::held_index::MAX_ENTRIES_PER_OWNER
                );
            } else if update.synced && state == Some(OwnerState::Synced) {
                log::debug!("the owner at {} announced all it holds", self.address);
            }
        })
    }
}

impl Drop for IndexFeed {
    fn drop(&mut self) {
        lock(&self.index).close(self.slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fan_out_takes_each_targets_first_answer_and_gives_up_on_the_silent_at_its_time() {
        let t0 = Instant::now();
        let gives_up_at = t0 + Duration::from_secs(10);
        let question = Arc::new(LookupQuestion {
            fingerprints: vec![1],
            request_id: None,
            continues: None,
            retry_until: t0,
        });
        let answered = Arc::new(FeedWatch::default());
        let fan_out = LookupFanOut::new(
            vec!["a:1".to_owned(), "b:2".to_owned()],
            question,
            gives_up_at,
            2,
            Arc::clone(&answered),
            mpsc::channel().0,
        );
        assert!(fan_out.answers_at(t0).iter().all(Option::is_none));
        fan_out.answer(0, Ok(("A".to_owned(), None)));
        // A later outcome for the same target (e.g. the link dying afterwards) changes nothing,
        // and rings no one.
        fan_out.answer(0, Err("gone".to_owned()));
        assert_eq!(answered.position(), 1);
        let answers = fan_out.answers_at(gives_up_at - Duration::from_millis(1));
        let first = answers[0].as_ref().unwrap();
        assert_eq!(
            (first.address.as_str(), first.outcome.as_ref().unwrap().0.as_str()),
            ("a:1", "A")
        );
        assert!(answers[1].is_none());
        let answers = fan_out.answers_at(gives_up_at);
        assert!(answers[0].as_ref().unwrap().outcome.is_ok());
        let silent = answers[1].as_ref().unwrap();
        assert_eq!(
            (silent.address.as_str(), silent.outcome.as_ref().unwrap_err().as_str()),
            ("b:2", "the owner did not reply")
        );
    }

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
