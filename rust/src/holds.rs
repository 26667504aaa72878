//! Held KV blocks on the owner's side: leases, the content index of held turns, and claims.
//!
//! An owner holds a finished request's blocks for readers. A hold ends when its reader
//! releases it (the reader was named in `kv_transfer_params`), when its lease expires, or when
//! the owner evicts it under memory pressure. Holds that are *offered* (a decode node's
//! finished turns, in bidirectional mode) are also indexed by their chained token
//! fingerprints, so a reader that only knows its own prompt can find the longest held prefix
//! with [`HoldBook::lookup`]. A lookup that matches **claims** the turn until the reader
//! releases that claim or the claim's deadline passes; claims are counted, several readers may
//! read one turn at once, and a turn is freed only when its hold has ended and no claim
//! remains. Every hold is freed exactly once: [`HoldBook::expire`], [`HoldBook::release`] and
//! [`HoldBook::evict`] each return the request ids they freed and forget them.
//!
//! Pure state: time comes in as `now`, nothing here does I/O.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// One block's chained token fingerprint (see `token_fingerprint.py`): equal fingerprints at
/// block `i` mean equal tokens (and salt) at every position up to the end of block `i`.
pub type BlockFingerprint = u64;

/// The most fingerprints one hold or one lookup may carry (a 1M-token context at block 16).
pub const MAX_FINGERPRINTS: usize = 65_536;
/// The most bytes of offer (the reader's `kv_transfer_params`) one hold may carry.
pub const MAX_OFFER_BYTES: usize = 512 << 10;
/// The most claims alive at once over all holds; a lookup past it finds nothing.
pub const MAX_CLAIMS: usize = 4096;
/// The most (position, hold) pairs one lookup examines, so a hostile reader cannot hold the
/// book's lock for long; a lookup past it finds nothing.
pub const MAX_EXAMINED: usize = 16_384;
/// A release that arrives before its hold is remembered this long, and at most this many.
pub const EARLY_RELEASE_KEEP: Duration = Duration::from_secs(60);
pub const MAX_EARLY_RELEASES: usize = 4096;

/// What a reader asks: "which held turn starts with these blocks?"
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LookupRequest {
    /// Echoed in the reply, so one connection can carry several lookups.
    pub id: u64,
    pub fingerprints: Vec<BlockFingerprint>,
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

#[derive(Debug)]
struct Claim {
    reader: String,
    deadline: Instant,
}

#[derive(Debug)]
struct Held {
    /// Blocks the hold keeps allocated.
    num_blocks: usize,
    /// Empty unless offered to lookups.
    fingerprints: Vec<BlockFingerprint>,
    offer: Vec<u8>,
    lease_ends: Instant,
    /// The hold itself is over (released, expired, evicted); freed once its claims are gone.
    ended: bool,
    claims: HashMap<u64, Claim>,
    last_used: Instant,
}

#[derive(Debug, Default)]
pub struct HoldBook {
    held: HashMap<String, Held>,
    /// Fingerprint → offered holds that have it (at the same block position, by the chain).
    index: HashMap<BlockFingerprint, Vec<String>>,
    early_releases: VecDeque<(String, Instant)>,
    early_release_ids: HashSet<String>,
    next_claim: u64,
    num_claims: usize,
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

    /// Starts holding `request_id`'s `num_blocks` blocks for `ttl`. With fingerprints the
    /// hold is offered to lookups. `Ok(false)`: a reader released it already, free it at once.
    pub fn hold(
        &mut self,
        request_id: &str,
        num_blocks: usize,
        fingerprints: Vec<BlockFingerprint>,
        offer: Vec<u8>,
        ttl: Duration,
        now: Instant,
    ) -> Result<bool, HoldError> {
        if self.held.contains_key(request_id) {
            return Err(HoldError::AlreadyHeld(request_id.to_owned()));
        }
        if fingerprints.len() > MAX_FINGERPRINTS {
            return Err(HoldError::TooManyFingerprints(fingerprints.len()));
        }
        if offer.len() > MAX_OFFER_BYTES {
            return Err(HoldError::OfferTooLarge(offer.len()));
        }
        self.forget_old_early_releases(now);
        if self.early_release_ids.remove(request_id) {
            self.early_releases.retain(|(id, _)| id != request_id);
            return Ok(false);
        }
        for fingerprint in &fingerprints {
            self.index.entry(*fingerprint).or_default().push(request_id.to_owned());
        }
        let lease_ends = now.checked_add(ttl).unwrap_or_else(|| far_future(now));
        self.held.insert(
            request_id.to_owned(),
            Held {
                num_blocks,
                fingerprints,
                offer,
                lease_ends,
                ended: false,
                claims: HashMap::new(),
                last_used: now,
            },
        );
        Ok(true)
    }

    /// The longest held prefix of `fingerprints`, claimed for `reader` until `now + claim_for`
    /// (or until it releases the claim). Holds that ended are not offered any more.
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
        let held = self.held.get_mut(&request_id)?;
        let claim_id = self.next_claim;
        self.next_claim += 1;
        let deadline = now.checked_add(claim_for).unwrap_or_else(|| far_future(now));
        held.claims.insert(claim_id, Claim { reader: reader.to_owned(), deadline });
        held.last_used = now;
        self.num_claims += 1;
        Some(LookupMatch {
            owner_request_id: request_id,
            matched_blocks: u32::try_from(matched).unwrap_or(u32::MAX),
            claim_id,
            claim_ms: u64::try_from(claim_for.as_millis()).unwrap_or(u64::MAX),
            offer: held.offer.clone(),
        })
    }

    /// A reader is done with `request_id`'s blocks. With a claim id only that claim ends (and
    /// only when `reader` made it); without one the hold itself ends (the reader was named in
    /// the owner's params). Returns the request id when this freed the hold.
    pub fn release(
        &mut self,
        reader: &str,
        request_id: &str,
        claim_id: Option<u64>,
        now: Instant,
    ) -> Option<String> {
        let Some(held) = self.held.get_mut(request_id) else {
            if claim_id.is_none() {
                self.remember_early_release(request_id, now);
            }
            return None;
        };
        match claim_id {
            Some(claim) => {
                if held.claims.get(&claim).is_some_and(|c| c.reader == reader) {
                    held.claims.remove(&claim);
                    self.num_claims -= 1;
                }
            }
            None => held.ended = true,
        }
        self.free_if_done(request_id)
    }

    /// Ends leases and claims whose time is up; returns the holds this freed.
    pub fn expire(&mut self, now: Instant) -> Vec<String> {
        self.forget_old_early_releases(now);
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
        touched.into_iter().filter_map(|id| self.free_if_done(&id)).collect()
    }

    /// Frees unclaimed offered holds, least recently used first, until at least `num_blocks`
    /// blocks were freed or none is left; returns what it freed. Claimed holds are never
    /// freed here: a reader may be reading them.
    pub fn evict(&mut self, num_blocks: usize) -> Vec<String> {
        let mut candidates: Vec<(Instant, String, usize)> = self
            .held
            .iter()
            .filter(|(_, h)| h.claims.is_empty() && !h.fingerprints.is_empty())
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
            if let Some(id) = self.free_if_done(&id) {
                freed_blocks += blocks;
                freed.push(id);
            }
        }
        freed
    }

    fn free_if_done(&mut self, request_id: &str) -> Option<String> {
        let held = self.held.get(request_id)?;
        if !held.ended || !held.claims.is_empty() {
            return None;
        }
        let held = self.held.remove(request_id)?;
        for fingerprint in &held.fingerprints {
            if let Some(ids) = self.index.get_mut(fingerprint) {
                ids.retain(|id| id != request_id);
                if ids.is_empty() {
                    self.index.remove(fingerprint);
                }
            }
        }
        Some(request_id.to_owned())
    }

    fn remember_early_release(&mut self, request_id: &str, now: Instant) {
        if self.early_release_ids.contains(request_id) {
            return;
        }
        if self.early_releases.len() >= MAX_EARLY_RELEASES {
            if let Some((oldest, _)) = self.early_releases.pop_front() {
                self.early_release_ids.remove(&oldest);
            }
        }
        let keep_until = now.checked_add(EARLY_RELEASE_KEEP).unwrap_or_else(|| far_future(now));
        self.early_releases.push_back((request_id.to_owned(), keep_until));
        self.early_release_ids.insert(request_id.to_owned());
    }

    fn forget_old_early_releases(&mut self, now: Instant) {
        while let Some((id, keep_until)) = self.early_releases.front() {
            if *keep_until > now {
                break;
            }
            self.early_release_ids.remove(id);
            self.early_releases.pop_front();
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
            assert_eq!(book.hold(id, fps.len(), fps.to_vec(), offer, TTL, now), Ok(true));
        }
        book
    }

    #[test]
    fn lookup_finds_the_longest_held_prefix() {
        let t0 = Instant::now();
        let mut book = book_with(&[("short", &[1, 2]), ("long", &[1, 2, 3, 4]), ("other", &[9])], t0);
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
        assert_eq!(book.release("P2", "turn", Some(a.claim_id), t0 + TTL), None);
        assert_eq!(book.release("P1", "turn", Some(a.claim_id), t0 + TTL), None);
        // Released twice: nothing happens the second time.
        assert_eq!(book.release("P1", "turn", Some(a.claim_id), t0 + TTL), None);
        assert_eq!(book.release("P2", "turn", Some(b.claim_id), t0 + TTL), Some("turn".into()));
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
    fn an_ended_hold_is_not_offered() {
        let t0 = Instant::now();
        let mut book = book_with(&[("turn", &[1, 2])], t0);
        let claim = book.lookup("P1", &[1, 2], CLAIM, t0 + TTL - Duration::from_secs(1)).unwrap();
        assert!(book.expire(t0 + TTL).is_empty());
        assert!(book.lookup("P2", &[1, 2], CLAIM, t0 + TTL).is_none());
        assert_eq!(book.release("P1", "turn", Some(claim.claim_id), t0 + TTL), Some("turn".into()));
    }

    #[test]
    fn a_release_without_claim_ends_the_hold() {
        let t0 = Instant::now();
        let mut book = HoldBook::new();
        assert_eq!(book.hold("p1", 3, vec![], vec![], TTL, t0), Ok(true));
        assert_eq!(book.release("D", "p1", None, t0), Some("p1".into()));
        assert_eq!(book.release("D", "p1", None, t0), None);
        assert!(book.expire(t0 + TTL).is_empty());
    }

    #[test]
    fn an_early_release_frees_the_hold_on_arrival_and_is_forgotten_later() {
        let t0 = Instant::now();
        let mut book = HoldBook::new();
        assert_eq!(book.release("D", "fast", None, t0), None);
        assert_eq!(book.hold("fast", 1, vec![], vec![], TTL, t0), Ok(false));
        assert_eq!(book.release("D", "slow", None, t0), None);
        let later = t0 + EARLY_RELEASE_KEEP;
        assert_eq!(book.hold("slow", 1, vec![], vec![], TTL, later), Ok(true));
    }

    #[test]
    fn early_releases_are_bounded() {
        let t0 = Instant::now();
        let mut book = HoldBook::new();
        for i in 0..MAX_EARLY_RELEASES + 10 {
            book.release("D", &format!("r{i}"), None, t0);
        }
        assert_eq!(book.early_releases.len(), MAX_EARLY_RELEASES);
        assert_eq!(book.early_release_ids.len(), MAX_EARLY_RELEASES);
        // The oldest were dropped: their holds start normally.
        assert_eq!(book.hold("r0", 1, vec![], vec![], TTL, t0), Ok(true));
    }

    #[test]
    fn eviction_frees_least_recently_used_unclaimed_turns_only() {
        let t0 = Instant::now();
        let mut book = book_with(&[("old", &[1]), ("claimed", &[2])], t0);
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(book.hold("new", 4, vec![3, 4, 5, 6], vec![], TTL, t1), Ok(true));
        book.lookup("P", &[2], CLAIM, t1).unwrap();
        assert_eq!(book.evict(1), vec!["old".to_string()]);
        assert_eq!(book.evict(100), vec!["new".to_string()]);
        assert_eq!(book.evict(100), Vec::<String>::new());
        assert_eq!(book.len(), 1);
        // Un-offered holds (a prefill node's leases for its decode node) are never evicted.
        assert_eq!(book.hold("lease", 2, vec![], vec![], TTL, t1), Ok(true));
        assert!(book.evict(100).is_empty());
    }

    #[test]
    fn holds_are_checked() {
        let t0 = Instant::now();
        let mut book = book_with(&[("a", &[1])], t0);
        assert_eq!(book.hold("a", 1, vec![], vec![], TTL, t0), Err(HoldError::AlreadyHeld("a".into())));
        let too_many = vec![0; MAX_FINGERPRINTS + 1];
        assert!(matches!(book.hold("b", 1, too_many, vec![], TTL, t0), Err(HoldError::TooManyFingerprints(_))));
        let huge = vec![0; MAX_OFFER_BYTES + 1];
        assert!(matches!(book.hold("b", 1, vec![], huge, TTL, t0), Err(HoldError::OfferTooLarge(_))));
        // A TTL that overflows Instant is a hold that lasts, not a panic.
        assert_eq!(book.hold("c", 1, vec![], vec![], Duration::MAX, t0), Ok(true));
    }

    #[test]
    fn lookups_that_repeat_fingerprints_or_examine_too_much_find_nothing() {
        let t0 = Instant::now();
        let mut book = HoldBook::new();
        // Many holds sharing a first block (a long common system prompt).
        for n in 0..(MAX_EXAMINED as u64 + 1) {
            assert_eq!(book.hold(&format!("t{n}"), 2, vec![1, 1000 + n], vec![], TTL, t0), Ok(true));
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
        assert_eq!(book.expire(t0 + CLAIM).len(), 0);
        assert_eq!(book.num_claims(), 0);
    }

    #[test]
    fn index_is_cleaned_when_turns_are_freed() {
        let t0 = Instant::now();
        let mut book = book_with(&[("a", &[1, 2]), ("b", &[1, 3])], t0);
        assert_eq!(book.expire(t0 + TTL).len(), 2);
        assert!(book.index.is_empty());
    }
}
