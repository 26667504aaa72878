//! The engine's threads are bounded and reaped: what a connection starts (its link's thread,
//! a same-host copy thread) ends with it, and lookups of an owner that never answers share one
//! handshake thread. Counted in /proc/self/task, so this binary runs one test at a time (the
//! lock below) and nothing else.

mod common;

use std::net::{TcpListener, TcpStream};
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

/// Kills every established connection accepted on local port `port` (the kernel resets both
/// ends): `ss -K`, which needs CAP_NET_ADMIN and the kernel's socket-destroy support.
fn kill_connections_to(port: u16) {
    let filter = format!("sport = :{port}");
    let out = std::process::Command::new("ss")
        .args(["-K", "-t", "state", "established", &filter])
        .output()
        .expect("ss (iproute2) runs");
    assert!(out.status.success(), "ss -K: {}", String::from_utf8_lossy(&out.stderr));
}

const BLOCK: usize = 4096;
/// Enough that a 2 MiB stack left mapped per connection (500 MiB) is twice the bound on what may
/// be mapped after them (256 MiB); 1,000 took 74 s of `make test-fast` on a loaded machine.
const RECONNECTS: usize = 250;

fn pattern(seed: u8) -> Vec<u8> {
    (0..64 * BLOCK).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// `RECONNECTS` times: connect to an owner, read a block (a same-host read: the connection starts a
/// copy thread), look a prompt up, then lose the connection (the kernel kills the owner's end of
/// it: `ss -K`, root). Every thread the connections started ends with them, and is joined: the
/// copy threads of closed connections were left unjoined until the engine closed, each keeping
/// its stack mapped. (Not through a relay: the kernel shows a relay, not the owner, at the other
/// end of the reader's socket, and same-host reads, like UCX to this very process, are refused.)
#[test]
fn reconnects_leave_the_thread_count_where_it_started() {
    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
    let owner = test_engine("owner", fingerprint("bf16"), pattern(7), true, BLOCK, 0);
    let reader = test_engine("reader", fingerprint("bf16"), vec![0; 64 * BLOCK], true, BLOCK, 0);
    let port = owner.side_channel_addr().unwrap().port();
    let cycle = |i: usize| {
        let handle = reader.connect("127.0.0.1", port, common::TIMEOUT).unwrap();
        let block = 1 + (i % 63) as i64;
        let transfer = reader
            .read_blocks(&handle, &[block], &[block], None, common::TIMEOUT, None, None)
            .unwrap();
        assert!(transfer.same_host());
        transfer.wait(Some(common::TIMEOUT)).unwrap();
        let lookup = reader.start_lookup(
            vec![("127.0.0.1".to_owned(), port)],
            vec![i as u64],
            None,
            None,
            Duration::from_secs(2),
        );
        assert!(wait_until(common::TIMEOUT, || lookup.answers()[0].is_some()));
        kill_connections_to(port);
        assert!(wait_until(common::TIMEOUT, || !reader.peer_alive(&handle)), "cycle {i}");
    };
    // UCX's and the engines' own threads start with the first connection.
    cycle(0);
    let start = settled_threads();
    let vm_start = vm_mib();
    let started = Instant::now();
    for i in 1..=RECONNECTS {
        cycle(i);
    }
    let end = threads_back_to(start);
    let vm_end = vm_mib();
    eprintln!(
        "threads: {start} before {RECONNECTS} reconnects, {end} after ({:?}); virtual memory \
         {vm_start} MiB before, {vm_end} MiB after",
        started.elapsed()
    );
    let b = &reader.buf()[BLOCK..2 * BLOCK];
    assert_eq!(b, &pattern(7)[BLOCK..2 * BLOCK]);
    assert_eq!(end, start, "threads left behind by {RECONNECTS} connections");
    // Generous: allocators keep what they freed; a stack of 2 MiB per connection would be 500.
    assert!(
        vm_end < vm_start + 256,
        "{} MiB more mapped after {RECONNECTS} connections",
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
