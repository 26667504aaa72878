//! A reader's index of what the owners it is connected to hold, so that a lookup asks only the
//! owners that may hold the prompt instead of every owner it knows.
//!
//! Each owner announces the fingerprints its hold book offers to lookups
//! ([`crate::holds::feed`]): a snapshot when the reader connects, then what it holds and frees.
//! The index keeps them by owner ("slot": one per connection, so a reconnected owner starts
//! afresh) and by fingerprint. An owner is **synced** once its snapshot is complete; a lookup
//! then asks the synced owners that announced the prompt's longest announced fingerprint (by
//! the chain, they hold the longest prefix), none of the other synced owners, and every owner
//! that is not synced (connecting, still sending its snapshot, or past its bound), as before
//! the index.
//!
//! The index only narrows whom to ask: every read is still granted by the owner against its
//! live hold book, so an entry that went stale costs one miss, never a wrong read. What an
//! owner announces only ever makes the reader ask that owner, and is bounded per owner and in
//! total: an owner past its bound is forgotten and asked always, as if it were not synced.
//!
//! Pure state: no sockets, no time.

use std::collections::{HashMap, VecDeque};

use crate::holds::feed::HeldUpdate;
use crate::holds::BlockFingerprint;

/// The most distinct fingerprints kept for one owner (256k blocks: 4M tokens at block 16).
pub const MAX_ENTRIES_PER_OWNER: usize = 1 << 18;
/// The most (fingerprint, owner) entries kept over all owners.
pub const MAX_ENTRIES: usize = 1 << 20;

/// How many changes of the announced set the index keeps for [`HeldIndex::changes_since`];
/// a reader further behind gets the whole set again.
pub const MAX_LOGGED_CHANGES: usize = 1 << 16;

/// What a reader of the announced set ([`HeldIndex::changes_since`]) is told: the fingerprints
/// that some owner announced and no longer any owner does, since its cursor, or the whole set.
#[derive(Debug, PartialEq, Eq)]
pub struct AnnouncedChanges {
    /// Pass it back for the next changes.
    pub cursor: u64,
    /// `added` is the whole set (forget what you had).
    pub whole: bool,
    /// The whole set was due but larger than the reader takes: `added` is empty, and the
    /// reader's copy is incomplete until it asks again.
    pub too_large: bool,
    pub added: Vec<BlockFingerprint>,
    pub removed: Vec<BlockFingerprint>,
}

/// One connection to an owner, as the index numbers it ([`HeldIndex::open`]).
pub type OwnerSlot = u64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OwnerState {
    /// Its snapshot is not complete yet: asked on every lookup.
    Syncing,
    /// Its announcements are complete: asked only when it announced the prompt.
    Synced,
    /// It announced more than its bound: its entries were dropped and it is asked on every
    /// lookup, until a new snapshot (a reconnection) starts it afresh.
    Overflowed,
}

#[derive(Debug)]
struct Owner {
    address: String,
    state: OwnerState,
    /// Fingerprint → how many of its held turns have it.
    counts: HashMap<BlockFingerprint, u32>,
}

#[derive(Debug, Default)]
pub struct HeldIndex {
    owners: HashMap<OwnerSlot, Owner>,
    /// The newest slot of each owner's side channel ("host:port").
    current: HashMap<String, OwnerSlot>,
    /// Fingerprint → the owners that announced it.
    holders: HashMap<BlockFingerprint, Vec<OwnerSlot>>,
    /// Entries over all owners (each owner's distinct fingerprints).
    entries: usize,
    next_slot: OwnerSlot,
    /// The newest changes of the announced set (`holders`' keys): (fingerprint, now in it).
    log: VecDeque<(BlockFingerprint, bool)>,
    /// The cursor after the newest change in `log`.
    log_end: u64,
}

impl HeldIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// A new connection to the owner at `address`: its slot, which replaces any earlier one
    /// for lookups (that one stays until closed, unused).
    pub fn open(&mut self, address: &str) -> OwnerSlot {
        let slot = self.next_slot;
        self.next_slot += 1;
        let owner = Owner {
            address: address.to_owned(),
            state: OwnerState::Syncing,
            counts: HashMap::new(),
        };
        self.owners.insert(slot, owner);
        self.current.insert(address.to_owned(), slot);
        slot
    }

    /// The connection ended: its announcements are forgotten.
    pub fn close(&mut self, slot: OwnerSlot) {
        self.clear(slot);
        if let Some(owner) = self.owners.remove(&slot) {
            if self.current.get(&owner.address) == Some(&slot) {
                self.current.remove(&owner.address);
            }
        }
    }

    /// Where the owner at `address` stands, `None` if it has no open connection.
    pub fn state(&self, address: &str) -> Option<OwnerState> {
        let slot = self.current.get(address)?;
        self.owners.get(slot).map(|owner| owner.state)
    }

    /// Entries over all owners.
    pub fn len(&self) -> usize {
        self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// Applies one announcement of the owner at `slot` (fingerprints held first, then those
    /// freed); a slot closed already is ignored. Returns true when this update took the owner
    /// past its bound (it is then asked always, see [`OwnerState::Overflowed`]).
    pub fn apply(&mut self, slot: OwnerSlot, update: &HeldUpdate) -> bool {
        let Some(owner) = self.owners.get_mut(&slot) else { return false };
        if update.reset {
            owner.state = OwnerState::Syncing;
            self.clear(slot);
        }
        if self.owners.get(&slot).is_some_and(|o| o.state == OwnerState::Overflowed) {
            return false;
        }
        for fingerprint in &update.held {
            if !self.add(slot, *fingerprint) {
                self.clear(slot);
                if let Some(owner) = self.owners.get_mut(&slot) {
                    owner.state = OwnerState::Overflowed;
                }
                return true;
            }
        }
        for fingerprint in &update.freed {
            self.remove(slot, *fingerprint);
        }
        if let Some(owner) = self.owners.get_mut(&slot) {
            if update.synced && owner.state == OwnerState::Syncing {
                owner.state = OwnerState::Synced;
            }
        }
        false
    }

    /// Which of `targets` (owners' side channels, "host:port") a lookup of `fingerprints`
    /// asks: the synced owners that announced the longest announced fingerprint of the
    /// prompt, every owner that is not synced, and those `must` marks (by position; missing
    /// ones are not); every target when that is none of them (a prompt nobody announced:
    /// the owner of the turn its client just saw answered may not have announced it yet, a
    /// thread's wake-up after its hold, seconds on a starved host, so such a prompt costs
    /// the fan-out it cost before the index; every hit is asked of its holders alone). Its
    /// work is bounded by the prompt's length and the number of targets, never by what
    /// owners announced.
    pub fn narrow(
        &self,
        targets: &[String],
        fingerprints: &[BlockFingerprint],
        must: &[bool],
    ) -> Vec<bool> {
        let synced: Vec<Option<OwnerSlot>> = targets
            .iter()
            .map(|address| {
                let slot = *self.current.get(address)?;
                (self.owners.get(&slot)?.state == OwnerState::Synced).then_some(slot)
            })
            .collect();
        let mut ask: Vec<bool> = synced
            .iter()
            .enumerate()
            .map(|(index, slot)| slot.is_none() || must.get(index).copied().unwrap_or(false))
            .collect();
        let by_slot: HashMap<OwnerSlot, Vec<usize>> =
            synced.iter().enumerate().fold(HashMap::new(), |mut by_slot, (index, slot)| {
                if let Some(slot) = slot {
                    by_slot.entry(*slot).or_default().push(index);
                }
                by_slot
            });
        for fingerprint in fingerprints.iter().rev() {
            let Some(holders) = self.holders.get(fingerprint) else { continue };
            let mut found = false;
            for index in holders.iter().filter_map(|slot| by_slot.get(slot)).flatten() {
                ask[*index] = true;
                found = true;
            }
            if found {
                break;
            }
        }
        if !ask.contains(&true) {
            ask.fill(true);
        }
        ask
    }

    /// Whether every one of `targets` ("host:port") has a connection whose announcements are
    /// complete: only then does the announced set say what they hold (see [`OwnerState`]).
    pub fn all_synced(&self, targets: &[String]) -> bool {
        targets.iter().all(|address| self.state(address) == Some(OwnerState::Synced))
    }

    /// What the set of fingerprints announced by any owner gained and lost since `cursor`
    /// (from an earlier answer), each fingerprint once with where it stands now; the whole set
    /// for `None` or a cursor the log no longer reaches, unless it has more than `max_whole`
    /// fingerprints (then none, `too_large`). Bounded by the log and `max_whole`, never by what
    /// an owner sends.
    pub fn changes_since(&self, cursor: Option<u64>, max_whole: usize) -> AnnouncedChanges {
        let start = self.log_end - self.log.len() as u64;
        let Some(cursor) = cursor.filter(|c| (start..=self.log_end).contains(c)) else {
            let too_large = self.holders.len() > max_whole;
            return AnnouncedChanges {
                cursor: self.log_end,
                whole: true,
                too_large,
                added: if too_large { Vec::new() } else { self.holders.keys().copied().collect() },
                removed: Vec::new(),
            };
        };
        // The last change of each fingerprint is where it stands.
        let mut last: HashMap<BlockFingerprint, bool> = HashMap::new();
        for (fingerprint, present) in self.log.iter().skip((cursor - start) as usize) {
            last.insert(*fingerprint, *present);
        }
        let (added, removed): (Vec<_>, Vec<_>) = last.into_iter().partition(|(_, p)| *p);
        AnnouncedChanges {
            cursor: self.log_end,
            whole: false,
            too_large: false,
            added: added.into_iter().map(|(fingerprint, _)| fingerprint).collect(),
            removed: removed.into_iter().map(|(fingerprint, _)| fingerprint).collect(),
        }
    }

    fn logged(&mut self, fingerprint: BlockFingerprint, present: bool) {
        if self.log.len() == MAX_LOGGED_CHANGES {
            self.log.pop_front();
        }
        self.log.push_back((fingerprint, present));
        self.log_end += 1;
    }

    /// Counts `fingerprint` for `slot`; false when a new entry would pass a bound.
    fn add(&mut self, slot: OwnerSlot, fingerprint: BlockFingerprint) -> bool {
        let Some(owner) = self.owners.get_mut(&slot) else { return true };
        if let Some(count) = owner.counts.get_mut(&fingerprint) {
            *count = count.saturating_add(1);
            return true;
        }
        if owner.counts.len() >= MAX_ENTRIES_PER_OWNER || self.entries >= MAX_ENTRIES {
            return false;
        }
        owner.counts.insert(fingerprint, 1);
        let holders = self.holders.entry(fingerprint).or_default();
        holders.push(slot);
        if holders.len() == 1 {
            self.logged(fingerprint, true);
        }
        self.entries += 1;
        true
    }

    /// Uncounts `fingerprint` for `slot` (nothing if it was not counted).
    fn remove(&mut self, slot: OwnerSlot, fingerprint: BlockFingerprint) {
        let Some(owner) = self.owners.get_mut(&slot) else { return };
        let Some(count) = owner.counts.get_mut(&fingerprint) else { return };
        *count -= 1;
        if *count == 0 {
            owner.counts.remove(&fingerprint);
            self.unlist(slot, fingerprint);
        }
    }

    /// Forgets every entry of `slot`.
    fn clear(&mut self, slot: OwnerSlot) {
        let Some(owner) = self.owners.get_mut(&slot) else { return };
        let counts = std::mem::take(&mut owner.counts);
        for fingerprint in counts.into_keys() {
            self.unlist(slot, fingerprint);
        }
    }

    fn unlist(&mut self, slot: OwnerSlot, fingerprint: BlockFingerprint) {
        if let Some(holders) = self.holders.get_mut(&fingerprint) {
            holders.retain(|holder| *holder != slot);
            if holders.is_empty() {
                self.holders.remove(&fingerprint);
                self.logged(fingerprint, false);
            }
        }
        self.entries -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(fps: &[u64]) -> HeldUpdate {
        HeldUpdate { held: fps.to_vec(), ..HeldUpdate::default() }
    }

    fn snapshot(fps: &[u64]) -> HeldUpdate {
        HeldUpdate { reset: true, synced: true, ..held(fps) }
    }

    fn targets(addresses: &[&str]) -> Vec<String> {
        addresses.iter().map(|a| (*a).to_owned()).collect()
    }

    #[test]
    fn a_lookup_asks_the_synced_holder_of_the_longest_prefix_and_every_owner_not_synced() {
        let mut index = HeldIndex::new();
        let (a, b, c) = (index.open("a:1"), index.open("b:1"), index.open("c:1"));
        index.apply(a, &snapshot(&[1, 2, 3]));
        index.apply(b, &snapshot(&[1, 2]));
        // c's snapshot is not complete yet.
        index.apply(c, &HeldUpdate { reset: true, ..held(&[9]) });
        let all = targets(&["a:1", "b:1", "c:1", "d:1"]);
        assert_eq!(index.state("c:1"), Some(OwnerState::Syncing));
        assert_eq!(index.state("d:1"), None);
        // a holds the longest prefix; c is syncing and d unknown: asked as before the index.
        assert_eq!(index.narrow(&all, &[1, 2, 3, 4], &[]), vec![true, false, true, true]);
        // Both hold the prompt's longest announced block.
        assert_eq!(index.narrow(&all, &[1, 2, 7], &[]), vec![true, true, true, true]);
        // No synced owner announced any of it: all are asked (it may not be announced yet).
        let synced = targets(&["a:1", "b:1"]);
        assert_eq!(index.narrow(&synced, &[5, 6], &[]), vec![true, true]);
        assert_eq!(index.narrow(&synced, &[], &[]), vec![true, true]);
        // Unless the lookup must ask one of them (the engine its prompt was handed to); that
        // one is asked beside the holders too.
        assert_eq!(index.narrow(&synced, &[5, 6], &[false, true]), vec![false, true]);
        assert_eq!(index.narrow(&synced, &[1, 2, 3], &[false, true]), vec![true, true]);
        // A holder that is not among the targets is passed over for the next longest.
        assert_eq!(index.narrow(&targets(&["b:1"]), &[1, 2, 3], &[]), vec![true]);
        // c completes its snapshot.
        index.apply(c, &HeldUpdate { synced: true, ..held(&[]) });
        assert_eq!(index.narrow(&all, &[9], &[]), vec![false, false, true, true]);
    }

    #[test]
    fn announcements_are_counted_per_turn_and_forgotten_with_their_connection() {
        let mut index = HeldIndex::new();
        let (a, z) = (index.open("a:1"), index.open("z:1"));
        index.apply(a, &snapshot(&[1, 1, 2]));
        // z holds the block before each prompt's: a is asked only for what it announced.
        index.apply(z, &snapshot(&[500]));
        let asked = |index: &HeldIndex, fps: &[u64]| {
            let prompt: Vec<u64> = [500].iter().chain(fps).copied().collect();
            index.narrow(&targets(&["a:1", "z:1"]), &prompt, &[])[0]
        };
        // Two turns had block 1; one freed: still held.
        index.apply(a, &HeldUpdate { freed: vec![1, 2], ..held(&[]) });
        assert!(asked(&index, &[1]));
        assert!(!asked(&index, &[2]));
        index.apply(a, &HeldUpdate { freed: vec![1, 1, 77], ..held(&[]) });
        assert!(!asked(&index, &[1]), "freed more often than held: forgotten, never negative");
        assert_eq!(index.len(), 1, "z's alone");
        // Held and freed in one update (a turn held, then freed): nothing left.
        index.apply(a, &HeldUpdate { freed: vec![5], ..held(&[5]) });
        assert!(!asked(&index, &[5]));
        index.apply(a, &held(&[6]));
        assert_eq!(index.len(), 2);
        // The connection ends: forgotten, and asked again (as an unknown owner) from now on.
        index.close(a);
        assert_eq!(index.len(), 1);
        assert_eq!(index.state("a:1"), None);
        assert!(asked(&index, &[6]));
        index.apply(a, &snapshot(&[6]));
        assert_eq!(index.len(), 1, "a closed slot takes no more announcements");
    }

    #[test]
    fn a_reconnected_owner_starts_afresh_and_its_old_connection_cannot_touch_it() {
        let mut index = HeldIndex::new();
        let old = index.open("a:1");
        index.apply(old, &snapshot(&[1]));
        // z holds every prompt's first block: a is asked only for what it announced.
        let z = index.open("z:1");
        index.apply(z, &snapshot(&[500]));
        let new = index.open("a:1");
        assert_eq!(index.state("a:1"), Some(OwnerState::Syncing));
        index.apply(new, &snapshot(&[2]));
        index.apply(old, &held(&[3]));
        index.close(old);
        assert_eq!(index.state("a:1"), Some(OwnerState::Synced));
        let asked = |index: &HeldIndex, fp: u64| {
            index.narrow(&targets(&["a:1", "z:1"]), &[500, fp], &[])[0]
        };
        assert_eq!((asked(&index, 1), asked(&index, 2), asked(&index, 3)), (false, true, false));
        // A new snapshot on the same connection replaces the view.
        index.apply(new, &snapshot(&[4]));
        assert_eq!((asked(&index, 2), asked(&index, 4)), (false, true));
        assert_eq!(index.len(), 2);
    }

    #[test]
    fn an_owner_can_only_make_the_reader_ask_itself() {
        let mut index = HeldIndex::new();
        let (honest, hostile) = (index.open("honest:1"), index.open("hostile:1"));
        index.apply(honest, &snapshot(&[1, 2, 3]));
        // The hostile owner announces the honest one's blocks and a longer prefix, and frees
        // what it never held.
        index.apply(hostile, &snapshot(&[1, 2, 3, 4]));
        index.apply(hostile, &HeldUpdate { freed: vec![1, 2, 3], ..held(&[]) });
        index.apply(hostile, &HeldUpdate { freed: vec![1, 2, 3], ..held(&[]) });
        let both = targets(&["honest:1", "hostile:1"]);
        assert_eq!(index.narrow(&both, &[1, 2, 3], &[]), vec![true, false]);
        index.apply(hostile, &held(&[3, 4]));
        // Still asked: it can add itself beside the honest holder, never remove it.
        assert_eq!(index.narrow(&both, &[1, 2, 3], &[]), vec![true, true]);
        assert_eq!(index.narrow(&both, &[1, 2, 3, 4], &[]), vec![false, true]);
    }

    #[test]
    fn a_reader_of_the_announced_set_gets_what_changed_since_its_cursor_or_the_whole_set() {
        let sorted = |mut v: Vec<u64>| {
            v.sort_unstable();
            v
        };
        let mut index = HeldIndex::new();
        let (a, b) = (index.open("a:1"), index.open("b:1"));
        assert!(!index.all_synced(&targets(&["a:1", "b:1"])));
        index.apply(a, &snapshot(&[1, 2]));
        let first = index.changes_since(None, usize::MAX);
        assert!(first.whole);
        assert_eq!(sorted(first.added), vec![1, 2]);
        assert!(index.all_synced(&targets(&["a:1"])));
        assert!(!index.all_synced(&targets(&["a:1", "b:1"])), "b has not sent its snapshot");
        assert!(!index.all_synced(&targets(&["a:1", "c:1"])), "c is not connected");
        // b announces a block a holds too (no change of the set), and one of its own; a frees
        // block 1, which b still holds, and block 2, which no one does.
        index.apply(b, &snapshot(&[1, 3]));
        index.apply(a, &HeldUpdate { freed: vec![1, 2], ..held(&[]) });
        let next = index.changes_since(Some(first.cursor), usize::MAX);
        assert!(!next.whole);
        assert_eq!((next.added, next.removed), (vec![3], vec![2]));
        assert!(index.all_synced(&targets(&["a:1", "b:1"])));
        // Held and freed again since: where it stands now, once.
        index.apply(a, &held(&[2]));
        index.apply(a, &HeldUpdate { freed: vec![2], ..held(&[]) });
        index.apply(a, &held(&[2]));
        let again = index.changes_since(Some(next.cursor), usize::MAX);
        assert_eq!((again.added, again.removed), (vec![2], vec![]));
        // Nothing new: nothing.
        let none = index.changes_since(Some(again.cursor), usize::MAX);
        assert!(!none.whole && none.added.is_empty() && none.removed.is_empty());
        assert_eq!(none.cursor, again.cursor);
        // A closed connection takes its blocks out of the set (a freed block 1 before).
        index.close(b);
        let closed = index.changes_since(Some(none.cursor), usize::MAX);
        assert_eq!((closed.added, sorted(closed.removed)), (vec![], vec![1, 3]));
        // A cursor the log no longer reaches, or one from the future: the whole set.
        let churn: Vec<u64> = (100..=100 + MAX_LOGGED_CHANGES as u64).collect();
        index.apply(a, &held(&churn));
        let behind = index.changes_since(Some(closed.cursor), usize::MAX);
        assert!(behind.whole);
        assert_eq!(behind.added.len(), 2 + MAX_LOGGED_CHANGES, "a's block 2 and the churn");
        assert!(index.changes_since(Some(behind.cursor + 1), usize::MAX).whole);
        assert!(!index.changes_since(Some(behind.cursor), usize::MAX).whole);
        // A whole set past what the reader takes is not built; changes still come.
        let capped = index.changes_since(None, MAX_LOGGED_CHANGES);
        assert!(capped.whole && capped.too_large && capped.added.is_empty());
        let fits = index.changes_since(None, 2 + MAX_LOGGED_CHANGES);
        assert!(fits.whole && !fits.too_large);
        index.apply(a, &held(&[7]));
        let small = index.changes_since(Some(capped.cursor), 0);
        assert_eq!((small.whole, small.too_large, small.added), (false, false, vec![7]));
    }

    #[test]
    fn an_owner_past_its_bound_is_forgotten_and_asked_always() {
        let mut index = HeldIndex::new();
        let (small, big) = (index.open("small:1"), index.open("big:1"));
        index.apply(small, &snapshot(&[u64::MAX]));
        let too_many: Vec<u64> = (0..=MAX_ENTRIES_PER_OWNER as u64).collect();
        assert!(index.apply(big, &snapshot(&too_many)));
        assert_eq!(index.state("big:1"), Some(OwnerState::Overflowed));
        assert_eq!(index.len(), 1, "its entries are dropped");
        let both = targets(&["small:1", "big:1"]);
        assert_eq!(index.narrow(&both, &[7], &[]), vec![false, true]);
        // It stays so until a new snapshot fits.
        assert!(!index.apply(big, &HeldUpdate { synced: true, ..held(&[7]) }));
        assert_eq!(index.state("big:1"), Some(OwnerState::Overflowed));
        assert!(!index.apply(big, &snapshot(&[7])));
        assert_eq!(index.narrow(&both, &[7], &[]), vec![false, true]);
        assert_eq!(index.narrow(&both, &[u64::MAX, 7], &[]), vec![false, true]);
        assert_eq!(index.narrow(&both, &[u64::MAX, 8], &[]), vec![true, false]);
        // The total bound holds over many owners.
        let per_owner: Vec<u64> = (0..MAX_ENTRIES_PER_OWNER as u64).collect();
        let mut overflowed = 0;
        for n in 0..(MAX_ENTRIES / MAX_ENTRIES_PER_OWNER + 1) {
            let slot = index.open(&format!("o{n}:1"));
            let fps: Vec<u64> = per_owner.iter().map(|fp| fp + (n as u64) * (1 << 32)).collect();
            overflowed += usize::from(index.apply(slot, &snapshot(&fps)));
        }
        assert!(overflowed >= 1);
        assert!(index.len() <= MAX_ENTRIES);
    }
}
