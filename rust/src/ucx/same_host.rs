//! Same-host reads: an engine on this host is read with `process_vm_readv`, many ranges per
//! system call, where UCX's cma transport makes one call per range. On a scattered batch of
//! small blocks the per-call cost (finding the process, the ptrace access check) is most of
//! the time, so this is what makes such batches faster than UCX itself.
//!
//! Host memory only, and only for a peer whose process vouches for what the peer sent on this
//! very connection: each engine keeps a [`Probe`] key (32 random bytes that never leave the
//! process) at a fixed address, and its side channel sends, with each connection's metadata,
//! an HMAC under that key of the connection's hellos and the metadata's digest
//! ([`crate::handshake::auth::same_host_proof`]). A reader reads the key out of the process the
//! metadata names and checks the proof before reading anything else from it. A peer can
//! therefore only point a reader at regions that process itself published, on this
//! connection. The reader's own process is never opened this way: a process can always read
//! itself, whatever its memory holds at the named address, so this process counts only
//! through the probes of its own live engines ([`Probe`]'s registry). The reader keeps a pidfd
//! to the process and reports a read good only if the process was still alive after it, so a
//! pid reused by another process after the owner exited can never go unnoticed.

use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

use crate::descriptors::RegionBounds;

use super::{check_bounds, BatchState, Read};

/// Most ranges one `process_vm_readv` call takes on each side (Linux's `UIO_MAXIOV`).
const MAX_RANGES_PER_CALL: usize = 1024;

/// Most bytes one call copies: far below the kernel's cap of one call (`MAX_RW_COUNT`, just
/// under 2 GiB, past which it silently stops short), and small enough that a batch failed
/// meanwhile (deadline, dead peer) stops within a few tens of milliseconds.
const MAX_BYTES_PER_CALL: usize = 64 << 20;

const KEY_LEN: usize = 32;

/// An engine of this process, as the registry of live probes knows it.
struct LocalEngine {
    probe_addr: u64,
    key: [u8; KEY_LEN],
    worker_address: Vec<u8>,
}

/// Every live [`Probe`] of this process: how a reader tells an engine of its own process (which
/// may be read) from a peer naming this process (which may not).
static LOCAL_ENGINES: Mutex<Vec<LocalEngine>> = Mutex::new(Vec::new());

fn local_engines() -> std::sync::MutexGuard<'static, Vec<LocalEngine>> {
    LOCAL_ENGINES.lock().unwrap_or_else(|p| p.into_inner())
}

/// What an engine keeps at a fixed address for same-host readers: a random key that never
/// leaves this process (its side channel proves each connection with it). Registered, with the
/// engine's UCX worker address, as an engine of this process until dropped.
pub struct Probe {
    key: Box<[u8; KEY_LEN]>,
}

impl Probe {
    pub fn new(worker_address: &[u8]) -> Result<Probe, String> {
        let mut key = Box::new([0u8; KEY_LEN]);
        getrandom::fill(&mut key[..])
            .map_err(|e| format!("no random bytes for the same-host probe: {e}"))?;
        let probe = Probe { key };
        local_engines().push(LocalEngine {
            probe_addr: probe.addr(),
            key: *probe.key,
            worker_address: worker_address.to_vec(),
        });
        Ok(probe)
    }

    pub fn addr(&self) -> u64 {
        self.key.as_ptr() as u64
    }

    pub fn key(&self) -> [u8; KEY_LEN] {
        *self.key
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        let addr = self.addr();
        local_engines().retain(|e| e.probe_addr != addr);
    }
}

/// What a same-host peer claims on one connection: the process, where its probe key is, and
/// the proof it sent for `digest` on the connection whose hellos hash to `transcript`.
pub struct SameHostClaim<'a> {
    pub pid: u32,
    pub probe_addr: u64,
    pub transcript: &'a [u8; 32],
    pub digest: [u8; 32],
    pub proof: [u8; 32],
}

impl SameHostClaim<'_> {
    /// Whether `key` makes this claim's proof (in constant time).
    fn proven_by(&self, key: &[u8; KEY_LEN]) -> bool {
        let expected = crate::handshake::auth::same_host_proof(key, self.transcript, &self.digest);
        expected.iter().zip(&self.proof).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

/// Refuses metadata that hands us the UCX worker address of an engine of this process (ours,
/// or a sibling's) unless that engine vouched for it on this connection (`claim`): UCX's cma
/// and tcp transports read any address of the process a worker address names, so such
/// metadata would make us copy our own memory. Addresses of other processes pass.
pub fn check_not_this_process(
    worker_address: &[u8],
    claim: Option<&SameHostClaim<'_>>,
) -> Result<(), String> {
    let engines = local_engines();
    let Some(engine) = engines.iter().find(|e| e.worker_address == worker_address) else {
        return Ok(());
    };
    let vouched = claim.is_some_and(|c| {
        c.pid == std::process::id() && c.probe_addr == engine.probe_addr && c.proven_by(&engine.key)
    });
    if vouched {
        Ok(())
    } else {
        Err("it hands us the UCX worker address of an engine of this very process without that engine's proof".to_owned())
    }
}

/// This host's identity for this boot (`/proc/sys/kernel/random/boot_id`): two engines can read
/// each other's memory directly only when theirs are equal. `None` where it cannot be read.
pub fn boot_id() -> Option<String> {
    let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let id = id.trim();
    (!id.is_empty()).then(|| id.to_owned())
}

/// Whether UCX, configured by `UCX_TLS` (`None`: unset), would read a same-host peer over cma.
/// Same-host reads replace exactly that transport, so a user who chose another one (tcp, say)
/// keeps it. Names are taken as UCX takes them: split at commas, untrimmed, case-sensitive, a
/// leading `^` excluding the list and a leading `\` on a name marking it strict.
pub fn ucx_tls_allows_cma(ucx_tls: Option<&str>) -> bool {
    let Some(value) = ucx_tls.filter(|v| !v.is_empty()) else { return true };
    let (excluding, list) = match value.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, value),
    };
    // `\cma` asks for cma itself rather than an alias that contains it; aliases have no such form.
    let names_cma = list.split(',').any(|t| matches!(t, "cma" | "\\cma" | "sm" | "shm" | "all"));
    names_cma != excluding
}

/// Why a same-host peer is not read directly.
#[derive(Debug, PartialEq, Eq)]
pub enum OpenError {
    /// The claim is false: a peer that makes one is lying about who it is.
    Forged(String),
    /// The process cannot be opened or read (gone, or the kernel does not let us): UCX may
    /// still read the peer.
    Unreadable(String),
}

impl std::fmt::Display for OpenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Forged(why) | Self::Unreadable(why) => f.write_str(why),
        }
    }
}

/// A process on this host whose memory is read directly.
pub struct SameHostPeer {
    pid: libc::pid_t,
    /// Readable once the process has exited.
    pidfd: OwnedFd,
    /// The peer's registered regions (its `Peer`'s, shared), by the index the handshake gave
    /// them.
    remote: Arc<[RegionBounds]>,
}

/// One range of a same-host read: `len` bytes from the peer's `remote` into our `local`.
#[derive(Clone, Copy)]
struct Range {
    local: u64,
    remote: u64,
    len: usize,
}

impl SameHostPeer {
    /// Opens the claim's process and checks the claim's proof with the key it keeps at the
    /// claim's probe address: the process vouches for the metadata that named it on this
    /// connection, whose regions are `remote`. This process itself is refused unless the
    /// probe address is one of its live engines' probes.
    pub fn open(
        claim: &SameHostClaim<'_>,
        remote: Arc<[RegionBounds]>,
    ) -> Result<SameHostPeer, OpenError> {
        let pid = libc::pid_t::try_from(claim.pid)
            .map_err(|_| OpenError::Forged(format!("pid {} is out of range", claim.pid)))?;
        let ours = claim.pid == std::process::id();
        if ours && !local_engines().iter().any(|e| e.probe_addr == claim.probe_addr) {
            return Err(OpenError::Forged(format!("it names this very process ({pid}) but no engine of this process keeps its probe at {:#x}", claim.probe_addr)));
        }
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(OpenError::Unreadable(format!(
                "pidfd_open({pid}): {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: fd is a descriptor pidfd_open just returned, owned by nobody else.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let peer = SameHostPeer { pid, pidfd, remote };
        let key = if ours {
            // Read under the registry's lock, so the engine cannot drop its probe meanwhile.
            let engines = local_engines();
            engines.iter().find(|e| e.probe_addr == claim.probe_addr).map(|e| e.key).ok_or_else(
                || {
                    OpenError::Unreadable(format!(
                        "the engine of this process at {:#x} closed",
                        claim.probe_addr
                    ))
                },
            )?
        } else {
            let mut key = [0u8; KEY_LEN];
            let range =
                Range { local: key.as_mut_ptr() as u64, remote: claim.probe_addr, len: KEY_LEN };
            // SAFETY: the only local range is `key`, a buffer of this frame, KEY_LEN bytes long.
            unsafe { peer.read_ranges(&[range]) }.map_err(OpenError::Unreadable)?;
            key
        };
        if !claim.proven_by(&key) {
            return Err(OpenError::Forged(format!("process {pid} did not vouch for what the peer sent on this connection (another process, or a replayed identity)")));
        }
        Ok(peer)
    }

    pub fn pid(&self) -> u32 {
        self.pid as u32
    }

    /// Checks every read to lie inside its local region and inside the peer region it names,
    /// and counts the batch as one unfinished read in `batch` until [`SameHostCopy::run`]
    /// ends it. The batch, which the copy holds, holds the local regions from here on
    /// ([`BatchState`]). Host memory only (the caller routes other memory to UCX).
    pub fn prepare(
        self: &Arc<Self>,
        reads: &[Read<'_>],
        batch: &Arc<BatchState>,
    ) -> Result<SameHostCopy, String> {
        check_bounds(reads, &self.remote)?;
        let ranges = reads
            .iter()
            .map(|r| Range { local: r.local_addr, remote: r.remote_addr, len: r.len as usize })
            .collect();
        batch.hold_regions(reads);
        batch.start_reads(1);
        Ok(SameHostCopy { peer: Arc::clone(self), ranges, batch: Arc::clone(batch), ran: false })
    }

    /// Copies `ranges` in calls of at most [`MAX_RANGES_PER_CALL`] ranges and
    /// [`MAX_BYTES_PER_CALL`] bytes (a longer range is split), stopping early when `stop`
    /// says so between calls.
    ///
    /// # Safety
    /// Every local range must be memory of this process that stays mapped and writable for the
    /// whole call and that no one else reads or writes meanwhile.
    unsafe fn copy(&self, ranges: &[Range], stop: impl Fn() -> bool) -> Result<(), String> {
        let mut call: Vec<Range> = Vec::with_capacity(ranges.len().min(MAX_RANGES_PER_CALL));
        let mut call_bytes = 0usize;
        for range in ranges {
            let mut done = 0usize;
            while done < range.len {
                let piece = (range.len - done).min(MAX_BYTES_PER_CALL - call_bytes);
                call.push(Range {
                    local: range.local + done as u64,
                    remote: range.remote + done as u64,
                    len: piece,
                });
                call_bytes += piece;
                done += piece;
                if call.len() == MAX_RANGES_PER_CALL || call_bytes == MAX_BYTES_PER_CALL {
                    if stop() {
                        return Err("stopped".to_owned());
                    }
                    // SAFETY: the pieces lie inside the caller's ranges, which the caller
                    // vouches for.
                    unsafe { self.read_ranges(&call) }?;
                    call.clear();
                    call_bytes = 0;
                }
            }
        }
        if !call.is_empty() {
            if stop() {
                return Err("stopped".to_owned());
            }
            // SAFETY: as above.
            unsafe { self.read_ranges(&call) }?;
        }
        Ok(())
    }

    /// One `process_vm_readv` of at most [`MAX_RANGES_PER_CALL`] ranges and
    /// [`MAX_BYTES_PER_CALL`] bytes; anything short of every byte is an error.
    ///
    /// # Safety
    /// As [`SameHostPeer::copy`]: every local range is this process's memory, mapped, writable
    /// and not otherwise accessed during the call.
    unsafe fn read_ranges(&self, ranges: &[Range]) -> Result<(), String> {
        debug_assert!(ranges.len() <= MAX_RANGES_PER_CALL);
        let local: Vec<libc::iovec> = ranges
            .iter()
            .map(|r| libc::iovec { iov_base: r.local as *mut c_void, iov_len: r.len })
            .collect();
        let remote: Vec<libc::iovec> = ranges
            .iter()
            .map(|r| libc::iovec { iov_base: r.remote as *mut c_void, iov_len: r.len })
            .collect();
        let expected: usize = ranges.iter().map(|r| r.len).sum();
        // SAFETY: process_vm_readv writes only into the local iovecs, which the caller vouches
        // for; the remote ranges are read in the other process, where a bad one ends the copy
        // early (a short count or EFAULT) without touching our memory. Both arrays hold
        // ranges.len() <= UIO_MAXIOV iovecs, and the total is below MAX_RW_COUNT.
        let n = unsafe {
            libc::process_vm_readv(
                self.pid,
                local.as_ptr(),
                local.len() as libc::c_ulong,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            )
        };
        if n < 0 {
            return Err(format!(
                "process_vm_readv from process {}: {}",
                self.pid,
                std::io::Error::last_os_error()
            ));
        }
        if n as usize != expected {
            return Err(format!("process_vm_readv from process {} read {n} of {expected} bytes (a remote range is not mapped)", self.pid));
        }
        if self.exited() {
            return Err(format!("process {} exited during the read", self.pid));
        }
        Ok(())
    }

    /// Whether the process has exited (its pid may then name another process).
    fn exited(&self) -> bool {
        loop {
            let mut fds =
                libc::pollfd { fd: self.pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd, zero timeout.
            let ready = unsafe { libc::poll(&mut fds, 1, 0) };
            if ready < 0
                && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
            {
                continue;
            }
            // Readable: exited. An error on a pidfd we own: treat as exited, never read on.
            return ready != 0;
        }
    }
}

/// A checked same-host batch, to be copied once by [`SameHostCopy::run`] (on its peer's copy
/// thread); the batch settles when it has run, or failed when it
/// is dropped without running (so that it never stays pending).
pub struct SameHostCopy {
    peer: Arc<SameHostPeer>,
    ranges: Vec<Range>,
    /// Holds the registered regions the ranges write into (checked by `prepare`), so that they
    /// stay registered, and so allocated ([`super::RegionMemory`]'s promise), for as long
    /// as the copy exists.
    batch: Arc<BatchState>,
    ran: bool,
}

impl SameHostCopy {
    /// Copies the batch, or as much of it as it takes to notice that the batch was failed
    /// meanwhile (its deadline passed, its peer died, the engine closes), and settles it.
    pub fn run(mut self) {
        let batch = &self.batch;
        // SAFETY: prepare checked every local range to lie in a region that `self.batch` holds,
        // so registered, and so allocated (RegionMemory's promise), until the copy is dropped;
        // the promise also hands the batch's blocks to it until it settles.
        let result = unsafe { self.peer.copy(&self.ranges, || batch.has_failed()) };
        if let Err(e) = result {
            batch.record_read_error(e);
        }
        self.ran = true;
    }
}

impl Drop for SameHostCopy {
    fn drop(&mut self) {
        if !self.ran {
            self.batch.record_read_error("the same-host copy never ran".to_owned());
        }
        let _ = self.batch.reads_finished(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ucx_tls_decides_whether_same_host_reads_replace_cma() {
        for (tls, allowed) in [
            (None, true),
            (Some(""), true),
            (Some("all"), true),
            (Some("cma,tcp"), true),
            (Some("tcp,sm"), true),
            (Some("shm,self"), true),
            (Some("\\cma,tcp"), true),
            (Some("\\sm,tcp"), false),
            (Some("tcp, sm"), false), // UCX does not trim: " sm" is no transport
            (Some("tcp,self"), false),
            (Some("rc,cuda_copy,mm"), false),
            (Some("^cma"), false),
            (Some("^tcp"), true),
            (Some("^sm,tcp"), false),
            (Some("CMA"), false),
        ] {
            assert_eq!(ucx_tls_allows_cma(tls), allowed, "UCX_TLS={tls:?}");
        }
    }

    use crate::handshake::auth::same_host_proof;

    fn claim<'a>(
        pid: u32,
        probe_addr: u64,
        transcript: &'a [u8; 32],
        digest: [u8; 32],
        proof: [u8; 32],
    ) -> SameHostClaim<'a> {
        SameHostClaim { pid, probe_addr, transcript, digest, proof }
    }

    #[test]
    fn the_proof_binds_the_process_the_connection_and_what_it_sent() {
        let probe = Probe::new(b"worker").unwrap();
        let (transcript, digest) = ([5u8; 32], [7u8; 32]);
        let proof = same_host_proof(&probe.key(), &transcript, &digest);
        let pid = std::process::id();
        assert!(SameHostPeer::open(
            &claim(pid, probe.addr(), &transcript, digest, proof),
            Arc::from([])
        )
        .is_ok());
        // Another connection (a replayed proof), or other metadata (a replayed identity).
        let err =
            SameHostPeer::open(&claim(pid, probe.addr(), &[6u8; 32], digest, proof), Arc::from([]))
                .err()
                .unwrap()
                .to_string();
        assert!(err.contains("did not vouch"), "{err}");
        let err = SameHostPeer::open(
            &claim(pid, probe.addr(), &transcript, [8u8; 32], proof),
            Arc::from([]),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("did not vouch"), "{err}");
        // This process, but no engine's probe there: bytes a peer chose, at an address it
        // chose, prove nothing.
        let planted = [9u8; 32];
        let forged = same_host_proof(&planted, &transcript, &digest);
        let err = SameHostPeer::open(
            &claim(pid, planted.as_ptr() as u64, &transcript, digest, forged),
            Arc::from([]),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("this very process"), "{err}");
        let err = SameHostPeer::open(
            &claim(u32::MAX, probe.addr(), &transcript, digest, proof),
            Arc::from([]),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("out of range") || err.contains("pidfd_open"), "{err}");
        drop(probe);
        let err = SameHostPeer::open(
            &claim(pid, planted.as_ptr() as u64, &transcript, digest, proof),
            Arc::from([]),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(
            err.contains("this very process"),
            "a closed engine's probe no longer counts: {err}"
        );
    }

    #[test]
    fn a_worker_address_of_this_process_passes_only_with_its_engines_proof() {
        let probe = Probe::new(b"this process's worker").unwrap();
        let (transcript, digest) = ([1u8; 32], [2u8; 32]);
        let proof = same_host_proof(&probe.key(), &transcript, &digest);
        let pid = std::process::id();
        assert!(check_not_this_process(b"another process's worker", None).is_ok());
        assert!(check_not_this_process(b"this process's worker", None).is_err());
        assert!(check_not_this_process(
            b"this process's worker",
            Some(&claim(pid, probe.addr(), &transcript, digest, [0; 32]))
        )
        .is_err());
        assert!(check_not_this_process(
            b"this process's worker",
            Some(&claim(pid, probe.addr(), &transcript, digest, proof))
        )
        .is_ok());
    }

    fn own_process() -> SameHostPeer {
        let probe = Probe::new(b"own").unwrap();
        let (transcript, digest) = ([0u8; 32], [0u8; 32]);
        let proof = same_host_proof(&probe.key(), &transcript, &digest);
        SameHostPeer::open(
            &claim(std::process::id(), probe.addr(), &transcript, digest, proof),
            Arc::from([]),
        )
        .unwrap()
    }

    #[test]
    fn copies_cross_the_per_call_limits_byte_for_byte() {
        let peer = own_process();
        // 2,500 scattered 64-byte ranges: three calls of at most 1,024 ranges.
        let source: Vec<u8> = (0..2500 * 64).map(|i| (i * 31 % 251) as u8).collect();
        let mut dest = vec![0u8; source.len()];
        let ranges: Vec<Range> = (0..2500)
            .map(|i| {
                let from = (i * 7 % 2500) * 64;
                Range {
                    local: dest.as_mut_ptr() as u64 + (i * 64) as u64,
                    remote: source.as_ptr() as u64 + from as u64,
                    len: 64,
                }
            })
            .collect();
        // SAFETY: every local range lies in `dest`, which nothing else touches meanwhile.
        unsafe { peer.copy(&ranges, || false) }.unwrap();
        for i in 0..2500 {
            let from = (i * 7 % 2500) * 64;
            assert_eq!(dest[i * 64..(i + 1) * 64], source[from..from + 64], "range {i}");
        }
        // More than the kernel copies in one call (~2 GiB): 40 reads of one 64 MiB block, the
        // first range 200 MiB long, split into pieces of at most MAX_BYTES_PER_CALL.
        let block: Vec<u8> = (0..(200usize << 20)).map(|i| (i % 253) as u8).collect();
        let mut into = vec![0u8; block.len()];
        let mut ranges = vec![Range {
            local: into.as_mut_ptr() as u64,
            remote: block.as_ptr() as u64,
            len: block.len(),
        }];
        ranges.extend((0..40).map(|_| Range {
            local: into.as_mut_ptr() as u64,
            remote: block.as_ptr() as u64 + 4096,
            len: 64 << 20,
        }));
        // SAFETY: as above, `into`.
        unsafe { peer.copy(&ranges, || false) }.unwrap();
        assert_eq!(into[(64 << 20)..], block[(64 << 20)..]);
        assert_eq!(into[..(64 << 20)], block[4096..(64 << 20) + 4096]);
    }

    #[test]
    fn a_copy_keeps_the_region_it_writes_into_registered_until_it_ends() {
        let worker = super::super::Worker::new("copy-holds-regions", None).expect("UCX loads");
        let source = vec![5u8; 4096];
        let mut dest = vec![0u8; 4096];
        // SAFETY: `dest` is this test's, declared before the region and the copy, so it
        // outlives them; it is read only once the copy ran.
        let memory = unsafe { super::super::RegionMemory::new(dest.as_mut_ptr() as u64, 4096) };
        let into = Arc::new(worker.register(memory).unwrap());
        let bounds = RegionBounds { addr: source.as_ptr() as u64, len: 4096 };
        let peer = Arc::new(SameHostPeer { remote: Arc::from([bounds]), ..own_process() });
        let batch = BatchState::new(&worker);
        let read = Read {
            local_addr: into.addr,
            local: &into,
            remote_addr: bounds.addr,
            remote_region: 0,
            len: 4096,
        };
        let copy = peer.prepare(&[read], &batch).unwrap();
        let registered = Arc::downgrade(&into);
        drop((into, batch));
        assert!(registered.upgrade().is_some(), "the caller's region went, the copy's stays");
        copy.run();
        assert_eq!(dest, source);
        assert!(registered.upgrade().is_none(), "unregistered once the copy is gone");
    }

    #[test]
    fn a_failed_batch_stops_between_calls() {
        let peer = own_process();
        let source = vec![1u8; 4096];
        let mut dest = vec![0u8; 4096 * 2048];
        let ranges: Vec<Range> = (0..2048)
            .map(|i| Range {
                local: dest.as_mut_ptr() as u64 + (i * 4096) as u64,
                remote: source.as_ptr() as u64,
                len: 4096,
            })
            .collect();
        let calls = std::cell::Cell::new(0);
        // SAFETY: every local range lies in `dest`.
        let result = unsafe {
            peer.copy(&ranges, || {
                calls.set(calls.get() + 1);
                calls.get() > 1
            })
        };
        assert!(result.is_err());
        assert!(dest[..4096 * 1024].iter().all(|&b| b == 1), "the first call copied");
        assert!(dest[4096 * 1024..].iter().all(|&b| b == 0), "nothing after the stop");
    }

    #[test]
    fn a_process_that_exits_is_noticed_and_no_longer_read() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id() as libc::pid_t;
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        assert!(fd >= 0);
        // SAFETY: fd was just returned by pidfd_open and is owned by nobody else.
        let peer = SameHostPeer {
            pid,
            pidfd: unsafe { OwnedFd::from_raw_fd(fd as i32) },
            remote: Arc::from([]),
        };
        assert!(!peer.exited());
        child.kill().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !peer.exited() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(peer.exited(), "an exited (not yet reaped) process is noticed");
        child.wait().unwrap();
        let mut buf = [0u8; 8];
        let range = Range { local: buf.as_mut_ptr() as u64, remote: 0x1000, len: buf.len() };
        // SAFETY: the local range is `buf`.
        let err = unsafe { peer.read_ranges(&[range]) }.unwrap_err();
        assert!(err.contains("No such process"), "{err}");
    }
}
