//! Held KV blocks on the owner's side: leases, the content index of held turns, and the
//! grants that every read needs.
//!
//! An owner holds a finished request's blocks for readers. Nothing is read without a
//! **grant**: the reader presents the fingerprints of its own prompt (computed from its own
//! tokens, never copied from `kv_transfer_params`, which any client can write) and the owner
//! compares them with the fingerprints of the tokens its held blocks carry. A grant is a
//! counted **claim** bound to that reader's connection: the hold stays allocated while any
//! claim lasts, several readers may read one hold at once, and only the reader that made a
//! claim can release it. A reader names the hold it wants ([`HoldBook::grant`], from params)
//! or asks which held turn starts with its prompt ([`HoldBook::lookup`], decode nodes' turns
//! only). Releases end claims, never a hold.
//!
//! A hold ends when its lease passes, when the owner evicts it (unclaimed only: decode nodes'
//! turns to keep under their cap, and any hold when the engine runs short of free blocks),
//! when the engine's weights change (every hold, claimed ones too: [`Evict::Stale`]), or, for
//! a prefill node's prompt held for one decode node ([`HoldKind::ForDecode`]), once a reader
//! releases its claim: a later reader then finds it gone and recomputes. It is
//! freed when it has ended and no claim remains. Every hold is freed
//! exactly once: [`HoldBook::expire`], [`HoldBook::release`] and [`HoldBook::evict`] each
//! return the request ids they freed and forget them.
//!
//! A prompt held for a decode node that its reader has not asked for yet (queued on a busy
//! decode node) may be **renewed** by that reader: see `renew.rs` ([`HoldBook::renew`]).
//!
//! A decode node also tells its book which turns it is computing ([`HoldBook::expect`]): a
//! lookup that continues one's prompt is told to ask again until the turn is held or settled
//! ([`HoldBook::awaited`], see `expected.rs`).
//!
//! Pure state: time comes in as `now`, nothing here does I/O.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::clock::later;
use crate::sender::sender_engine;

mod ended;
mod expected;
pub mod feed;
mod handed;
mod renew;
mod wire;

use ended::EndedHolds;
use expected::ExpectedTurns;
pub use expected::MAX_EXPECTED;
use feed::{ChangeLog, Chunker, FeedWatch, HeldUpdate};
use handed::HandedOff;
pub use renew::MAX_RENEWED_LIFE;
pub use wire::{LookupMatch, LookupReply, LookupRequest};

/// One block's chained token fingerprint (see `token_fingerprint.py`): equal fingerprints at
/// block `i` mean equal tokens (and salt) at every position up to the end of block `i`.
pub type BlockFingerprint = u64;

/// The most fingerprints one hold or one lookup may carry (a 1M-token context at block 16).
pub const MAX_FINGERPRINTS: usize = 65_536;
/// The most bytes of offer (the reader's `kv_transfer_params`) one hold may carry.
pub const MAX_OFFER_BYTES: usize = 512 << 10;
/// The most claims alive at once over all holds; a grant past it is refused.
pub const MAX_CLAIMS: usize = 4096;
/// The most (position, hold) pairs one lookup examines, so a hostile reader cannot hold the
/// book's lock for long; a lookup past it finds nothing.
pub const MAX_EXAMINED: usize = 16_384;
/// The longest request id a grant may name (params' own limit).
pub const MAX_REQUEST_ID_BYTES: usize = 512;
/// Holds that ended are remembered this long, and at most this many, so that a grant naming
/// one is told it is gone rather than "not held yet".
pub const ENDED_KEEP: Duration = Duration::from_secs(60);
pub const MAX_ENDED_KEPT: usize = 4096;

/// What a hold is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HoldKind {
    /// A prefill node's prompt, for the decode node it was handed to: granted by name only,
    /// ended once a reader releases its claim (it has read the prompt, or will not); evicted
    /// while unclaimed only when the engine runs short of free blocks ([`Evict::AnyHold`]).
    ForDecode,
    /// A decode node's finished turn, for the next turn's prefill node: granted by name or
    /// found by lookup, evictable while unclaimed.
    Turn,
}

/// Why a hold was not taken.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HoldError {
    #[error("request {0:?} is already held")]
    AlreadyHeld(String),
    #[error("a hold carries at most {MAX_FINGERPRINTS} fingerprints, got {0}")]
    TooManyFingerprints(usize),
    #[error("a hold's offer is at most {MAX_OFFER_BYTES} bytes, got {0}")]
    OfferTooLarge(usize),
    #[error("at most {MAX_EXPECTED} turns are expected at once")]
    TooManyExpected,
}

/// Why a grant was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Refusal {
    #[error("no hold of that request (never held here)")]
    NotHeldYet,
    #[error("the hold has ended")]
    Ended,
    #[error("the held blocks carry other tokens than the reader's first block")]
    Mismatch,
    #[error("too many claims ({MAX_CLAIMS}) or fingerprints ({MAX_FINGERPRINTS}) at once")]
    TooMany,
}

/// Which holds an eviction may free (always unclaimed ones only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Evict {
    /// Decode nodes' turns only: room for new turns under their cap.
    Turns,
    /// Turns, and prompts held for decode nodes that no reader has claimed for this long:
    /// room for waiting requests. A decode node asks for its prompt within moments of
    /// getting it, or never (it computes a prompt itself when a pull would gain too little).
    TurnsAndUnread(Duration),
    /// Any hold, prompts held for decode nodes too: the engine runs short of free blocks.
    AnyHold,
    /// Every hold, claimed ones too, whatever `num_blocks` asks: the held KV was computed
    /// with weights the engine no longer has (vLLM reset its caches). A claimed hold ends
    /// (nothing grants or finds it again) and is freed once its claims end.
    Stale,
}

impl Evict {
    /// Whether an eviction of this kind ends `held` (freed now if unclaimed).
    fn ends(self, held: &Held, now: Instant) -> bool {
        match self {
            Self::Stale => true,
            Self::AnyHold => held.claims.is_empty(),
            Self::Turns => held.claims.is_empty() && held.kind == HoldKind::Turn,
            Self::TurnsAndUnread(unread) => {
                held.claims.is_empty()
                    && (held.kind == HoldKind::Turn
                        || now.saturating_duration_since(held.last_used) >= unread)
            }
        }
    }
}

#[derive(Debug)]
struct Claim {
    reader: String,
    deadline: Instant,
}

#[derive(Debug)]
struct Held {
    /// Its number in the lookup index, given once ([`HoldBook::names`]).
    number: u64,
    kind: HoldKind,
    /// Blocks the hold keeps allocated.
    num_blocks: usize,
    /// The fingerprints of the tokens the held blocks carry, block by block.
    fingerprints: Vec<BlockFingerprint>,
    /// Those announced to readers (a turn's: [`feed::announced`]; none of other holds).
    announced: Vec<BlockFingerprint>,
    offer: Vec<u8>,
    lease_ends: Instant,
    /// The first lease's length, and when the lease may end at the latest however often it is
    /// renewed ([`HoldBook::renew`]).
    lease: Duration,
    life_ends: Instant,
    /// The hold itself is over (expired, evicted, read); freed once its claims are gone.
    ended: bool,
    claims: HashMap<u64, Claim>,
    last_used: Instant,
}

#[derive(Debug, Default)]
pub struct HoldBook {
    held: HashMap<String, Held>,
    /// Fingerprint → numbers of the offered turns that have it (at the same block position,
    /// by the chain): a block costs the index a number, not a copy of its turn's request id.
    index: HashMap<BlockFingerprint, Vec<u64>>,
    /// Each held turn's request id, by its number.
    names: HashMap<u64, String>,
    next_number: u64,
    ended: EndedHolds,
    next_claim: u64,
    num_claims: usize,
    /// Turns being computed that will be held when they finish ([`HoldBook::expect`]).
    expected: ExpectedTurns,
    /// Lookups told to ask again so far ([`HoldBook::awaited`]).
    awaited: u64,
    /// The readers granted each prompt held for a decode node ([`HoldBook::handed_to`]).
    handed: HandedOff,
    /// The lookup index's changes, announced to readers ([`HoldBook::held_since`]).
    log: ChangeLog,
}

impl HoldBook {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    pub fn num_claims(&self) -> usize {
        self.num_claims
    }

    /// Starts holding `request_id`'s `num_blocks` blocks, whose tokens have `fingerprints`,
    /// until `lease_ends` (one already past ends at the next [`HoldBook::expire`]). A
    /// [`HoldKind::Turn`] is also offered to lookups and announced to readers (some of its
    /// fingerprints: [`feed::announced`], with its prompt's last full block, the first
    /// `prompt_blocks`' last; 0 if unknown).
    #[allow(clippy::too_many_arguments)]
    pub fn hold(
        &mut self,
        request_id: &str,
        kind: HoldKind,
        num_blocks: usize,
        fingerprints: Vec<BlockFingerprint>,
        prompt_blocks: usize,
        offer: Vec<u8>,
        lease_ends: Instant,
        now: Instant,
    ) -> Result<(), HoldError> {
        if self.held.contains_key(request_id) {
            return Err(HoldError::AlreadyHeld(request_id.to_owned()));
        }
        if fingerprints.len() > MAX_FINGERPRINTS {
            return Err(HoldError::TooManyFingerprints(fingerprints.len()));
        }
        if offer.len() > MAX_OFFER_BYTES {
            return Err(HoldError::OfferTooLarge(offer.len()));
        }
        self.ended.forget_old(now);
        let mut announced = Vec::new();
        self.next_number += 1;
        let number = self.next_number;
        if kind == HoldKind::Turn {
            self.names.insert(number, request_id.to_owned());
            for fingerprint in &fingerprints {
                self.index.entry(*fingerprint).or_default().push(number);
            }
            announced = feed::announced(&fingerprints, prompt_blocks);
            self.log.held(announced.clone());
        } else if let Some(&end) = fingerprints.last() {
            self.handed.held(end);
        }
        let lease = lease_ends.saturating_duration_since(now);
        self.held.insert(
            request_id.to_owned(),
            Held {
                number,
                kind,
                num_blocks,
                fingerprints,
                announced,
                offer,
                lease_ends,
                lease,
                life_ends: later(now, lease.saturating_mul(MAX_RENEWED_LIFE)),
                ended: false,
                claims: HashMap::new(),
                last_used: now,
            },
        );
        Ok(())
    }

    /// Grants `reader` the named hold's leading blocks whose fingerprints equal the reader's
    /// (the reader computed them from its own prompt): a claim until `now + claim_for` or
    /// until the reader releases it. At least the first block must match.
    pub fn grant(
        &mut self,
        reader: &str,
        request_id: &str,
        fingerprints: &[BlockFingerprint],
        claim_for: Duration,
        now: Instant,
    ) -> Result<LookupMatch, Refusal> {
        if self.num_claims >= MAX_CLAIMS || fingerprints.len() > MAX_FINGERPRINTS {
            return Err(Refusal::TooMany);
        }
        self.ended.forget_old(now);
        let Some(held) = self.held.get(request_id) else {
            return Err(if self.ended.contains(request_id) {
                Refusal::Ended
            } else {
                Refusal::NotHeldYet
            });
        };
        if held.ended {
            return Err(Refusal::Ended);
        }
        let matched = held
            .fingerprints
            .iter()
            .zip(fingerprints)
            .take_while(|(held, asked)| held == asked)
            .count();
        if matched == 0 {
            return Err(Refusal::Mismatch);
        }
        if held.kind == HoldKind::ForDecode {
            if let Some(&end) = held.fingerprints.last() {
                self.handed.granted(end, sender_engine(reader));
            }
        }
        Ok(self.claim(reader, request_id.to_owned(), matched, claim_for, now))
    }

    /// Expects `request_id`'s turn, being computed, to be held when it finishes; `end`: the
    /// fingerprint of its whole prompt (see `expected.rs`). Until [`HoldBook::settle`], a
    /// lookup that says it continues that prompt is told to ask again
    /// ([`HoldBook::awaited`]). A request expected or held already is left as it is.
    pub fn expect(&mut self, request_id: &str, end: BlockFingerprint) -> Result<(), HoldError> {
        if self.held.contains_key(request_id) || self.expected.contains(request_id) {
            return Ok(());
        }
        if self.expected.len() >= MAX_EXPECTED {
            return Err(HoldError::TooManyExpected);
        }
        self.expected.insert(request_id, end);
        Ok(())
    }

    /// `request_id`'s expected turn is held now, or will not be; false if it was not expected.
    pub fn settle(&mut self, request_id: &str) -> bool {
        self.expected.remove(request_id)
    }

    /// Whether a lookup of `fingerprints` should ask again shortly: it continues the prompt
    /// that ends with `continues`, whose turn is being computed here and will be held when it
    /// finishes, and no offered turn holds all of `fingerprints` yet.
    pub fn awaited(
        &mut self,
        fingerprints: &[BlockFingerprint],
        continues: Option<BlockFingerprint>,
    ) -> bool {
        let awaited = continues.is_some_and(|end| self.expected.computing(end))
            && fingerprints.len() <= MAX_FINGERPRINTS
            && self.longest_match(fingerprints).is_none_or(|(_, m)| m < fingerprints.len());
        self.awaited += u64::from(awaited);
        awaited
    }

    /// The engine ids granted the prompt held for a decode node whose fingerprints end with
    /// `end`, oldest first: a turn that continues that prompt is computed on one of them
    /// (none: not known, see `handed.rs`).
    pub fn handed_to(&self, end: BlockFingerprint) -> Vec<String> {
        self.handed.engines(end).to_vec()
    }

    /// How many lookups [`HoldBook::awaited`] told to ask again so far.
    pub fn num_awaited(&self) -> u64 {
        self.awaited
    }

    /// The longest prefix of `fingerprints` that an offered turn holds, claimed for `reader`
    /// until `now + claim_for` (or until it releases the claim). Turns that ended are not
    /// offered any more.
    pub fn lookup(
        &mut self,
        reader: &str,
        fingerprints: &[BlockFingerprint],
        claim_for: Duration,
        now: Instant,
    ) -> Option<LookupMatch> {
        if self.num_claims >= MAX_CLAIMS || fingerprints.len() > MAX_FINGERPRINTS {
            return None;
        }
        // Chained fingerprints never repeat within one prompt; a lookup that repeats them is
        // not a prompt's.
        let distinct: HashSet<&BlockFingerprint> = fingerprints.iter().collect();
        if distinct.len() != fingerprints.len() {
            return None;
        }
        let (request_id, matched) = self.longest_match(fingerprints)?;
        Some(self.claim(reader, request_id, matched, claim_for, now))
    }

    /// The offered turn holding the longest prefix of `fingerprints`, and that prefix's blocks.
    fn longest_match(&self, fingerprints: &[BlockFingerprint]) -> Option<(String, usize)> {
        // Chained fingerprints: a hold that has the reader's block i at position i has all
        // of blocks 0..=i, so the last position found is the longest match.
        let mut examined = 0usize;
        fingerprints.iter().enumerate().rev().find_map(|(i, fp)| {
            let candidates = self.index.get(fp)?;
            examined += candidates.len();
            if examined > MAX_EXAMINED {
                return None;
            }
            candidates
                .iter()
                .filter_map(|n| self.names.get(n))
                .filter_map(|id| Some((id, self.held.get(id)?)))
                .filter(|(_, h)| !h.ended && h.fingerprints.get(i) == Some(fp))
                // Several holds share the prefix: the one whose lease lasts longest.
                .max_by_key(|(_, h)| h.lease_ends)
                .map(|(id, _)| (id.clone(), i + 1))
        })
    }

    fn claim(
        &mut self,
        reader: &str,
        request_id: String,
        matched: usize,
        claim_for: Duration,
        now: Instant,
    ) -> LookupMatch {
        let claim_id = self.next_claim;
        self.next_claim += 1;
        let deadline = later(now, claim_for);
        let held = self.held.get_mut(&request_id).expect("a claimed hold is held");
        held.claims.insert(claim_id, Claim { reader: reader.to_owned(), deadline });
        held.last_used = now;
        self.num_claims += 1;
        LookupMatch {
            owner_request_id: request_id,
            matched_blocks: u32::try_from(matched).unwrap_or(u32::MAX),
            claim_id,
            claim_ms: u64::try_from(claim_for.as_millis()).unwrap_or(u64::MAX),
            offer: held.offer.clone(),
        }
    }

    /// `reader` is done with its claim `claim_id` on `request_id`'s blocks; only the reader that
    /// made a claim can end it. Returns the request id when this freed the hold.
    pub fn release(
        &mut self,
        reader: &str,
        request_id: &str,
        claim_id: u64,
        now: Instant,
    ) -> Option<String> {
        let held = self.held.get_mut(request_id)?;
        if held.claims.get(&claim_id).is_none_or(|c| c.reader != reader) {
            return None;
        }
        held.claims.remove(&claim_id);
        self.num_claims -= 1;
        if held.kind == HoldKind::ForDecode {
            held.ended = true;
        }
        self.free_if_done(request_id, now)
    }

    /// Ends leases and claims whose time is up; returns the holds this freed.
    pub fn expire(&mut self, now: Instant) -> Vec<String> {
        self.ended.forget_old(now);
        let mut touched = Vec::new();
        for (id, held) in &mut self.held {
            let before = held.claims.len();
            held.claims.retain(|_, claim| claim.deadline > now);
            self.num_claims -= before - held.claims.len();
            if held.lease_ends <= now {
                held.ended = true;
            }
            if held.ended && held.claims.is_empty() {
                touched.push(id.clone());
            }
        }
        touched.into_iter().filter_map(|id| self.free_if_done(&id, now)).collect()
    }

    /// The latest deadline of the claims alive at `now` on holds that ended: a reader may read
    /// their blocks until then (its reads fail by its claim's deadline), so the owner writes
    /// no block it frees until none is left (`None`), e.g. after [`Evict::Stale`].
    pub fn ended_claims_until(&self, now: Instant) -> Option<Instant> {
        self.held
            .values()
            .filter(|held| held.ended)
            .flat_map(|held| held.claims.values())
            .map(|claim| claim.deadline)
            .filter(|&deadline| deadline > now)
            .max()
    }

    /// What a reader whose view of this book stands at `cursor` is to be sent: the changes of
    /// the lookup index past it, or a snapshot of the index (when `cursor` is `None` or the
    /// log no longer reaches back to it); and the cursor after them.
    pub fn held_since(&self, cursor: Option<u64>) -> (u64, Vec<HeldUpdate>) {
        let next = self.log.next();
        if let Some(updates) = cursor.and_then(|cursor| self.log.since(cursor)) {
            return (next, updates);
        }
        let mut snapshot = Chunker::snapshot();
        // What `hold` announced of each turn the index has (ended ones still claimed too).
        for held in self.held.values() {
            held.announced.iter().for_each(|&fingerprint| snapshot.push(fingerprint, true));
        }
        (next, snapshot.finish(true))
    }

    /// Wakes the threads waiting for [`HoldBook::held_since`] to have more.
    pub fn feed_watch(&self) -> Arc<FeedWatch> {
        Arc::clone(self.log.watch())
    }

    /// Blocks held now (ended holds that wait for their claims included).
    pub fn held_blocks(&self) -> usize {
        self.held.values().map(|h| h.num_blocks).sum()
    }

    /// Frees unclaimed holds of `which` kind, least recently used first, until at least
    /// `num_blocks` blocks were freed or none is left; returns what it freed. Claimed holds
    /// are never freed here: a reader may be reading them ([`Evict::Stale`] ends them, and
    /// every other hold, for good).
    pub fn evict(&mut self, num_blocks: usize, which: Evict, now: Instant) -> Vec<String> {
        let num_blocks = if which == Evict::Stale { usize::MAX } else { num_blocks };
        let mut candidates: Vec<(Instant, String, usize)> = self
            .held
            .iter()
            .filter(|(_, h)| which.ends(h, now))
            .map(|(id, h)| (h.last_used, id.clone(), h.num_blocks))
            .collect();
        candidates.sort();
        let mut freed = Vec::new();
        let mut freed_blocks = 0;
        for (_, id, blocks) in candidates {
            if freed_blocks >= num_blocks {
                break;
            }
            if let Some(held) = self.held.get_mut(&id) {
                held.ended = true;
            }
            if let Some(id) = self.free_if_done(&id, now) {
                freed_blocks += blocks;
                freed.push(id);
            }
        }
        freed
    }

    fn free_if_done(&mut self, request_id: &str, now: Instant) -> Option<String> {
        let held = self.held.get(request_id)?;
        if !held.ended || !held.claims.is_empty() {
            return None;
        }
        let held = self.held.remove(request_id)?;
        if held.kind == HoldKind::Turn {
            for fingerprint in &held.fingerprints {
                if let Some(numbers) = self.index.get_mut(fingerprint) {
                    numbers.retain(|&n| n != held.number);
                    if numbers.is_empty() {
                        self.index.remove(fingerprint);
                    }
                }
            }
            self.names.remove(&held.number);
            self.log.freed(held.announced);
        }
        self.ended.remember(request_id, now);
        Some(request_id.to_owned())
    }
}

#[cfg(test)]
mod tests;
