//! Lookups of held turns: one question fanned out to several owners at once, their answers
//! collected as they come ([`LookupFanOut`]), and the owner's side that answers them from its
//! hold book ([`lookup_handler`]). Owners announce what their lookups can find ([`BookFeed`]);
//! a reader keeps it in its [`HeldIndex`] ([`IndexFeed`]) and asks only the owners that may
//! hold the prompt ([`unasked`]).

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::peer::{ready_peer, Peer};
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

/// A grant of a hold the owner has not taken yet is asked again after 2 ms, then after twice
/// the previous wait up to 64 ms, until the grant's timeout (an owner takes a hold one engine
/// step after answering its request, and a busy engine's step can take long: its workers were
/// seen without a core for seconds on an overloaded host, where a shorter window missed pulls).
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
}

impl LookupFanOut {
    pub(super) fn new(
        addresses: Vec<String>,
        question: Arc<LookupQuestion>,
        gives_up_at: Instant,
        asked: usize,
        answered: Arc<FeedWatch>,
    ) -> Self {
        let answers = Arc::new(Mutex::new(vec![None; addresses.len()]));
        Self { addresses: Arc::new(addresses), question, answers, gives_up_at, asked, answered }
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
    /// is asked again (from the link's thread, after `retry`, see [`NOT_YET_FIRST_RETRY`])
    /// until `retry_until`.
    pub(super) fn ask(&self, index: usize, peer: &Arc<Peer>, retry: Duration) {
        let (fan_out, again) = (self.clone(), Arc::downgrade(peer));
        let owner = peer.meta.engine_id.clone();
        let on_reply = Box::new(move |outcome: LookupOutcome| match outcome {
            Ok(reply) if reply.not_yet && Instant::now() + retry < fan_out.question.retry_until => {
                std::thread::sleep(retry);
                match again.upgrade() {
                    Some(peer) => fan_out.ask(index, &peer, (retry * 2).min(NOT_YET_MAX_RETRY)),
                    None => fan_out.answer(index, Err("the owner went away".to_owned())),
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

/// The targets a lookup need not ask, each with its owner's engine id: without a named hold,
/// those [`HeldIndex::narrow`] passes over (synced owners that announced none of the prompt's
/// longest announced prefix, while another announced it), and that have a live connection to
/// answer for. With `ask_all` (a named hold, or a prompt continuing a handoff) all are asked.
pub(super) fn unasked(
    shared: &Shared,
    addresses: &[String],
    fingerprints: &[BlockFingerprint],
    ask_all: bool,
) -> Vec<Option<String>> {
    if ask_all {
        return vec![None; addresses.len()];
    }
    let ask = lock(&shared.held_index).narrow(addresses, fingerprints);
    addresses
        .iter()
        .zip(ask)
        .map(|(address, ask)| {
            if ask {
                return None;
            }
            ready_peer(shared, address).map(|peer| peer.meta.engine_id.clone())
        })
        .collect()
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
}
