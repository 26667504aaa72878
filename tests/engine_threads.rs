//! The engine's threads are bounded and reaped: what a connection starts (its link's thread,
//! a same-host copy thread) ends with it, and lookups of an owner that never answers share one
//! handshake thread. Counted in /proc/self/task, so this binary runs one test at a time (the
//! lock below) and nothing else.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::{fingerprint, test_engine, wait_until};

/// One test at a time: each counts every thread of the process.
static ALONE: Mutex<()> = Mutex::new(());

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

/// The process's virtual memory, in MiB: an ended thread that nobody joined keeps its stack
/// mapped, unseen in /proc/self/task.
fn vm_mib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmSize:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() >> 10
}

/// Waits (generously: a thread ends a moment after what it serves) for the thread count to
/// come back to `start`; returns the count it saw last.
fn threads_back_to(start: usize) -> usize {
    wait_until(Duration::from_secs(20), || threads() <= start);
    threads()
}

/// The thread count once it stayed the same for half a second.
fn settled_threads() -> usize {
    let mut last = threads();
    let mut since = Instant::now();
    while since.elapsed() < Duration::from_millis(500) {
        thread::sleep(Duration::from_millis(20));
        let now = threads();
        if now != last {
            (last, since) = (now, Instant::now());
        }
    }
    last
}

/// A TCP relay in front of an engine's side channel: the reader connects through it, and the
/// test cuts the connections it relays, which the reader sees as its owner gone (the link
/// closed), as a peer that dies or a network that drops the connection does.
struct Relay {
    port: u16,
    pairs: Arc<Mutex<Vec<TcpStream>>>,
    stop: Arc<AtomicBool>,
    accepting: Option<thread::JoinHandle<()>>,
}

impl Relay {
    fn to(upstream: u16) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let pairs: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (accept_pairs, accept_stop) = (Arc::clone(&pairs), Arc::clone(&stop));
        let accepting = thread::spawn(move || {
            while !accept_stop.load(Ordering::Acquire) {
                match listener.accept() {
                    Ok((client, _)) => {
                        client.set_nonblocking(false).unwrap();
                        let server = TcpStream::connect(("127.0.0.1", upstream)).unwrap();
                        for (from, to) in [(&client, &server), (&server, &client)] {
                            let (mut from, mut to) =
                                (from.try_clone().unwrap(), to.try_clone().unwrap());
                            thread::spawn(move || pump(&mut from, &mut to));
                        }
                        accept_pairs.lock().unwrap().extend([client, server]);
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        thread::sleep(Duration::from_millis(1))
                    }
                    Err(e) => panic!("relay accept: {e}"),
                }
            }
        });
        Relay { port, pairs, stop, accepting: Some(accepting) }
    }

    /// Cuts every connection relayed so far.
    fn cut(&self) {
        for stream in self.pairs.lock().unwrap().drain(..) {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.cut();
        if let Some(t) = self.accepting.take() {
            t.join().unwrap();
        }
    }
}

fn pump(from: &mut TcpStream, to: &mut TcpStream) {
    let mut buf = [0u8; 16 << 10];
    while let Ok(n @ 1..) = from.read(&mut buf) {
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Both);
}

const BLOCK: usize = 4096;

fn pattern(seed: u8) -> Vec<u8> {
    (0..64 * BLOCK).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// 1,000 times: connect to an owner (through the relay), read a block (a same-host read: the
/// connection starts a copy thread), look a prompt up, then lose the connection (the relay
/// cuts it). Every thread the connections started ends with them, and is joined: the copy
/// threads of closed connections were left unjoined until the engine closed, each keeping its
/// stack mapped.
#[test]
fn a_thousand_reconnects_leave_the_thread_count_where_it_started() {
    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
    let owner = test_engine("owner", fingerprint("bf16"), pattern(7), true, BLOCK, 0);
    let reader = test_engine("reader", fingerprint("bf16"), vec![0; 64 * BLOCK], true, BLOCK, 0);
    let relay = Relay::to(owner.side_channel_addr().unwrap().port());
    let cycle = |i: usize| {
        let handle = reader.connect("127.0.0.1", relay.port, common::TIMEOUT).unwrap();
        let block = 1 + (i % 63) as i64;
        let transfer = reader
            .read_blocks(&handle, &[block], &[block], None, common::TIMEOUT, None, None)
            .unwrap();
        assert!(transfer.same_host());
        transfer.wait(Some(common::TIMEOUT)).unwrap();
        let lookup = reader.start_lookup(
            vec![("127.0.0.1".to_owned(), relay.port)],
            vec![i as u64],
            None,
            None,
            Duration::from_secs(2),
        );
        assert!(wait_until(common::TIMEOUT, || lookup.answers()[0].is_some()));
        relay.cut();
        assert!(wait_until(common::TIMEOUT, || !reader.peer_alive(&handle)), "cycle {i}");
    };
    // UCX's and the engines' own threads start with the first connection.
    cycle(0);
    let start = settled_threads();
    let vm_start = vm_mib();
    let started = Instant::now();
    for i in 1..=1000 {
        cycle(i);
    }
    let end = threads_back_to(start);
    let vm_end = vm_mib();
    eprintln!(
        "threads: {start} before 1,000 reconnects, {end} after ({:?}); virtual memory {vm_start} \
         MiB before, {vm_end} MiB after",
        started.elapsed()
    );
    let b = &reader.buf()[BLOCK..2 * BLOCK];
    assert_eq!(b, &pattern(7)[BLOCK..2 * BLOCK]);
    assert_eq!(end, start, "threads left behind by 1,000 connections");
    // Generous: allocators keep what they freed; 1,000 stacks of 2 MiB would be 2,000.
    assert!(
        vm_end < vm_start + 256,
        "{} MiB more mapped after 1,000 connections",
        vm_end - vm_start
    );
}

/// An owner that accepts connections and never answers: 200 lookups asking it at once wait
/// for one handshake, not a thread each.
#[test]
fn lookups_of_an_owner_that_never_answers_share_one_handshake_thread() {
    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
    let reader = test_engine("reader", fingerprint("bf16"), vec![0; 64 * BLOCK], true, BLOCK, 0);
    let mute = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = mute.local_addr().unwrap().port();
    let held: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
    let keep = Arc::clone(&held);
    mute.set_nonblocking(true).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = Arc::clone(&stop);
    let accepting = thread::spawn(move || {
        while !stopped.load(Ordering::Acquire) {
            match mute.accept() {
                Ok((stream, _)) => keep.lock().unwrap().push(stream),
                Err(_) => thread::sleep(Duration::from_millis(1)),
            }
        }
    });
    let start = settled_threads();
    let timeout = Duration::from_secs(2);
    let lookups: Vec<_> = (0..200u64)
        .map(|i| {
            reader.start_lookup(vec![("127.0.0.1".to_owned(), port)], vec![i], None, None, timeout)
        })
        .collect();
    let peak = threads();
    eprintln!("threads: {start} before 200 lookups of a mute owner, {peak} with them waiting");
    assert!(peak <= start + 2, "{} threads for 200 lookups of one owner", peak - start);
    // Each is answered (no connection) once the handshake times out; no answer waits for a
    // late reply's window.
    assert!(wait_until(common::TIMEOUT, || lookups
        .iter()
        .all(|l| l.answers()[0].as_ref().is_some_and(|a| a.outcome.is_err()))));
    assert_eq!(threads_back_to(start), start);
    stop.store(true, Ordering::Release);
    accepting.join().unwrap();
    drop(held);
}
