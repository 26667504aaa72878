//! What a batch costs the engine with n batches in flight (issue 37 item 4): n - 1 batches
//! stay outstanding on an owner that does not answer, while one-block (4 KiB) batches from
//! another owner are posted and waited for one at a time; the time per such batch at n = 1,
//! 64 and 1,024 (`read_completion/n`).
//!
//! All three engines share this process and read each other directly (same-host reads, each
//! owner's batches on its own copy thread). The owner that does not answer has its one block
//! in memory registered with a userfaultfd nobody serves: the copy of its first batch waits in
//! the kernel and the others queue behind it, so they stay in the reader's book, pending, until
//! the bench unregisters the range at the end (the waiting copy then reads zeros). Their
//! deadlines are an hour off. What grows with n is the engine's tracking of the batches in
//! flight (posting, delivering completions, deadlines), which should not.
//!
//! Needs userfaultfd for faults the kernel takes (root, or `vm.unprivileged_userfaultfd=1`).

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvduplex::engine::{Engine, Transfer};

mod common;

const BLOCK: usize = 4096;
const IN_FLIGHT: [usize; 3] = [1, 64, 1024];
const MAX_IN_FLIGHT: usize = 1024;

/// One page of anonymous memory registered with a userfaultfd nobody reads: any access to it,
/// `process_vm_readv` included, waits until [`Stalled::release`].
struct Stalled {
    addr: *mut libc::c_void,
    uffd: libc::c_int,
}

const UFFD_API: u64 = 0xAA;
const UFFDIO_API: libc::c_ulong = 0xC018_AA3F;
const UFFDIO_REGISTER: libc::c_ulong = 0xC020_AA00;
const UFFDIO_UNREGISTER: libc::c_ulong = 0x8010_AA01;
const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;

impl Stalled {
    fn new() -> Stalled {
        // SAFETY: plain system calls on memory this function maps and owns; every pointer
        // passed is to a live local of the size the call expects.
        unsafe {
            let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
            let prot = libc::PROT_READ | libc::PROT_WRITE;
            let addr = libc::mmap(std::ptr::null_mut(), BLOCK, prot, flags, -1, 0);
            assert_ne!(addr, libc::MAP_FAILED, "mmap");
            let uffd = libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) as libc::c_int;
            let mut api = [UFFD_API, 0, 0];
            let mut register = [addr as u64, BLOCK as u64, UFFDIO_REGISTER_MODE_MISSING, 0];
            let ok = uffd >= 0
                && libc::ioctl(uffd, UFFDIO_API, api.as_mut_ptr()) == 0
                && libc::ioctl(uffd, UFFDIO_REGISTER, register.as_mut_ptr()) == 0;
            assert!(
                ok,
                "userfaultfd: {} (needs root or vm.unprivileged_userfaultfd=1)",
                std::io::Error::last_os_error()
            );
            Stalled { addr, uffd }
        }
    }

    /// Lets the accesses waiting on the page go on (they read zeros).
    fn release(&self) {
        let mut range = [self.addr as u64, BLOCK as u64];
        // SAFETY: the range is the one registered in `new`, on its live descriptor.
        let r = unsafe { libc::ioctl(self.uffd, UFFDIO_UNREGISTER, range.as_mut_ptr()) };
        assert_eq!(r, 0, "UFFDIO_UNREGISTER: {}", std::io::Error::last_os_error());
    }
}

impl Drop for Stalled {
    fn drop(&mut self) {
        // SAFETY: unmapped once, after the engine that registered it closed (declared later).
        unsafe {
            libc::close(self.uffd);
            libc::munmap(self.addr, BLOCK);
        }
    }
}

/// The CPU time this thread has used: what posting and waiting cost it, which other load on
/// the machine does not inflate the way it does the wall-clock time.
fn thread_cpu_time() -> Duration {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: writes one timespec, a live local.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    assert_eq!(r, 0);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

fn bench_completion(c: &mut Criterion) {
    let mut owned = vec![7u8; BLOCK];
    let stalled = Stalled::new();
    let mut local = vec![0u8; BLOCK * 2];
    // SAFETY: each engine is declared after the memory it registers, in this scope, so it is
    // dropped (closed) before that memory is freed; nothing else writes it meanwhile.
    let (owner, silent, reader) = unsafe {
        (
            common::engine("owner", owned.as_mut_ptr() as u64, owned.len(), BLOCK, true),
            common::engine("silent", stalled.addr as u64, BLOCK, BLOCK, true),
            common::engine("reader", local.as_mut_ptr() as u64, local.len(), BLOCK, true),
        )
    };
    let connect = |to: &Engine| {
        let addr = to.side_channel_addr().unwrap();
        reader.connect(&addr.ip().to_string(), addr.port(), Duration::from_secs(5)).unwrap()
    };
    let (peer, silent_peer) = (connect(&owner), connect(&silent));
    let read = |from: &str, local: i64| -> Transfer {
        let timeout = Duration::from_secs(3600);
        let t = reader.read_blocks(from, &[local], &[0], None, timeout, None, None).unwrap();
        assert!(t.same_host());
        t
    };
    let mut outstanding: Vec<Transfer> = Vec::with_capacity(MAX_IN_FLIGHT);
    let mut group = c.benchmark_group("read_completion");
    for n in IN_FLIGHT {
        while outstanding.len() < n - 1 {
            outstanding.push(read(&silent_peer, 1));
        }
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter_custom(|iters| {
                let start = thread_cpu_time();
                for _ in 0..iters {
                    read(&peer, 0).wait(Some(Duration::from_secs(10))).unwrap();
                }
                thread_cpu_time() - start
            })
        });
        assert!(
            outstanding.iter().all(|t| !t.poll().unwrap()),
            "the silent owner's batches stayed outstanding"
        );
    }
    group.finish();
    stalled.release();
    for t in &outstanding {
        t.wait(Some(Duration::from_secs(10))).unwrap();
    }
}

criterion_group!(benches, bench_completion);
criterion_main!(benches);
