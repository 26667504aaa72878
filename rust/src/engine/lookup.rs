//! Lookups of held turns: one question fanned out to several owners at once, their answers
//! collected as they come ([`LookupFanOut`]), and the owner's side that answers them from its
//! hold book ([`lookup_handler`]). A reader asks only the owners that may hold the prompt, by
//! what they announced ([`unasked`]; the announcements: `feeds.rs`).

use std::sync::{mpsc, Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::connect::connect_then;
use super::peer::Peer;
use super::retry::Retry;
use super::routes::ready_peer;
use super::{lock, Engine, Shared};
use crate::clock::deadline_after;
use crate::held_index::AnnouncedChanges;
use crate::holds::feed::FeedWatch;
use crate::holds::{BlockFingerprint, HoldBook, LookupMatch, LookupReply};
use crate::side_channel::LookupOutcome;

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
/// shorter window missed pulls). The asks wait on the engine's retry thread (`retry.rs`).
pub const NOT_YET_FIRST_RETRY: Duration = Duration::from_millis(2);
pub const NOT_YET_MAX_RETRY: Duration = Duration::from_millis(64);

impl Engine {
    /// Moved by every answer to this engine's lookups: a caller waiting on several at once
    /// wakes as soon as one is answered.
    pub fn lookup_answers(&self) -> Arc<FeedWatch> {
        Arc::clone(&self.shared.lookup_answers)
    }

    /// What the set of fingerprints announced by the owners we are connected to gained and
    /// lost since `cursor`, the whole set only up to `max_whole` fingerprints (see
    /// [`crate::held_index::HeldIndex::changes_since`]), and whether every one of `targets` ("host:port") has
    /// announced all it holds.
    pub fn announced_changes(
        &self,
        cursor: Option<u64>,
        targets: &[String],
        max_whole: usize,
    ) -> (AnnouncedChanges, bool) {
        let index = lock(&self.shared.held_index);
        (index.changes_since(cursor, max_whole), index.all_synced(targets))
    }

    /// Asks every `(host, port)` in `targets` at once for the longest held turn starting
    /// with `fingerprints` or, with `request_id`, for a grant of that hold's blocks that carry
    /// them. A named hold that the owner has not taken yet (it takes a hold one engine step
    /// after the request finishes), or a turn the owner still computes whose prompt ends with
    /// `continues` ([`HoldBook::awaited`]), is asked for again, less and less often (see
    /// [`NOT_YET_FIRST_RETRY`]), until `timeout` has passed. A connected owner is asked from
    /// this thread right away: a new thread may wait long for a core on a busy host. Others
    /// are connected to first, each on a thread of its own, within `timeout`. Nothing here
    /// needs the caller: poll the returned [`LookupFanOut`]; an owner's reply is taken until
    /// [`LATE_REPLY_WINDOW`] after `timeout`, so that a late claim can still be handed back.
    /// Without `request_id`, owners that announced they hold none of the prompt are not
    /// asked: their answer (no match) is there at once (see [`crate::held_index`]); with
    /// `continues`, the engines this one granted that prompt to are asked whatever they
    /// announced ([`HoldBook::handed_to`]), and every owner when it knows none or none of
    /// them is a connected target. An owner not connected yet is asked once a handshake with
    /// it made the connection, one handshake per owner at a time, on a thread of its own,
    /// whatever the number of lookups waiting for it ([`connect_then`]).
    pub fn start_lookup(
        &self,
        targets: Vec<(String, u16)>,
        fingerprints: Vec<BlockFingerprint>,
        request_id: Option<String>,
        continues: Option<BlockFingerprint>,
        timeout: Duration,
    ) -> LookupFanOut {
        let connect_deadline = deadline_after(timeout);
        let addresses: Vec<String> =
            targets.iter().map(|(host, port)| format!("{host}:{port}")).collect();
        let must_ask = match (&request_id, continues) {
            // A named hold: every owner (the one that holds it announces no prompts).
            (Some(_), _) => MustAsk::All,
            // A prompt that continues a handoff: the engines it was granted to (the one
            // computing its turn has announced none of it yet), or all when none is known.
            (None, Some(end)) => match lock(&self.shared.holds).handed_to(end) {
                engines if engines.is_empty() => MustAsk::All,
                engines => MustAsk::Engines(engines),
            },
            (None, None) => MustAsk::Engines(Vec::new()),
        };
        let mut unasked = unasked(&self.shared, &addresses, &fingerprints, must_ask);
        let asked = unasked.iter().filter(|owner| owner.is_none()).count();
        let fan_out = LookupFanOut::new(
            addresses,
            Arc::new(LookupQuestion {
                fingerprints,
                request_id,
                continues,
                retry_until: deadline_after(timeout),
            }),
            deadline_after(timeout.saturating_add(LATE_REPLY_WINDOW)),
            asked,
            Arc::clone(&self.shared.lookup_answers),
            self.shared.retries.clone(),
        );
        for (index, (host, port)) in targets.into_iter().enumerate() {
            if let Some(owner) = unasked[index].take() {
                fan_out.answer(index, Ok((owner, None)));
                continue;
            }
            if let Some(peer) = ready_peer(&self.shared, &fan_out.addresses[index]) {
                fan_out.ask(index, &peer, NOT_YET_FIRST_RETRY);
                continue;
            }
            let asking = fan_out.clone();
            let ask = move |connected: Result<Arc<Peer>, String>| match connected {
                Ok(peer) => asking.ask(index, &peer, NOT_YET_FIRST_RETRY),
                Err(e) => asking.answer(index, Err(e)),
            };
            connect_then(&self.shared, host, port, connect_deadline, Box::new(ask));
        }
        fan_out
    }
}

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
    /// Where an ask answered "not yet" goes to be asked again (`retry.rs`).
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
/// [`crate::held_index::HeldIndex::narrow`] passes over (synced owners that announced none of the prompt's
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
}
