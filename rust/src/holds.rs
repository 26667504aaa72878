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
//! turns to keep under their cap, and any hold when the engine runs short of free blocks), or, for a prefill node's prompt held for one decode node ([`HoldKind::ForDecode`]),
//! once a reader releases its claim: a later reader then finds it gone and recomputes. It is
//! freed when it has ended and no claim remains. Every hold is freed
//! exactly once: [`HoldBook::expire`], [`HoldBook::release`] and [`HoldBook::evict`] each
//! return the request ids they freed and forget them.
//!
//! Pure state: time comes in as `now`, nothing here does I/O.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

pub mod feed;

use feed::{ChangeLog, Chunker, FeedWatch, HeldUpdate};

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

/// What a reader asks: "grant me the held turn starting with these blocks" (a lookup), or,
/// with `request_id`, "grant me that hold's blocks that carry these blocks' tokens".
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LookupRequest {
    /// Echoed in the reply, so one connection can carry several lookups.
    pub id: u64,
    pub fingerprints: Vec<BlockFingerprint>,
    /// The hold the reader's params name; `None` asks every offered turn.
    #[serde(default)]
    pub request_id: Option<String>,
}

/// The longest held prefix of a lookup's blocks, claimed for the reader.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LookupMatch {
    pub owner_request_id: String,
    /// The first `matched_blocks` of the turn's blocks hold the reader's first blocks.
    pub matched_blocks: u32,
    /// Release this claim when the read is done (or not done).
    pub claim_id: u64,
    /// The turn stays allocated at least this long for this reader.
    pub claim_ms: u64,
    /// What the owner offered with the hold: its `kv_transfer_params` for the whole turn.
    pub offer: Vec<u8>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LookupReply {
    pub id: u64,
    pub found: Option<LookupMatch>,
    /// Nothing granted, and the named hold was never seen: the owner may not have taken it yet
    /// (its engine registers a hold one step after answering the request), so asking again
    /// shortly may find it.
    #[serde(default)]
    pub not_yet: bool,
}

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
}

impl Evict {
    fn may_free(self, held: &Held, now: Instant) -> bool {
        held.claims.is_empty()
            && match self {
                Self::AnyHold => true,
                Self::Turns => held.kind == HoldKind::Turn,
                Self::TurnsAndUnread(unread) => {
                    held.kind == HoldKind::Turn
                        || now.saturating_duration_since(held.last_used) >= unread
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
    kind: HoldKind,
    /// Blocks the hold keeps allocated.
    num_blocks: usize,
    /// The fingerprints of the tokens the held blocks carry, block by block.
    fingerprints: Vec<BlockFingerprint>,
    offer: Vec<u8>,
    lease_ends: Instant,
    /// The hold itself is over (expired, evicted, read); freed once its claims are gone.
    ended: bool,
    claims: HashMap<u64, Claim>,
    last_used: Instant,
}

#[derive(Debug, Default)]
pub struct HoldBook {
    held: HashMap<String, Held>,
    /// Fingerprint → offered turns that have it (at the same block position, by the chain).
    index: HashMap<BlockFingerprint, Vec<String>>,
    ended: VecDeque<(String, Instant)>,
    ended_ids: HashSet<String>,
    next_claim: u64,
    num_claims: usize,
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
    /// for `ttl`. A [`HoldKind::Turn`] is also offered to lookups.
    #[allow(clippy::too_many_arguments)]
    pub fn hold(
        &mut self,
        request_id: &str,
        kind: HoldKind,
        num_blocks: usize,
        fingerprints: Vec<BlockFingerprint>,
        offer: Vec<u8>,
        ttl: Duration,
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
        self.forget_old_ended(now);
        if kind == HoldKind::Turn {
            for fingerprint in &fingerprints {
                self.index.entry(*fingerprint).or_default().push(request_id.to_owned());
            }
            self.log.held(fingerprints.clone());
        }
        let lease_ends = now.checked_add(ttl).unwrap_or_else(|| far_future(now));
        self.held.insert(
            request_id.to_owned(),
            Held {
                kind,
                num_blocks,
                fingerprints,
                offer,
                lease_ends,
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
        self.forget_old_ended(now);
        let Some(held) = self.held.get(request_id) else {
            return Err(if self.ended_ids.contains(request_id) {
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
        Ok(self.claim(reader, request_id.to_owned(), matched, claim_for, now))
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
        // Chained fingerprints: a hold that has the reader's block i at position i has all
        // of blocks 0..=i, so the last position found is the longest match.
        let mut examined = 0usize;
        let (request_id, matched) = fingerprints.iter().enumerate().rev().find_map(|(i, fp)| {
            let candidates = self.index.get(fp)?;
            examined += candidates.len();
            if examined > MAX_EXAMINED {
                return None;
            }
            candidates
                .iter()
                .filter_map(|id| Some((id, self.held.get(id)?)))
                .filter(|(_, h)| !h.ended && h.fingerprints.get(i) == Some(fp))
                // Several holds share the prefix: the one whose lease lasts longest.
                .max_by_key(|(_, h)| h.lease_ends)
                .map(|(id, _)| (id.clone(), i + 1))
        })?;
        Some(self.claim(reader, request_id, matched, claim_for, now))
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
        let deadline = now.checked_add(claim_for).unwrap_or_else(|| far_future(now));
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
        self.forget_old_ended(now);
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

    /// What a reader whose view of this book stands at `cursor` is to be sent: the changes of
    /// the lookup index past it, or a snapshot of the index (when `cursor` is `None` or the
    /// log no longer reaches back to it); and the cursor after them.
    pub fn held_since(&self, cursor: Option<u64>) -> (u64, Vec<HeldUpdate>) {
        let next = self.log.next();
        if let Some(updates) = cursor.and_then(|cursor| self.log.since(cursor)) {
            return (next, updates);
        }
        let mut snapshot = Chunker::snapshot();
        for (fingerprint, turns) in &self.index {
            turns.iter().for_each(|_| snapshot.push(*fingerprint, true));
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
    /// are never freed here: a reader may be reading them.
    pub fn evict(&mut self, num_blocks: usize, which: Evict, now: Instant) -> Vec<String> {
        let mut candidates: Vec<(Instant, String, usize)> = self
            .held
            .iter()
            .filter(|(_, h)| which.may_free(h, now))
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
                if let Some(ids) = self.index.get_mut(fingerprint) {
                    ids.retain(|id| id != request_id);
                    if ids.is_empty() {
                        self.index.remove(fingerprint);
                    }
                }
            }
            self.log.freed(held.fingerprints);
        }
        self.remember_ended(request_id, now);
        Some(request_id.to_owned())
    }

    fn remember_ended(&mut self, request_id: &str, now: Instant) {
        if self.ended_ids.contains(request_id) {
            return;
        }
        if self.ended.len() >= MAX_ENDED_KEPT {
            if let Some((oldest, _)) = self.ended.pop_front() {
                self.ended_ids.remove(&oldest);
            }
        }
        let keep_until = now.checked_add(ENDED_KEEP).unwrap_or_else(|| far_future(now));
        self.ended.push_back((request_id.to_owned(), keep_until));
        self.ended_ids.insert(request_id.to_owned());
    }

    fn forget_old_ended(&mut self, now: Instant) {
        while let Some((id, keep_until)) = self.ended.front() {
            if *keep_until > now {
                break;
            }
            self.ended_ids.remove(id);
            self.ended.pop_front();
        }
    }
}

/// A deadline that never comes in practice, for durations that overflow `Instant`.
fn far_future(now: Instant) -> Instant {
    now + Duration::from_secs(100 * 365 * 24 * 3600)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(120);
    const CLAIM: Duration = Duration::from_secs(30);

    fn book_with(turns: &[(&str, &[u64])], now: Instant) -> HoldBook {
        let mut book = HoldBook::new();
        for (id, fps) in turns {
            let offer = format!("offer-{id}").into_bytes();
            assert_eq!(
                book.hold(id, HoldKind::Turn, fps.len(), fps.to_vec(), offer, TTL, now),
                Ok(())
            );
        }
        book
    }

    fn prompt_hold(book: &mut HoldBook, id: &str, fps: &[u64], now: Instant) {
        assert_eq!(
            book.hold(id, HoldKind::ForDecode, fps.len(), fps.to_vec(), vec![], TTL, now),
            Ok(())
        );
    }

    #[test]
    fn lookup_finds_the_longest_held_prefix() {
        let t0 = Instant::now();
        let mut book =
            book_with(&[("short", &[1, 2]), ("long", &[1, 2, 3, 4]), ("other", &[9])], t0);
        let found = book.lookup("P", &[1, 2, 3, 7, 8], CLAIM, t0).unwrap();
        assert_eq!(found.owner_request_id, "long");
        assert_eq!(found.matched_blocks, 3);
        assert_eq!(found.offer, b"offer-long");
        assert_eq!(found.claim_ms, 30_000);
        assert!(book.lookup("P", &[5, 6], CLAIM, t0).is_none());
        // A fingerprint at another position is not a match (the chain differs).
        assert!(book.lookup("P", &[3], CLAIM, t0).is_none());
    }

    #[test]
    fn a_prompt_held_for_a_decode_node_is_granted_by_name_only_and_ends_once_read() {
        let t0 = Instant::now();
        let mut book = HoldBook::new();
        prompt_hold(&mut book, "p1", &[1, 2, 3], t0);
        // Not offered to lookups.
        assert!(book.lookup("D1", &[1, 2, 3], CLAIM, t0).is_none());
        // Two readers at once (a retried decode leg) both hold it.
        let d1 = book.grant("D1", "p1", &[1, 2, 3], CLAIM, t0).unwrap();
        let d2 = book.grant("D2", "p1", &[1, 2], CLAIM, t0).unwrap();
        assert_eq!((d1.matched_blocks, d2.matched_blocks), (3, 2));
        // A release by another reader than the claim's ends nothing.
        assert_eq!(book.release("D2", "p1", d1.claim_id, t0), None);
        assert_eq!(book.release("D1", "p1", d1.claim_id, t0), None);
        // Read by one reader: no new grant, freed when the last claim goes.
        assert_eq!(book.grant("D3", "p1", &[1, 2, 3], CLAIM, t0), Err(Refusal::Ended));
        assert_eq!(book.release("D2", "p1", d2.claim_id, t0), Some("p1".into()));
        assert!(book.is_empty());
        // Gone, and said so (not "not held yet"), while it is remembered.
        assert_eq!(book.grant("D3", "p1", &[1, 2, 3], CLAIM, t0), Err(Refusal::Ended));
        assert_eq!(
            book.grant("D3", "p1", &[1, 2, 3], CLAIM, t0 + ENDED_KEEP),
            Err(Refusal::NotHeldYet)
        );
    }

    #[test]
    fn a_grant_needs_the_readers_own_tokens_in_the_first_block() {
        let t0 = Instant::now();
        let mut book = HoldBook::new();
        prompt_hold(&mut book, "p1", &[1, 2, 3], t0);
        // Another prompt's fingerprints name the hold: refused, nothing claimed.
        assert_eq!(book.grant("D", "p1", &[7, 2, 3], CLAIM, t0), Err(Refusal::Mismatch));
        assert_eq!(book.grant("D", "p1", &[], CLAIM, t0), Err(Refusal::Mismatch));
        assert_eq!(book.num_claims(), 0);
        // A prompt that shares the first two blocks is granted those only.
        assert_eq!(book.grant("D", "p1", &[1, 2, 9, 10], CLAIM, t0).unwrap().matched_blocks, 2);
        assert_eq!(book.grant("D", "unknown", &[1], CLAIM, t0), Err(Refusal::NotHeldYet));
    }

    #[test]
    fn releases_end_claims_never_a_turn() {
        let t0 = Instant::now();
        let mut book = book_with(&[("turn", &[1, 2])], t0);
        let claim = book.grant("P", "turn", &[1, 2], CLAIM, t0).unwrap();
        assert_eq!(book.release("P", "turn", claim.claim_id, t0), None);
        assert_eq!(book.release("P", "turn", claim.claim_id + 1, t0), None);
        // Still offered to the next turn.
        assert_eq!(book.lookup("P", &[1, 2], CLAIM, t0).unwrap().owner_request_id, "turn");
    }

    #[test]
    fn claims_keep_a_turn_past_its_lease_until_released() {
        let t0 = Instant::now();
        let mut book = book_with(&[("turn", &[1, 2, 3])], t0);
        // Claimed shortly before the lease ends.
        let t1 = t0 + TTL - Duration::from_secs(1);
        let a = book.lookup("P1", &[1, 2, 3], CLAIM, t1).unwrap();
        let b = book.lookup("P2", &[1, 2], CLAIM, t1).unwrap();
        assert_ne!(a.claim_id, b.claim_id);
        assert_eq!(book.num_claims(), 2);
        // The lease ends while both read: nothing is freed.
        assert!(book.expire(t0 + TTL).is_empty());
        // A claim is released only by the reader that made it.
        assert_eq!(book.release("P2", "turn", a.claim_id, t0 + TTL), None);
        assert_eq!(book.release("P1", "turn", a.claim_id, t0 + TTL), None);
        // Released twice: nothing happens the second time.
        assert_eq!(book.release("P1", "turn", a.claim_id, t0 + TTL), None);
        assert_eq!(book.release("P2", "turn", b.claim_id, t0 + TTL), Some("turn".into()));
        assert!(book.is_empty());
        assert_eq!(book.num_claims(), 0);
        assert!(book.expire(t0 + TTL * 2).is_empty());
    }

    #[test]
    fn a_claim_past_its_deadline_no_longer_holds_the_turn() {
        let t0 = Instant::now();
        let mut book = book_with(&[("turn", &[1])], t0);
        book.lookup("P", &[1], Duration::from_secs(200), t0).unwrap();
        assert!(book.expire(t0 + TTL).is_empty());
        assert_eq!(book.expire(t0 + Duration::from_secs(200)), vec!["turn".to_string()]);
        assert_eq!(book.num_claims(), 0);
    }

    #[test]
    fn an_ended_hold_is_not_offered_nor_granted() {
        let t0 = Instant::now();
        let mut book = book_with(&[("turn", &[1, 2])], t0);
        let claim = book.lookup("P1", &[1, 2], CLAIM, t0 + TTL - Duration::from_secs(1)).unwrap();
        assert!(book.expire(t0 + TTL).is_empty());
        assert!(book.lookup("P2", &[1, 2], CLAIM, t0 + TTL).is_none());
        assert_eq!(book.grant("P2", "turn", &[1, 2], CLAIM, t0 + TTL), Err(Refusal::Ended));
        assert_eq!(book.release("P1", "turn", claim.claim_id, t0 + TTL), Some("turn".into()));
    }

    #[test]
    fn ended_holds_are_remembered_within_bounds() {
        let t0 = Instant::now();
        let mut book = HoldBook::new();
        for i in 0..MAX_ENDED_KEPT + 10 {
            let id = format!("r{i}");
            prompt_hold(&mut book, &id, &[1], t0);
            let claim = book.grant("D", &id, &[1], CLAIM, t0).unwrap();
            assert_eq!(book.release("D", &id, claim.claim_id, t0), Some(id));
        }
        assert_eq!(book.ended.len(), MAX_ENDED_KEPT);
        assert_eq!(book.ended_ids.len(), MAX_ENDED_KEPT);
        // The oldest were forgotten; the newest are known to be gone.
        assert_eq!(book.grant("D", "r0", &[1], CLAIM, t0), Err(Refusal::NotHeldYet));
        assert_eq!(
            book.grant("D", &format!("r{}", MAX_ENDED_KEPT + 9), &[1], CLAIM, t0),
            Err(Refusal::Ended)
        );
    }

    #[test]
    fn eviction_frees_least_recently_used_unclaimed_turns_and_unread_prompts_only() {
        let t0 = Instant::now();
        let mut book = book_with(&[("old", &[1]), ("claimed", &[2])], t0);
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(book.hold("new", HoldKind::Turn, 4, vec![3, 4, 5, 6], vec![], TTL, t1), Ok(()));
        book.lookup("P", &[2], CLAIM, t1).unwrap();
        assert_eq!(book.evict(1, Evict::Turns, t1), vec!["old".to_string()]);
        assert_eq!(book.evict(100, Evict::Turns, t1), vec!["new".to_string()]);
        assert_eq!(book.evict(100, Evict::Turns, t1), Vec::<String>::new());
        assert_eq!(book.len(), 1);
        // A prefill node's prompts held for their decode nodes are not evicted for turns,
        // nor for waiting requests until no reader has claimed them for the time given.
        prompt_hold(&mut book, "lease", &[7, 8], t1);
        prompt_hold(&mut book, "read", &[9], t1);
        book.grant("D", "read", &[9], CLAIM, t1).unwrap();
        assert!(book.evict(100, Evict::Turns, t1).is_empty());
        let unread = Evict::TurnsAndUnread(Duration::from_secs(1));
        assert!(book.evict(100, unread, t1 + Duration::from_millis(999)).is_empty());
        let t2 = t1 + Duration::from_secs(5);
        assert!(book.evict(100, Evict::Turns, t2).is_empty());
        assert_eq!(book.evict(100, unread, t2), vec!["lease".to_string()]);
        assert!(book.evict(100, unread, t2).is_empty()); // claimed: being read
    }

    #[test]
    fn under_pressure_unclaimed_prompts_and_turns_go_least_recently_used_first_and_once() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(1);
        let t2 = t0 + Duration::from_secs(2);
        let mut book = book_with(&[("turn", &[1, 2])], t1);
        prompt_hold(&mut book, "prompt", &[7, 8, 9], t0);
        prompt_hold(&mut book, "read", &[5], t2);
        book.grant("D", "read", &[5], CLAIM, t2).unwrap();
        assert_eq!(book.held_blocks(), 6);
        // The prompt is the least recently used; 3 blocks are enough.
        assert_eq!(book.evict(3, Evict::AnyHold, t2), vec!["prompt".to_string()]);
        // A later reader of the evicted prompt is told it ended, and computes.
        assert_eq!(book.grant("D", "prompt", &[7], CLAIM, t2), Err(Refusal::Ended));
        // The claimed prompt stays under its read; the turn goes; nothing is freed twice.
        assert_eq!(book.evict(100, Evict::AnyHold, t2), vec!["turn".to_string()]);
        assert!(book.evict(100, Evict::AnyHold, t2).is_empty());
        assert!(book.expire(t2).is_empty());
        assert_eq!(book.held_blocks(), 1);
    }

    #[test]
    fn holds_are_checked() {
        let t0 = Instant::now();
        let mut book = book_with(&[("a", &[1])], t0);
        assert_eq!(
            book.hold("a", HoldKind::Turn, 1, vec![], vec![], TTL, t0),
            Err(HoldError::AlreadyHeld("a".into()))
        );
        let too_many = vec![0; MAX_FINGERPRINTS + 1];
        assert!(matches!(
            book.hold("b", HoldKind::Turn, 1, too_many, vec![], TTL, t0),
            Err(HoldError::TooManyFingerprints(_))
        ));
        let huge = vec![0; MAX_OFFER_BYTES + 1];
        assert!(matches!(
            book.hold("b", HoldKind::Turn, 1, vec![], huge, TTL, t0),
            Err(HoldError::OfferTooLarge(_))
        ));
        // A TTL that overflows Instant is a hold that lasts, not a panic.
        assert_eq!(
            book.hold("c", HoldKind::ForDecode, 1, vec![], vec![], Duration::MAX, t0),
            Ok(())
        );
    }

    #[test]
    fn lookups_that_repeat_fingerprints_or_examine_too_much_find_nothing() {
        let t0 = Instant::now();
        let mut book = HoldBook::new();
        // Many holds sharing a first block (a long common system prompt).
        for n in 0..(MAX_EXAMINED as u64 + 1) {
            assert_eq!(
                book.hold(&format!("t{n}"), HoldKind::Turn, 2, vec![1, 1000 + n], vec![], TTL, t0),
                Ok(())
            );
        }
        assert!(book.lookup("P", &[1, 1, 1], CLAIM, t0).is_none());
        // The shared block alone examines every hold sharing it: more than allowed.
        assert!(book.lookup("P", &[1], CLAIM, t0).is_none());
        // A distinct second block is found at once.
        assert_eq!(book.lookup("P", &[1, 1005], CLAIM, t0).unwrap().owner_request_id, "t5");
    }

    #[test]
    fn claims_are_bounded() {
        let t0 = Instant::now();
        let mut book = book_with(&[("turn", &[1])], t0);
        for _ in 0..MAX_CLAIMS {
            assert!(book.lookup("P", &[1], CLAIM, t0).is_some());
        }
        assert!(book.lookup("P", &[1], CLAIM, t0).is_none());
        assert_eq!(book.grant("P", "turn", &[1], CLAIM, t0), Err(Refusal::TooMany));
        assert_eq!(book.expire(t0 + CLAIM).len(), 0);
        assert_eq!(book.num_claims(), 0);
    }

    #[test]
    fn readers_are_told_what_the_lookup_index_gains_and_loses() {
        let t0 = Instant::now();
        let mut book = book_with(&[("a", &[1, 2])], t0);
        prompt_hold(&mut book, "prompt", &[7], t0);
        let (cursor, snapshot) = book.held_since(None);
        assert_eq!(snapshot.len(), 1);
        assert!(snapshot[0].reset && snapshot[0].synced, "{snapshot:?}");
        let mut held = snapshot[0].held.clone();
        held.sort_unstable();
        assert_eq!(held, vec![1, 2], "turns only, not prompts held for a decode node");
        assert_eq!(book.hold("b", HoldKind::Turn, 3, vec![1, 2, 3], vec![], TTL, t0), Ok(()));
        let (next, updates) = book.held_since(Some(cursor));
        assert_eq!(updates, vec![HeldUpdate { held: vec![1, 2, 3], ..HeldUpdate::default() }]);
        assert_eq!(book.evict(1, Evict::Turns, t0), vec!["a".to_string()]);
        let (_, updates) = book.held_since(Some(next));
        assert_eq!(updates, vec![HeldUpdate { freed: vec![1, 2], ..HeldUpdate::default() }]);
        // A snapshot counts a fingerprint once per turn that has it.
        assert_eq!(book.hold("c", HoldKind::Turn, 1, vec![1], vec![], TTL, t0), Ok(()));
        let mut held = book.held_since(None).1[0].held.clone();
        held.sort_unstable();
        assert_eq!(held, vec![1, 1, 2, 3]);
    }

    #[test]
    fn index_is_cleaned_when_turns_are_freed() {
        let t0 = Instant::now();
        let mut book = book_with(&[("a", &[1, 2]), ("b", &[1, 3])], t0);
        assert_eq!(book.expire(t0 + TTL).len(), 2);
        assert!(book.index.is_empty());
    }
}
