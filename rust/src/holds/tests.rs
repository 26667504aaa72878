//! The hold book's unit tests.

use super::*;

const TTL: Duration = Duration::from_secs(120);
const CLAIM: Duration = Duration::from_secs(30);

fn book_with(turns: &[(&str, &[u64])], now: Instant) -> HoldBook {
    let mut book = HoldBook::new();
    for (id, fps) in turns {
        let offer = format!("offer-{id}").into_bytes();
        assert_eq!(
            book.hold(id, HoldKind::Turn, fps.len(), fps.to_vec(), 0, offer, now + TTL, now),
            Ok(())
        );
    }
    book
}

fn prompt_hold(book: &mut HoldBook, id: &str, fps: &[u64], now: Instant) {
    assert_eq!(
        book.hold(id, HoldKind::ForDecode, fps.len(), fps.to_vec(), 0, vec![], now + TTL, now),
        Ok(())
    );
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
fn the_engines_granted_a_prompt_held_for_a_decode_node_are_named_by_its_end() {
    let t0 = Instant::now();
    let mut book = book_with(&[("turn", &[1, 2, 3])], t0);
    prompt_hold(&mut book, "p1", &[1, 2, 3], t0);
    // Refused grants, and turns found or granted, name nobody.
    assert_eq!(book.grant("d9#1", "p1", &[7], CLAIM, t0), Err(Refusal::Mismatch));
    assert!(book.lookup("d8#1", &[1, 2, 3], CLAIM, t0).is_some());
    assert!(book.grant("d8#1", "turn", &[1, 2, 3], CLAIM, t0).is_ok());
    assert!(book.handed_to(3).is_empty());
    // A granted engine is named by its id, once over several connections.
    assert!(book.grant("d1#4", "p1", &[1, 2, 3], CLAIM, t0).is_ok());
    assert!(book.grant("d1#5", "p1", &[1, 2], CLAIM, t0).is_ok());
    assert_eq!(book.handed_to(3), ["d1"]);
    assert!(book.handed_to(2).is_empty(), "by the prompt's end only");
    // The same prompt held again for a decode node: which engine computes which turn is
    // not known any more.
    prompt_hold(&mut book, "p2", &[1, 2, 3], t0);
    assert!(book.grant("d2#1", "p2", &[1, 2, 3], CLAIM, t0).is_ok());
    assert!(book.handed_to(3).is_empty());
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
    assert_eq!(book.ended.order.len(), MAX_ENDED_KEPT);
    assert_eq!(book.ended.ids.len(), MAX_ENDED_KEPT);
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
    assert_eq!(
        book.hold("new", HoldKind::Turn, 4, vec![3, 4, 5, 6], 0, vec![], t1 + TTL, t1),
        Ok(())
    );
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
fn after_a_weight_change_no_hold_taken_before_it_is_granted_and_each_is_freed_once() {
    let t0 = Instant::now();
    let mut book = book_with(&[("turn", &[1, 2]), ("read", &[3])], t0);
    prompt_hold(&mut book, "prompt", &[7, 8], t0);
    prompt_hold(&mut book, "claimed", &[9], t0);
    let turn_claim = book.lookup("P", &[3], CLAIM, t0).unwrap();
    let prompt_claim = book.grant("D", "claimed", &[9], CLAIM, t0).unwrap();
    // The weights change: unclaimed holds are freed at once, whatever `num_blocks` says.
    let mut freed = book.evict(0, Evict::Stale, t0);
    freed.sort();
    assert_eq!(freed, ["prompt", "turn"]);
    // Nothing taken before is granted or found again, claimed or not.
    for (id, fps) in
        [("turn", &[1u64, 2][..]), ("prompt", &[7, 8]), ("claimed", &[9]), ("read", &[3])]
    {
        assert_eq!(book.grant("D2", id, fps, CLAIM, t0), Err(Refusal::Ended), "{id}");
    }
    assert!(book.lookup("P2", &[3], CLAIM, t0).is_none());
    assert!(book.lookup("P2", &[1, 2], CLAIM, t0).is_none());
    // The claimed ones stay allocated under their reads, and are freed once each as those end.
    assert_eq!(book.held_blocks(), 2);
    assert_eq!(book.release("D", "claimed", prompt_claim.claim_id, t0), Some("claimed".into()));
    assert_eq!(book.release("P", "read", turn_claim.claim_id, t0), Some("read".into()));
    assert!(book.is_empty() && book.evict(0, Evict::Stale, t0).is_empty());
    // A hold taken after the change is granted as any.
    book.hold("after", HoldKind::Turn, 1, vec![3], 0, vec![], t0 + TTL, t0).unwrap();
    assert_eq!(book.lookup("P", &[3], CLAIM, t0).unwrap().owner_request_id, "after");
}

#[test]
fn after_a_weight_change_its_readers_are_waited_for_until_each_released_or_its_deadline() {
    let t0 = Instant::now();
    let mut book = book_with(&[("turn", &[1, 2]), ("read", &[3]), ("later", &[4])], t0);
    assert_eq!(book.ended_claims_until(t0), None);
    book.lookup("P", &[3], Duration::from_secs(2), t0).unwrap();
    let long = book.lookup("P2", &[4], CLAIM, t0).unwrap();
    // Claims on holds that did not end keep no one waiting.
    assert_eq!(book.ended_claims_until(t0), None);
    book.evict(0, Evict::Stale, t0);
    assert_eq!(book.ended_claims_until(t0), Some(t0 + CLAIM));
    assert_eq!(book.release("P2", "later", long.claim_id, t0), Some("later".into()));
    assert_eq!(book.ended_claims_until(t0), Some(t0 + Duration::from_secs(2)));
    // Past its deadline a claim keeps no one waiting, expired or not yet.
    let t1 = t0 + Duration::from_secs(2);
    assert_eq!(book.ended_claims_until(t1), None);
    assert_eq!(book.expire(t1), ["read"]);
    assert!(book.is_empty());
}

#[test]
fn holds_are_checked() {
    let t0 = Instant::now();
    let mut book = book_with(&[("a", &[1])], t0);
    assert_eq!(
        book.hold("a", HoldKind::Turn, 1, vec![], 0, vec![], t0 + TTL, t0),
        Err(HoldError::AlreadyHeld("a".into()))
    );
    let too_many = vec![0; MAX_FINGERPRINTS + 1];
    assert!(matches!(
        book.hold("b", HoldKind::Turn, 1, too_many, 0, vec![], t0 + TTL, t0),
        Err(HoldError::TooManyFingerprints(_))
    ));
    let huge = vec![0; MAX_OFFER_BYTES + 1];
    assert!(matches!(
        book.hold("b", HoldKind::Turn, 1, vec![], 0, huge, t0 + TTL, t0),
        Err(HoldError::OfferTooLarge(_))
    ));
    // A TTL that overflows Instant is a hold that lasts, not a panic.
    assert_eq!(
        book.hold("c", HoldKind::ForDecode, 1, vec![], 0, vec![], later(t0, Duration::MAX), t0),
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
            book.hold(
                &format!("t{n}"),
                HoldKind::Turn,
                2,
                vec![1, 1000 + n],
                0,
                vec![],
                t0 + TTL,
                t0
            ),
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
    assert_eq!(book.hold("b", HoldKind::Turn, 3, vec![1, 2, 3], 0, vec![], t0 + TTL, t0), Ok(()));
    let (next, updates) = book.held_since(Some(cursor));
    assert_eq!(updates, vec![HeldUpdate { held: vec![1, 2, 3], ..HeldUpdate::default() }]);
    assert_eq!(book.evict(1, Evict::Turns, t0), vec!["a".to_string()]);
    let (_, updates) = book.held_since(Some(next));
    assert_eq!(updates, vec![HeldUpdate { freed: vec![1, 2], ..HeldUpdate::default() }]);
    // A snapshot counts a fingerprint once per turn that has it.
    assert_eq!(book.hold("c", HoldKind::Turn, 1, vec![1], 0, vec![], t0 + TTL, t0), Ok(()));
    let mut held = book.held_since(None).1[0].held.clone();
    held.sort_unstable();
    assert_eq!(held, vec![1, 1, 2, 3]);
}

#[test]
fn a_long_turn_is_announced_by_some_blocks_and_answered_by_all() {
    // 40 blocks, the prompt's 21: announced are blocks 0, 15, 20 (the prompt's end), 31 and the
    // last two, in the update, in a snapshot and when freed; a lookup still matches all 40,
    // and a prompt that shares 25 of them (none of 21..25 announced) too.
    let t0 = Instant::now();
    let mut book = HoldBook::default();
    let (cursor, _) = book.held_since(None);
    let turn: Vec<u64> = (100..140).collect();
    let offer = b"offer".to_vec();
    assert_eq!(book.hold("t", HoldKind::Turn, 40, turn.clone(), 21, offer, t0 + TTL, t0), Ok(()));
    let announced = vec![100, 115, 120, 131, 138, 139];
    let (next, updates) = book.held_since(Some(cursor));
    assert_eq!(updates, vec![HeldUpdate { held: announced.clone(), ..HeldUpdate::default() }]);
    let mut snapshot = book.held_since(None).1[0].held.clone();
    snapshot.sort_unstable();
    assert_eq!(snapshot, announced);
    assert_eq!(book.lookup("P", &turn, CLAIM, t0).unwrap().matched_blocks, 40);
    let mut shared = turn[..25].to_vec();
    shared.push(7);
    assert_eq!(book.lookup("Q", &shared, CLAIM, t0).unwrap().matched_blocks, 25);
    assert_eq!(book.expire(t0 + TTL + CLAIM), vec!["t".to_string()]);
    let (_, updates) = book.held_since(Some(next));
    assert_eq!(updates, vec![HeldUpdate { freed: announced, ..HeldUpdate::default() }]);
}

#[test]
fn index_is_cleaned_when_turns_are_freed() {
    let t0 = Instant::now();
    let mut book = book_with(&[("a", &[1, 2]), ("b", &[1, 3])], t0);
    assert_eq!(book.expire(t0 + TTL).len(), 2);
    assert!(book.index.is_empty() && book.names.is_empty());
}

#[test]
fn a_lookup_continuing_a_turn_being_computed_is_awaited_until_the_turn_is_settled() {
    let t0 = Instant::now();
    let mut book = book_with(&[("older", &[1])], t0);
    // The turn's prompt: blocks 1, 2 and a partial block, whose end is 20.
    assert_eq!(book.expect("turn", 20), Ok(()));
    // The next turn continues it: ask again, even though an older turn holds part of it. A
    // lookup that names no end, or another, is answered at once.
    assert!(book.awaited(&[1, 2, 3], Some(20)));
    assert!(!book.awaited(&[1, 2, 3], None));
    assert!(!book.awaited(&[1, 2, 3], Some(21)));
    assert_eq!(
        book.hold("turn", HoldKind::Turn, 3, vec![1, 2, 3], 0, vec![], t0 + TTL, t0),
        Ok(())
    );
    assert!(!book.awaited(&[1, 2, 3], Some(20)), "held: nothing more to wait for");
    assert!(book.awaited(&[1, 2, 3, 4], Some(20)), "expected until settled");
    assert!(book.settle("turn"));
    assert!(!book.settle("turn"));
    assert!(!book.awaited(&[1, 2, 3, 4], Some(20)));
    let found = book.lookup("P", &[1, 2, 3, 4], CLAIM, t0).expect("the held turn");
    assert_eq!((found.owner_request_id.as_str(), found.matched_blocks), ("turn", 3));
    // Settled without a hold (aborted, or not offered): nothing is awaited.
    assert_eq!(book.expect("gone", 50), Ok(()));
    assert!(book.awaited(&[5, 6], Some(50)));
    assert!(book.settle("gone"));
    assert!(!book.awaited(&[5, 6], Some(50)));
    assert!(!book.awaited(&vec![5; MAX_FINGERPRINTS + 1], Some(50)));
    assert_eq!(book.num_awaited(), 3, "each ask told to ask again is counted");
}

#[test]
fn expected_turns_are_bounded_and_a_held_request_is_not_expected() {
    let t0 = Instant::now();
    let mut book = book_with(&[("held", &[1])], t0);
    assert_eq!(book.expect("held", 10), Ok(()));
    assert!(!book.awaited(&[1, 2], Some(10)), "a held request is not expected again");
    for i in 0..MAX_EXPECTED as u64 {
        assert_eq!(book.expect(&format!("r{i}"), 100 + i), Ok(()));
    }
    assert_eq!(book.expect("one more", 7), Err(HoldError::TooManyExpected));
    assert_eq!(book.expect("r0", 100), Ok(()), "expected already: left as it is");
    assert!(book.settle("r0"));
    assert_eq!(book.expect("one more", 7), Ok(()));
}

#[test]
fn a_prompt_held_for_a_decode_node_is_renewed_up_to_its_cap_and_nothing_else_is() {
    let t0 = Instant::now();
    let lease = Duration::from_secs(2);
    let mut book = book_with(&[("turn", &[1])], t0);
    for id in ["p1", "p2", "p3"] {
        book.hold(id, HoldKind::ForDecode, 2, vec![5, 6], 0, vec![], t0 + lease, t0).unwrap();
    }
    // Renewed by the first lease's length from now, again and again: it outlives its lease.
    let t1 = t0 + Duration::from_millis(1500);
    assert_eq!(book.renew("p1", 5, t1), Some(t1 + lease));
    let t2 = t0 + Duration::from_millis(3000);
    assert_eq!(book.renew("p1", 5, t2), Some(t2 + lease));
    let mut expired = book.expire(t0 + lease + Duration::from_millis(1));
    expired.sort();
    assert_eq!(expired, vec!["p2", "p3"]);
    // Never past MAX_RENEWED_LIFE first leases from when it was taken.
    let cap = t0 + lease * MAX_RENEWED_LIFE;
    let mut now = t2;
    while now < cap {
        assert!(book.renew("p1", 5, now).unwrap() <= cap);
        now += Duration::from_millis(1500);
    }
    assert_eq!(book.renew("p1", 5, cap - Duration::from_millis(1)), Some(cap));
    assert_eq!(book.expire(cap), vec!["p1"]);
    // Unknown, ended, past its lease, another reader's tokens, a turn, a claimed prompt: no.
    book.hold("p4", HoldKind::ForDecode, 2, vec![5, 6], 0, vec![], cap + lease, cap).unwrap();
    assert_eq!(book.renew("p1", 5, cap), None, "ended");
    assert_eq!(book.renew("p3", 5, t1), None, "ended");
    assert_eq!(book.renew("nobody", 5, cap), None);
    assert_eq!(book.renew(&"x".repeat(MAX_REQUEST_ID_BYTES + 1), 5, cap), None);
    assert_eq!(book.renew("p4", 6, cap), None, "other tokens in the first block");
    assert_eq!(book.renew("p4", 5, cap + lease), None, "past its lease, not expired yet");
    assert_eq!(book.renew("turn", 1, t0), None, "turns are not renewed");
    let claim = book.grant("D#1", "p4", &[5, 6], CLAIM, cap).unwrap();
    assert_eq!(book.renew("p4", 5, cap), None, "claimed: the claim keeps it");
    assert_eq!(book.release("D#1", "p4", claim.claim_id, cap), Some("p4".into()));
    assert_eq!(book.renew("p4", 5, cap), None, "read");
}
