//! Two engines in one process over real UCX and real side channels: the Rust-level contract of
//! connect → read_blocks → notification, and its refusals. Cross-process behaviour (dead
//! peers, transports) is covered by tests/test_transfer.py.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvduplex::descriptors::{BlockLayout, BlockSlice, PlanError, Side};
use kvduplex::engine::{Engine, EngineError, LookupFanOut, PeerStatus, RegionMemory};
use kvduplex::handshake::{Fingerprint, HandshakeError};
use kvduplex::holds::{Evict, HoldKind, LookupMatch};

use common::TestEngine;

const BLOCK: usize = 4096;
const BLOCKS: usize = 64;
const TIMEOUT: Duration = Duration::from_secs(5);

fn fingerprint(dtype: &str) -> Fingerprint {
    Fingerprint(BTreeMap::from([
        ("model".to_string(), "tiny".to_string()),
        ("dtype".to_string(), dtype.to_string()),
    ]))
}

/// An engine over `buf` that reads its peers through UCX (every engine here shares one
/// process, which same-host reads would read directly).
fn engine(id: &str, dtype: &str, buf: Vec<u8>) -> TestEngine {
    engine_reading(id, dtype, buf, false)
}

fn engine_reading(id: &str, dtype: &str, buf: Vec<u8>, same_host_reads: bool) -> TestEngine {
    engine_paged(id, dtype, buf, same_host_reads, BLOCK)
}

/// An engine over `buf` cut into `buf.len() / block` blocks of `block` bytes.
fn engine_paged(
    id: &str,
    dtype: &str,
    buf: Vec<u8>,
    same_host_reads: bool,
    block: usize,
) -> TestEngine {
    engine_at(id, dtype, buf, same_host_reads, block, 0)
}

/// [`engine_paged`] with its side channel on `port` (0: a free one).
fn engine_at(
    id: &str,
    dtype: &str,
    buf: Vec<u8>,
    same_host_reads: bool,
    block: usize,
    port: u16,
) -> TestEngine {
    common::test_engine(id, fingerprint(dtype), buf, same_host_reads, block, port)
}

fn connect(reader: &Engine, owner: &Engine) -> Result<String, EngineError> {
    let addr = owner.side_channel_addr().unwrap();
    reader.connect(&addr.ip().to_string(), addr.port(), Duration::from_secs(5))
}

#[test]
fn read_copies_blocks_and_notifies_the_owner_once() {
    read_and_notify(false);
}

#[test]
fn a_same_host_read_copies_blocks_and_notifies_the_owner_once() {
    read_and_notify(true);
}

fn read_and_notify(same_host_reads: bool) {
    let owner = engine("owner", "f32", (0..BLOCK * BLOCKS).map(|i| (i * 7 % 253) as u8).collect());
    let reader = engine_reading("reader", "f32", vec![0u8; BLOCK * BLOCKS], same_host_reads);
    let peer = connect(&reader, &owner).unwrap();
    assert!(peer.starts_with("owner@127.0.0.1:"), "{peer}");
    let transfer = reader
        .read_blocks(
            &peer,
            &[1, 2, 3, 9],
            &[10, 11, 12, 40],
            Some(b"req-1".to_vec()),
            Duration::from_secs(10),
            None,
            None,
        )
        .unwrap();
    assert_eq!(transfer.same_host(), same_host_reads);
    transfer.wait(Some(Duration::from_secs(10))).unwrap();
    assert_eq!(transfer.num_descriptors, 2);
    for (l, r) in [(1, 10), (2, 11), (3, 12), (9, 40)] {
        assert_eq!(
            reader.buf()[l * BLOCK..(l + 1) * BLOCK],
            owner.buf()[r * BLOCK..(r + 1) * BLOCK]
        );
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut notes = Vec::new();
    while notes.is_empty() && Instant::now() < deadline {
        notes.extend(owner.take_notifications());
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(50));
    notes.extend(owner.take_notifications());
    assert_eq!(notes.len(), 1);
    assert!(notes[0].sender.starts_with("reader#"), "{}", notes[0].sender);
    assert_eq!(notes[0].payload, b"req-1");
}

fn slice(remote_offset: usize, local_offset: usize, len: usize) -> Option<BlockSlice> {
    Some(BlockSlice {
        remote_offset: remote_offset as u64,
        local_offset: local_offset as u64,
        len: len as u64,
    })
}

#[test]
fn a_sliced_read_copies_the_second_half_of_each_remote_block_into_the_first_half_of_local_ones() {
    sliced_read(false);
}

#[test]
fn a_same_host_sliced_read_copies_the_second_half_of_each_remote_block_into_the_first_half_of_local_ones(
) {
    sliced_read(true);
}

fn sliced_read(same_host_reads: bool) {
    let half = BLOCK / 2;
    let owner = engine("owner", "f32", (0..BLOCK * BLOCKS).map(|i| (i * 7 % 253) as u8).collect());
    let reader = engine_reading("reader", "f32", vec![0u8; BLOCK * BLOCKS], same_host_reads);
    let peer = connect(&reader, &owner).unwrap();
    // Runs on both sides, which whole blocks would read as two descriptors.
    let (lids, rids) = ([1i64, 2, 3, 9], [10i64, 11, 12, 40]);
    let transfer = reader
        .read_blocks(
            &peer,
            &lids,
            &rids,
            Some(b"sliced".to_vec()),
            Duration::from_secs(10),
            None,
            slice(half, 0, half),
        )
        .unwrap();
    assert_eq!(transfer.same_host(), same_host_reads);
    transfer.wait(Some(Duration::from_secs(10))).unwrap();
    assert_eq!(transfer.num_descriptors, 4, "sliced reads are never coalesced");
    assert_eq!(transfer.nbytes, 4 * half as u64);
    for (&l, &r) in lids.iter().zip(&rids) {
        let (l, r) = (l as usize, r as usize);
        assert_eq!(
            reader.buf()[l * BLOCK..l * BLOCK + half],
            owner.buf()[r * BLOCK + half..(r + 1) * BLOCK],
            "block {l} <- {r}"
        );
        assert!(
            reader.buf()[l * BLOCK + half..(l + 1) * BLOCK].iter().all(|&b| b == 0),
            "second half of local block {l} was written"
        );
    }
    let touched: Vec<usize> = lids.iter().map(|&l| l as usize).collect();
    for b in (0..BLOCKS).filter(|b| !touched.contains(b)) {
        assert!(
            reader.buf()[b * BLOCK..(b + 1) * BLOCK].iter().all(|&x| x == 0),
            "untouched local block {b} was written"
        );
    }
}

/// Heterogeneous TP: P at TP=1 with 4 KiB pages, D at TP=2 with 2 KiB pages (D's rank 1 reads
/// the second half of each of P's pages into its whole pages), and the converse (D at TP=1
/// with 8 KiB pages reads P's whole 4 KiB page into the second half of its own).
#[test]
fn sliced_reads_between_engines_of_different_page_sizes() {
    for same_host_reads in [false, true] {
        let owner =
            engine("owner", "f32", (0..BLOCK * BLOCKS).map(|i| (i * 13 % 251) as u8).collect());

        let small = BLOCK / 2;
        let reader =
            engine_paged("rank1", "f32", vec![0u8; small * BLOCKS], same_host_reads, small);
        let peer = connect(&reader, &owner).unwrap();
        let transfer = reader
            .read_blocks(
                &peer,
                &[0, 5, 6],
                &[3, 4, 63],
                None,
                Duration::from_secs(10),
                None,
                slice(small, 0, small),
            )
            .unwrap();
        assert_eq!(transfer.same_host(), same_host_reads);
        transfer.wait(Some(Duration::from_secs(10))).unwrap();
        for (l, r) in [(0usize, 3usize), (5, 4), (6, 63)] {
            assert_eq!(
                reader.buf()[l * small..(l + 1) * small],
                owner.buf()[r * BLOCK + small..(r + 1) * BLOCK],
                "{same_host_reads}: {l} <- {r}"
            );
        }
        drop(reader);

        let big = BLOCK * 2;
        let reader = engine_paged("tp1", "f32", vec![0u8; big * BLOCKS / 2], same_host_reads, big);
        let peer = connect(&reader, &owner).unwrap();
        // Without a slice, an 8 KiB local block takes two 4 KiB remote ones.
        let err = reader
            .read_blocks(&peer, &[2], &[7], None, Duration::from_secs(1), None, None)
            .err()
            .expect("refused");
        assert!(matches!(err, EngineError::Plan(PlanError::IdCountMismatch { .. })), "{err}");
        let transfer = reader
            .read_blocks(
                &peer,
                &[2, 31],
                &[7, 8],
                None,
                Duration::from_secs(10),
                None,
                slice(0, BLOCK, BLOCK),
            )
            .unwrap();
        assert_eq!(transfer.same_host(), same_host_reads);
        transfer.wait(Some(Duration::from_secs(10))).unwrap();
        for (l, r) in [(2usize, 7usize), (31, 8)] {
            assert!(
                reader.buf()[l * big..l * big + BLOCK].iter().all(|&b| b == 0),
                "{same_host_reads}: first half of {l} was written"
            );
            assert_eq!(
                reader.buf()[l * big + BLOCK..(l + 1) * big],
                owner.buf()[r * BLOCK..(r + 1) * BLOCK],
                "{same_host_reads}: {l} <- {r}"
            );
        }
        drop(reader);
        drop(owner);
    }
}

#[test]
fn slices_outside_a_block_are_refused_before_posting() {
    let owner = engine("owner", "f32", vec![1u8; BLOCK * BLOCKS]);
    let reader = engine("reader", "f32", vec![0u8; BLOCK * BLOCKS]);
    let peer = connect(&reader, &owner).unwrap();
    let refused = |s: Option<BlockSlice>| {
        reader
            .read_blocks(&peer, &[1], &[1], None, Duration::from_secs(1), None, s)
            .err()
            .expect("refused")
    };
    assert!(matches!(
        refused(slice(1, 0, BLOCK)),
        EngineError::Plan(PlanError::SliceOutsideBlock { side: Side::Remote, .. })
    ));
    assert!(matches!(
        refused(slice(0, BLOCK, 1)),
        EngineError::Plan(PlanError::SliceOutsideBlock { side: Side::Local, .. })
    ));
    assert!(matches!(refused(slice(0, 0, 0)), EngineError::Plan(PlanError::EmptySlice)));
    let wrapping = Some(BlockSlice { remote_offset: u64::MAX, local_offset: 0, len: 2 });
    assert!(matches!(refused(wrapping), EngineError::Plan(PlanError::SliceOutsideBlock { .. })));
    assert!(reader.buf().iter().all(|&b| b == 0));
}

#[test]
fn out_of_range_ids_are_refused_before_posting() {
    let owner = engine("owner", "f32", vec![1u8; BLOCK * BLOCKS]);
    let reader = engine("reader", "f32", vec![0u8; BLOCK * BLOCKS]);
    let peer = connect(&reader, &owner).unwrap();
    for (l, r) in [(vec![1], vec![BLOCKS as i64]), (vec![-1], vec![1]), (vec![1, 2], vec![1])] {
        let err = reader
            .read_blocks(&peer, &l, &r, None, Duration::from_secs(1), None, None)
            .err()
            .expect("refused");
        assert!(matches!(err, EngineError::Plan(_)), "{err}");
    }
    assert!(reader.buf().iter().all(|&b| b == 0));
}

#[test]
fn incompatible_fingerprint_is_refused_naming_the_field() {
    let owner = engine("owner", "f16", vec![1u8; BLOCK * BLOCKS]);
    let reader = engine("reader", "f32", vec![0u8; BLOCK * BLOCKS]);
    let err = connect(&reader, &owner).unwrap_err();
    assert!(
        matches!(err, EngineError::Handshake(HandshakeError::Incompatible { ref field, .. }) if field == "dtype"),
        "{err}"
    );
}

#[test]
fn close_is_prompt_and_idempotent_with_a_connected_peer() {
    let mut owner = engine("owner", "f32", vec![1u8; BLOCK * BLOCKS]);
    let mut reader = engine("reader", "f32", vec![0u8; BLOCK * BLOCKS]);
    connect(&reader, &owner).unwrap();
    let start = Instant::now();
    owner.close();
    reader.close();
    reader.close();
    assert!(start.elapsed() < Duration::from_secs(10), "close hung for {:?}", start.elapsed());
    assert!(matches!(
        // SAFETY: the reader's own buffer, which outlives it (TestEngine).
        reader.register_region(unsafe { RegionMemory::new(reader.buf().as_ptr() as u64, 8) }),
        Err(EngineError::Closed)
    ));
}

/// An owner holding the 3-block turn "turn-1" (token fingerprints 11, 12, 13, offer
/// "params") for a minute, and a reader not connected to it yet.
fn owner_holding_a_turn_and_reader() -> (TestEngine, TestEngine) {
    let owner = engine("owner", "f32", vec![3u8; BLOCK * BLOCKS]);
    let reader = engine("reader", "f32", vec![0u8; BLOCK * BLOCKS]);
    owner
        .hold(
            "turn-1",
            HoldKind::Turn,
            3,
            vec![11, 12, 13],
            0,
            b"params".to_vec(),
            Instant::now() + Duration::from_secs(60),
        )
        .unwrap();
    (owner, reader)
}

#[test]
fn a_reader_finds_a_held_turn_by_content_and_the_owner_learns_where_it_listens() {
    let (owner, reader) = owner_holding_a_turn_and_reader();
    assert!(owner.known_peers().is_empty());
    let peer = connect(&reader, &owner).unwrap();
    // The owner's directory now names the reader and its own side channel (the owner's
    // connection thread records it right after the handshake).
    let deadline = Instant::now() + Duration::from_secs(5);
    while owner.known_peers().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let known = owner.known_peers();
    let reader_addr = reader.side_channel_addr().unwrap();
    assert_eq!(known.len(), 1);
    assert_eq!(known[0].engine_id, "reader");
    assert_eq!(known[0].side_channel, format!("127.0.0.1:{}", reader_addr.port()));
    let owner_addr = owner.side_channel_addr().unwrap();
    let target = vec![("127.0.0.1".to_string(), owner_addr.port())];
    let ask = |fingerprints: Vec<u64>| {
        let (owner_id, found) = only_answer(&reader.start_lookup(
            target.clone(),
            fingerprints,
            None,
            None,
            Duration::from_secs(5),
        ));
        assert_eq!(owner_id, "owner");
        found
    };
    let found = ask(vec![11, 12, 99]).expect("held");
    assert_eq!((found.owner_request_id.as_str(), found.matched_blocks), ("turn-1", 2));
    assert_eq!(found.offer, b"params");
    assert!(ask(vec![99]).is_none());
    // The claim belongs to the reader's connection: neither another engine nor another
    // connection announcing the reader's engine id can end it.
    assert!(!owner.release_hold("someone-else", "turn-1", found.claim_id));
    assert!(!owner.release_hold("reader", "turn-1", found.claim_id));
    reader.notify(&peer, b"done").unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut notes = owner.take_notifications();
    while notes.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
        notes = owner.take_notifications();
    }
    let sender = notes.first().expect("the reader's notification").sender.clone();
    assert!(sender.starts_with("reader#"), "{sender}");
    // A release ends the reader's claim, never the turn: it is still offered.
    assert!(!owner.release_hold(&sender, "turn-1", found.claim_id));
    assert_eq!(ask(vec![11]).expect("still held").owner_request_id, "turn-1");
    assert!(owner.evict_holds(1, Evict::Turns).is_empty(), "a claimed turn is not evicted");
}

#[test]
fn a_named_grant_waits_for_a_hold_the_owner_takes_late_and_checks_the_readers_tokens() {
    let owner = engine("owner", "f32", vec![3u8; BLOCK * BLOCKS]);
    let reader = engine("reader", "f32", vec![0u8; BLOCK * BLOCKS]);
    let target = vec![("127.0.0.1".to_string(), owner.side_channel_addr().unwrap().port())];
    let ask = |fingerprints: Vec<u64>, name: &str| {
        only_answer(&reader.start_lookup(
            target.clone(),
            fingerprints,
            Some(name.to_owned()),
            None,
            Duration::from_secs(5),
        ))
        .1
    };
    // The grant is asked before the owner holds the prompt (its engine takes a hold one step
    // after answering the request, and a starved engine's step was seen to take seconds):
    // asked again until the hold is there, within the grant's timeout.
    std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(2500));
            owner
                .hold(
                    "p-1",
                    HoldKind::ForDecode,
                    3,
                    vec![11, 12, 13],
                    0,
                    b"params".to_vec(),
                    Instant::now() + Duration::from_secs(60),
                )
                .unwrap();
        });
        let granted = ask(vec![11, 12, 13], "p-1").expect("granted once held");
        assert_eq!(
            (granted.owner_request_id.as_str(), granted.matched_blocks, granted.offer.as_slice()),
            ("p-1", 3, &b"params"[..])
        );
    });
    // Another prompt's tokens naming the hold: refused at once. A prompt held for a decode
    // node is not found by content.
    let refused_at = Instant::now();
    assert!(ask(vec![99, 12, 13], "p-1").is_none());
    assert!(refused_at.elapsed() < Duration::from_millis(500), "a refusal is not retried");
    assert!(only_answer(&reader.start_lookup(
        target.clone(),
        vec![11],
        None,
        None,
        Duration::from_secs(5)
    ))
    .1
    .is_none());
    // A hold that is never taken: asked for until the grant's timeout, then nothing.
    let asked_at = Instant::now();
    let never = reader.start_lookup(
        target,
        vec![11],
        Some("p-never".to_owned()),
        None,
        Duration::from_millis(600),
    );
    assert!(only_answer(&never).1.is_none());
    assert!(asked_at.elapsed() >= Duration::from_millis(500), "gave up before its timeout");
}

/// The one target's answer to a lookup (waiting up to 10 s): the owner's id and its match.
fn only_answer(fan_out: &LookupFanOut) -> (String, Option<LookupMatch>) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let [Some(answer)] = fan_out.answers().as_slice() {
            return answer.outcome.clone().unwrap();
        }
        assert!(Instant::now() < deadline, "no answer");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_lookup_connects_to_an_owner_it_does_not_know_yet_and_reports_one_it_cannot_reach() {
    let (owner, reader) = owner_holding_a_turn_and_reader();
    let owner_port = owner.side_channel_addr().unwrap().port();
    let nobody = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let targets = vec![("127.0.0.1".to_string(), owner_port), ("127.0.0.1".to_string(), nobody)];
    let fan_out = reader.start_lookup(targets, vec![11, 12], None, None, Duration::from_secs(1));
    let deadline = Instant::now() + Duration::from_secs(10);
    let answers = loop {
        let answers = fan_out.answers();
        if answers.iter().all(Option::is_some) {
            break answers;
        }
        assert!(Instant::now() < deadline, "not every target answered: {answers:?}");
        std::thread::sleep(Duration::from_millis(2));
    };
    let (owner_id, found) = answers[0].as_ref().unwrap().outcome.clone().unwrap();
    assert_eq!((owner_id.as_str(), found.map(|m| m.matched_blocks)), ("owner", Some(2)));
    let unreachable = answers[1].as_ref().unwrap();
    assert_eq!(unreachable.address, format!("127.0.0.1:{nobody}"));
    assert!(unreachable.outcome.is_err(), "{unreachable:?}");
}

/// Every target's answer to a lookup (waiting up to 10 s).
fn all_answers(fan_out: &LookupFanOut) -> Vec<(String, Option<LookupMatch>)> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let answers = fan_out.answers();
        if answers.iter().all(Option::is_some) {
            return answers.into_iter().map(|a| a.unwrap().outcome.unwrap()).collect();
        }
        assert!(Instant::now() < deadline, "not every target answered: {answers:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Connects `reader` to every owner; their side channels, as lookup targets.
fn connect_all(reader: &Engine, owners: &[TestEngine]) -> Vec<(String, u16)> {
    let targets = owners
        .iter()
        .map(|o| ("127.0.0.1".to_string(), o.side_channel_addr().unwrap().port()))
        .collect();
    for owner in owners {
        connect(reader, owner).unwrap();
    }
    targets
}

/// Waits until a lookup of `fps` by `reader` asks `asked` of `targets` (the announcements
/// that spare the others are in).
fn wait_until_asked(reader: &Engine, targets: &[(String, u16)], fps: &[u64], asked: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while reader.start_lookup(targets.to_vec(), fps.to_vec(), None, None, TIMEOUT).asked() != asked
    {
        assert!(Instant::now() < deadline, "the announcements never came");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// After `delay`, `owner` holds the turn `id` it was computing (`fps`) and settles it.
fn hold_turn_after(owner: &Engine, id: &str, fps: Vec<u64>, delay: Duration) {
    std::thread::sleep(delay);
    owner.hold(id, HoldKind::Turn, fps.len(), fps, 0, vec![], Instant::now() + TIMEOUT).unwrap();
    owner.settle_turns(&[id.to_string()]);
}

#[test]
fn a_lookup_asks_only_the_owners_whose_announcements_hold_the_prompt() {
    let buf = || vec![3u8; BLOCK * BLOCKS];
    let reader = engine("reader", "f32", buf());
    let owners = [engine("a", "f32", buf()), engine("b", "f32", buf()), engine("c", "f32", buf())];
    let turn = |owner: &Engine, id: &str, fps: Vec<u64>| {
        let lease_ends = Instant::now() + Duration::from_secs(60);
        owner.hold(id, HoldKind::Turn, fps.len(), fps, 0, vec![], lease_ends).unwrap()
    };
    // a holds its turn before the reader connects (its snapshot), b after (an update).
    turn(&owners[0], "turn-a", vec![11, 12]);
    let targets = connect_all(&reader, &owners);
    turn(&owners[1], "turn-b", vec![21, 22, 23]);
    // Announcements take a moment: until they are in, owners are asked as before the index.
    let lookup =
        |fps: &[u64]| reader.start_lookup(targets.clone(), fps.to_vec(), None, None, TIMEOUT);
    // Looks `fps` up until `asked` owners are asked and `holder` alone answers with a match.
    let settled = |fps: &[u64], asked: usize, holder: Option<&str>| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let fan_out = lookup(fps);
            let answers = all_answers(&fan_out);
            let found: Vec<&str> =
                answers.iter().filter(|(_, m)| m.is_some()).map(|(o, _)| o.as_str()).collect();
            if fan_out.asked() == asked && found == holder.into_iter().collect::<Vec<_>>() {
                return answers;
            }
            assert!(Instant::now() < deadline, "asked {} owners for {fps:?}", fan_out.asked());
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    // b alone is asked; the others are answered at once, with no match.
    let answers = settled(&[21, 22, 23, 24], 1, Some("b"));
    let found: Vec<(&str, Option<u32>)> = answers
        .iter()
        .map(|(owner, found)| (owner.as_str(), found.as_ref().map(|m| m.matched_blocks)))
        .collect();
    assert_eq!(found, vec![("a", None), ("b", Some(3)), ("c", None)]);
    let answers = settled(&[11, 12, 13], 1, Some("a"));
    assert_eq!(answers[0].1.as_ref().map(|m| m.matched_blocks), Some(2));
    // A prompt no owner announced asks every owner (its holder's announcement may be late).
    settled(&[99], 3, None);
    // c holds a turn and frees it: both announced. (Its second block alone is announced but
    // matches no prompt's first block, so c is asked and claims nothing.)
    turn(&owners[2], "turn-c", vec![51, 52]);
    settled(&[52], 1, None);
    assert_eq!(owners[2].evict_holds(100, Evict::Turns), vec!["turn-c".to_string()]);
    settled(&[52], 3, None);
    // A named hold's owner is always asked.
    let named =
        reader.start_lookup(targets.clone(), vec![21], Some("turn-b".into()), None, TIMEOUT);
    assert_eq!(named.asked(), 3);
    // An owner the reader is not connected to is asked (and connected to) as before.
    let d = engine("d", "f32", buf());
    turn(&d, "turn-d", vec![41]);
    let with_d = vec![("127.0.0.1".to_string(), d.side_channel_addr().unwrap().port())];
    let fan_out = reader.start_lookup(with_d, vec![41], None, None, TIMEOUT);
    assert_eq!(fan_out.asked(), 1);
    assert_eq!(only_answer(&fan_out).1.map(|m| m.matched_blocks), Some(1));
}

#[test]
fn a_lookup_continuing_a_turn_the_owner_still_computes_waits_for_its_hold() {
    let buf = || vec![3u8; BLOCK * BLOCKS];
    let reader = engine("reader", "f32", buf());
    // a holds an older turn of the conversation; b computes the latest (whose prompt ends
    // with 120), and holds it late: a turn ended on a stop string is finished by an abort that
    // comes after the client has it.
    let owners = [engine("a", "f32", buf()), engine("b", "f32", buf())];
    owners[0]
        .hold("turn-0", HoldKind::Turn, 1, vec![11], 0, vec![], Instant::now() + TIMEOUT)
        .unwrap();
    owners[1].expect_turn("turn-1", 120).unwrap();
    let targets = connect_all(&reader, &owners);
    // Once a's announcement is in, a lookup that names no handoff asks a alone; one that
    // continues a handoff asks every owner (the one computing the turn announced none of it).
    wait_until_asked(&reader, &targets, &[11, 12, 13], 1);
    std::thread::scope(|scope| {
        let asked_at = Instant::now();
        let fan_out =
            reader.start_lookup(targets.clone(), vec![11, 12, 13, 14], None, Some(120), TIMEOUT);
        assert_eq!(fan_out.asked(), 2);
        scope.spawn(|| {
            hold_turn_after(&owners[1], "turn-1", vec![11, 12, 13, 14], Duration::from_millis(300))
        });
        let found: Vec<Option<u32>> = all_answers(&fan_out)
            .iter()
            .map(|(_, m)| m.as_ref().map(|m| m.matched_blocks))
            .collect();
        assert_eq!(found, vec![Some(1), Some(4)], "the whole prompt, once b held its turn");
        assert!(asked_at.elapsed() >= Duration::from_millis(300));
    });
    // A turn that ends without a hold (aborted before it was offered): the lookup is answered
    // with what is held once the owner settles it, well before its timeout.
    owners[1].expect_turn("turn-2", 220).unwrap();
    let b = targets[1..].to_vec();
    std::thread::scope(|scope| {
        let asked_at = Instant::now();
        let fan_out = reader.start_lookup(b.clone(), vec![21, 22, 23], None, Some(220), TIMEOUT);
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            owners[1].settle_turns(&["turn-2".to_string()]);
        });
        assert!(only_answer(&fan_out).1.is_none());
        let waited = asked_at.elapsed();
        assert!(waited >= Duration::from_millis(300) && waited < TIMEOUT, "{waited:?}");
    });
    // Never settled: asked again until the lookup's timeout, then nothing. A lookup that
    // continues another prompt is answered at once.
    owners[1].expect_turn("turn-3", 320).unwrap();
    let asked_at = Instant::now();
    let short = Duration::from_millis(400);
    assert!(only_answer(&reader.start_lookup(b.clone(), vec![31], None, Some(321), TIMEOUT))
        .1
        .is_none());
    assert!(asked_at.elapsed() < short, "not the computed turn's prompt: no wait");
    let fan_out = reader.start_lookup(b, vec![31, 32], None, Some(320), short);
    assert!(only_answer(&fan_out).1.is_none());
    assert!(asked_at.elapsed() >= short - Duration::from_millis(100), "gave up before its timeout");
}

#[test]
fn lookups_waiting_for_a_turn_in_flight_never_hold_up_another_answer_on_the_link() {
    let (owner, reader) = owner_holding_a_turn_and_reader();
    owner.expect_turn("in-flight", 500).unwrap();
    let target = vec![("127.0.0.1".to_string(), owner.side_channel_addr().unwrap().port())];
    connect(&reader, &owner).unwrap();
    // Many next turns wait for the turn in flight, each asked again and again over one link.
    let waiting: Vec<LookupFanOut> = (0..48)
        .map(|i| {
            let fps = vec![51, 52, 1000 + i];
            reader.start_lookup(target.clone(), fps, None, Some(500), Duration::from_secs(8))
        })
        .collect();
    // Long enough for their asks to be 64 ms apart (a link that waited between them would
    // now wait 48 x 64 ms before reading the next reply).
    std::thread::sleep(Duration::from_millis(1500));
    // Another prompt's answer comes in one round trip, not after their waits.
    let asked_at = Instant::now();
    let found = only_answer(&reader.start_lookup(target, vec![11, 12], None, None, TIMEOUT)).1;
    assert_eq!(found.map(|m| m.matched_blocks), Some(2));
    let took = asked_at.elapsed();
    assert!(took < Duration::from_millis(500), "held up for {took:?}");
    assert!(waiting.iter().all(|fan_out| fan_out.answers()[0].is_none()), "still waiting");
    owner.settle_turns(&["in-flight".to_string()]);
    for fan_out in &waiting {
        assert!(only_answer(fan_out).1.is_none(), "settled without a hold: nothing");
    }
}

fn status_until_settled(
    reader: &Engine,
    host: &str,
    port: u16,
    expected: Option<&str>,
) -> PeerStatus {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = reader.peer_status(host, port, expected, Duration::from_secs(2));
        if status != PeerStatus::Connecting || Instant::now() > deadline {
            return status;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn peer_status_connects_once_checks_identity_and_backs_off_after_a_failure() {
    let mut owner = engine("owner", "f32", vec![3u8; BLOCK * BLOCKS]);
    let reader = engine("reader", "f32", vec![0u8; BLOCK * BLOCKS]);
    let addr = owner.side_channel_addr().unwrap();
    let (host, port) = (addr.ip().to_string(), addr.port());

    // The first call starts the one handshake; callers meanwhile see it under way.
    assert_eq!(
        reader.peer_status(&host, port, Some("owner"), Duration::from_secs(2)),
        PeerStatus::Connecting
    );
    let handle = format!("owner@{host}:{port}#1");
    assert_eq!(
        status_until_settled(&reader, &host, port, Some("owner")),
        PeerStatus::Ready(handle.clone())
    );
    // A blocking connect uses the same connection.
    assert_eq!(reader.connect(&host, port, Duration::from_secs(1)).unwrap(), handle);
    // Another engine id than the params named is refused, without touching the connection.
    match reader.peer_status(&host, port, Some("someone-else"), Duration::from_secs(2)) {
        PeerStatus::Failed(reason) => {
            assert!(reason.contains("\"owner\", not \"someone-else\""), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    assert!(reader.peer_alive("owner") && reader.peer_alive(&handle));

    // The owner goes away: its link dies, the next status connects afresh and fails, and
    // until the backoff passes every caller is told at once, without a new attempt.
    owner.close();
    let deadline = Instant::now() + Duration::from_secs(5);
    while reader.peer_alive(&handle) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(!reader.peer_alive(&handle) && !reader.peer_alive("owner"));
    let failed = status_until_settled(&reader, &host, port, Some("owner"));
    assert!(matches!(failed, PeerStatus::Failed(_)), "{failed:?}");
    assert_eq!(reader.peer_status(&host, port, Some("owner"), Duration::from_secs(2)), failed);
    assert!(matches!(
        reader.connect(&host, port, Duration::from_millis(10)),
        Err(EngineError::ConnectFailed { .. })
    ));
}

#[test]
fn a_connect_to_a_mute_peer_never_delays_reads_from_another() {
    let owner = engine("owner", "f32", (0..BLOCK * BLOCKS).map(|i| (i % 251) as u8).collect());
    let reader = engine("reader", "f32", vec![0u8; BLOCK * BLOCKS]);
    let peer = connect(&reader, &owner).unwrap();
    // Accepts connections and never says a word.
    let mute = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mute_port = mute.local_addr().unwrap().port();
    std::thread::scope(|scope| {
        let stuck = scope.spawn(|| reader.connect("127.0.0.1", mute_port, Duration::from_secs(5)));
        // peer_status answers at once while that handshake waits.
        while reader.peer_status("127.0.0.1", mute_port, None, Duration::from_secs(5))
            != PeerStatus::Connecting
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        for round in 0..20u64 {
            let id = (round % (BLOCKS as u64 - 1)) as i64 + 1;
            reader
                .read_blocks(&peer, &[id], &[id], None, Duration::from_secs(5), None, None)
                .unwrap()
                .wait(Some(Duration::from_secs(5)))
                .unwrap();
        }
        // Twenty reads done while the connect to the mute peer is still waiting.
        assert!(!stuck.is_finished(), "the mute peer's handshake ended before the reads did");
        let err = stuck.join().unwrap().unwrap_err();
        assert!(err.to_string().contains("timed out"), "{err}");
    });
    assert_eq!(reader.buf()[BLOCK..2 * BLOCK], owner.buf()[BLOCK..2 * BLOCK]);
}

#[test]
fn a_second_engine_claiming_a_connected_peers_id_does_not_displace_it() {
    let owner = engine("owner", "f32", vec![0x11u8; BLOCK * BLOCKS]);
    let impostor = engine("owner", "f32", vec![0x22u8; BLOCK * BLOCKS]);
    let reader = engine("reader", "f32", vec![0u8; BLOCK * BLOCKS]);
    let real = connect(&reader, &owner).unwrap();
    // Another server, at another address, declares the same engine id.
    let fake = connect(&reader, &impostor).unwrap();
    reader
        .read_blocks(&real, &[1], &[1], None, Duration::from_secs(5), None, None)
        .unwrap()
        .wait(Some(Duration::from_secs(5)))
        .unwrap();
    assert!(
        reader.buf()[BLOCK..2 * BLOCK].iter().all(|&b| b == 0x11),
        "read from the engine that claimed the id last, not the one that was checked"
    );
    reader
        .read_blocks(&fake, &[2], &[2], None, Duration::from_secs(5), None, None)
        .unwrap()
        .wait(Some(Duration::from_secs(5)))
        .unwrap();
    assert!(reader.buf()[2 * BLOCK..3 * BLOCK].iter().all(|&b| b == 0x22));
    assert_ne!(real, fake, "each connection has its own handle");
    // The bare id is ambiguous now: refused, not guessed.
    let err = reader
        .read_blocks("owner", &[3], &[3], None, Duration::from_secs(5), None, None)
        .err()
        .expect("ambiguous");
    assert!(err.to_string().contains("all declare the id \"owner\""), "{err}");
}

#[test]
fn a_handle_reads_only_the_connection_that_was_checked_not_its_replacement() {
    let reader = engine("reader", "f32", vec![0u8; BLOCK * BLOCKS]);
    let mut first = engine("owner", "f32", vec![0x44u8; BLOCK * BLOCKS]);
    let port = first.side_channel_addr().unwrap().port();
    let checked = reader.connect("127.0.0.1", port, Duration::from_secs(5)).unwrap();
    // The owner restarts at the same address, under the same engine id, between the check and
    // the read.
    first.close();
    let deadline = Instant::now() + Duration::from_secs(5);
    while reader.peer_alive(&checked) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let second = engine_at("owner", "f32", vec![0x55u8; BLOCK * BLOCKS], false, BLOCK, port);
    let replacement = reader.connect("127.0.0.1", port, Duration::from_secs(5)).unwrap();
    assert_ne!(checked, replacement);
    let err = reader
        .read_blocks(&checked, &[1], &[1], None, Duration::from_secs(5), None, None)
        .err()
        .expect("the checked connection is gone");
    assert!(matches!(err, EngineError::PeerNotConnected(_)), "{err}");
    assert!(reader.buf().iter().all(|&b| b == 0), "nothing was read from the replacement");
    reader
        .read_blocks(&replacement, &[1], &[1], None, Duration::from_secs(5), None, None)
        .unwrap()
        .wait(Some(Duration::from_secs(5)))
        .unwrap();
    assert!(reader.buf()[BLOCK..2 * BLOCK].iter().all(|&b| b == 0x55));
    drop(second);
}

#[test]
fn a_lookup_continuing_a_handoff_asks_the_engine_granted_the_prompt_not_every_engine() {
    let buf = || vec![3u8; BLOCK * BLOCKS];
    let p = engine("p", "f32", buf());
    let decoders =
        [engine("d1", "f32", buf()), engine("d2", "f32", buf()), engine("d3", "f32", buf())];
    let lease_ends = || Instant::now() + TIMEOUT;
    // p hands two prompts off: d1 is granted the first (ends with 13), d3 the second (32).
    p.hold("prompt-1", HoldKind::ForDecode, 3, vec![11, 12, 13], 0, vec![], lease_ends()).unwrap();
    p.hold("prompt-2", HoldKind::ForDecode, 2, vec![31, 32], 0, vec![], lease_ends()).unwrap();
    for (reader, id, fps) in [(0, "prompt-1", vec![11, 12, 13]), (2, "prompt-2", vec![31, 32])] {
        let at_p = vec![("127.0.0.1".to_string(), p.side_channel_addr().unwrap().port())];
        let grant =
            decoders[reader].start_lookup(at_p, fps.clone(), Some(id.into()), None, TIMEOUT);
        assert_eq!(only_answer(&grant).1.map(|m| m.matched_blocks), Some(fps.len() as u32));
    }
    // d1 computes the turn after the first prompt; d2 holds a turn sharing its first block.
    decoders[0].expect_turn("turn-1", 13).unwrap();
    decoders[1].hold("other", HoldKind::Turn, 1, vec![11], 0, vec![], lease_ends()).unwrap();
    let targets = connect_all(&p, &decoders);
    wait_until_asked(&p, &targets, &[11, 12, 13, 14], 1);
    // The next turn's prompt continues the first: d1 (computing the turn, announced none of
    // it) and d2 (announced its first block) are asked, d3 is not.
    std::thread::scope(|scope| {
        let fan_out =
            p.start_lookup(targets.clone(), vec![11, 12, 13, 14], None, Some(13), TIMEOUT);
        assert_eq!(fan_out.asked(), 2);
        scope.spawn(|| {
            hold_turn_after(
                &decoders[0],
                "turn-1",
                vec![11, 12, 13, 14],
                Duration::from_millis(200),
            )
        });
        let found: Vec<(String, Option<u32>)> = all_answers(&fan_out)
            .into_iter()
            .map(|(owner, m)| (owner, m.map(|m| m.matched_blocks)))
            .collect();
        let expected = [("d1", Some(4)), ("d2", Some(1)), ("d3", None)];
        assert_eq!(found, expected.map(|(o, m)| (o.to_string(), m)));
    });
    // The second continues a prompt nobody announced any of: d3 alone is asked.
    let fan_out = p.start_lookup(targets.clone(), vec![31, 32, 33], None, Some(32), TIMEOUT);
    assert_eq!(fan_out.asked(), 1);
    assert!(all_answers(&fan_out).iter().all(|(_, m)| m.is_none()));
    // A handoff p granted nobody (or forgot): every engine, as before.
    let fan_out = p.start_lookup(targets.clone(), vec![41, 42], None, Some(42), TIMEOUT);
    assert_eq!(fan_out.asked(), 3);
    // Handed to an engine that is not among the targets: every target.
    let fan_out = p.start_lookup(targets[1..].to_vec(), vec![11, 12, 13], None, Some(13), TIMEOUT);
    assert_eq!(fan_out.asked(), 2);
}

/// Reads `remote` into `local` through `peer`: posted and settled, or why not.
fn read_one(reader: &Engine, peer: &str, local: i64, remote: i64) -> Result<(), String> {
    let transfer = reader
        .read_blocks(peer, &[local], &[remote], None, TIMEOUT, None, None)
        .map_err(|e| e.to_string())?;
    transfer.wait(Some(TIMEOUT)).map_err(|e| e.to_string())
}

#[test]
fn memory_unregistered_for_sleep_is_read_by_no_peer_until_registered_again() {
    let owner = engine("owner", "f32", (0..BLOCK * BLOCKS).map(|i| (i * 7 % 253) as u8).collect());
    let reader = engine("reader", "f32", vec![0u8; BLOCK * BLOCKS]);
    let block = |buf: &[u8], b: usize| buf[b * BLOCK..(b + 1) * BLOCK].to_vec();
    let peer = connect(&reader, &owner).unwrap();
    read_one(&reader, &peer, 1, 10).unwrap();
    assert_eq!(block(reader.buf(), 1), block(owner.buf(), 10));

    assert_eq!(owner.unregister_regions().unwrap(), 1);
    // The reader's connection ends (a read posted before it saw that still reads the
    // memory, mapped until the owner's caller unmaps it: holds' claims and leases keep
    // readers off it, not this): a read through it fails and writes nothing.
    assert!(common::wait_until(TIMEOUT, || read_one(&reader, &peer, 2, 11).is_err()));
    let refused = read_one(&reader, &peer, 4, 13).unwrap_err();
    assert!(refused.contains("no connection to peer engine"), "{refused}");
    assert!(block(reader.buf(), 4).iter().all(|&b| b == 0));
    // A new handshake finds nothing to read.
    let refused = connect(&reader, &owner).unwrap_err().to_string();
    assert!(refused.contains("has not published a block layout"), "{refused}");

    let base = owner.buf().as_ptr() as u64;
    // SAFETY: the owner's own buffer, which outlives it (TestEngine).
    owner.register_region(unsafe { RegionMemory::new(base, owner.buf().len() as u64) }).unwrap();
    owner
        .set_layout(BlockLayout {
            segment_bases: vec![base],
            block_stride: BLOCK as u64,
            block_len: BLOCK as u64,
            num_blocks: BLOCKS as u64,
        })
        .unwrap();
    // Once the reader's backoff after the refusal has passed.
    let mut peer = Err(EngineError::Closed);
    assert!(common::wait_until(Duration::from_secs(30), || {
        peer = connect(&reader, &owner);
        peer.is_ok()
    }));
    read_one(&reader, &peer.unwrap(), 3, 12).unwrap();
    assert_eq!(block(reader.buf(), 3), block(owner.buf(), 12));
}
