//! Same-host reads: an engine on this host is read with `process_vm_readv`, a whole batch per
//! system call (up to `IOV_MAX` ranges), where UCX's cma transport makes one call per range.
//! On a scattered batch of small blocks the per-call cost (finding the process, the ptrace
//! access check, pinning) is most of the time, so this is what makes such batches faster
//! than UCX itself.
//!
//! Host memory only, and only for a peer proven to be the process it says it is: at connect
//! the reader reads the owner's [`Probe`] (random bytes whose address and value the owner put
//! in its metadata) out of the process it names, and keeps a pidfd to that process. A read is
//! reported good only if the process was still alive after it, so a pid that was reused by
//! another process after the owner exited can never go unnoticed.

use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::descriptors::RegionBounds;

use super::{BatchState, Read};

/// Most ranges one `process_vm_readv` call takes on each side (Linux's `UIO_MAXIOV`).
const MAX_RANGES_PER_CALL: usize = 1024;

/// Random bytes an engine keeps at a fixed address for its whole life, so that a same-host
/// reader can prove which process it is reading.
pub struct Probe {
    bytes: Box<[u8; 16]>,
}

impl Probe {
    pub fn new() -> Result<Probe, String> {
        let mut bytes = Box::new([0u8; 16]);
        getrandom::fill(&mut bytes[..]).map_err(|e| format!("no random bytes for the same-host probe: {e}"))?;
        Ok(Probe { bytes })
    }

    pub fn addr(&self) -> u64 {
        self.bytes.as_ptr() as u64
    }

    pub fn bytes(&self) -> [u8; 16] {
        *self.bytes
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
/// keeps it.
pub fn ucx_tls_allows_cma(ucx_tls: Option<&str>) -> bool {
    let Some(value) = ucx_tls.map(str::trim).filter(|v| !v.is_empty()) else { return true };
    let (excluding, list) = match value.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, value),
    };
    let names_cma = list.split(',').map(str::trim).any(|t| matches!(t, "cma" | "sm" | "shm" | "all"));
    names_cma != excluding
}

/// A process on this host whose memory is read directly.
pub struct SameHostPeer {
    pid: libc::pid_t,
    /// Readable once the process has exited.
    pidfd: OwnedFd,
    /// The peer's registered regions, by the index the handshake gave them.
    remote: Vec<RegionBounds>,
}

impl SameHostPeer {
    /// Opens `pid` and checks that it holds `probe` at `probe_addr`; `remote` are its regions.
    pub fn open(pid: u32, probe_addr: u64, probe: [u8; 16], remote: Vec<RegionBounds>) -> Result<SameHostPeer, String> {
        let pid = libc::pid_t::try_from(pid).map_err(|_| format!("pid {pid} is out of range"))?;
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(format!("pidfd_open({pid}): {}", std::io::Error::last_os_error()));
        }
        // SAFETY: fd is a descriptor pidfd_open just returned, owned by nobody else.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let peer = SameHostPeer { pid, pidfd, remote };
        let mut seen = [0u8; 16];
        let len = seen.len();
        peer.read_ranges(&[(seen.as_mut_ptr() as u64, probe_addr, len)])?;
        if seen != probe {
            return Err(format!("process {pid} does not hold the peer's probe: it is another process"));
        }
        Ok(peer)
    }

    pub fn pid(&self) -> u32 {
        self.pid as u32
    }

    /// Reads the whole batch now and records the outcome in `batch`, which settles before this
    /// returns. Every read is checked first to lie inside its local region and inside the peer
    /// region it names; host memory only (the caller routes other memory to UCX).
    pub fn read_batch(&self, reads: &[Read<'_>], batch: &BatchState) {
        batch.start_reads(1);
        if let Err(e) = self.read(reads) {
            batch.record_read_error(e);
        }
        let _ = batch.reads_finished(1);
    }

    fn read(&self, reads: &[Read<'_>]) -> Result<(), String> {
        if let Some(read) = reads.iter().find(|read| !self.in_bounds(read)) {
            return Err(format!(
                "read of {} bytes from {:#x} (peer region {}) into {:#x} is outside the registered regions",
                read.len, read.remote_addr, read.remote_region, read.local_addr
            ));
        }
        let ranges: Vec<(u64, u64, usize)> = reads.iter().map(|r| (r.local_addr, r.remote_addr, r.len as usize)).collect();
        for chunk in ranges.chunks(MAX_RANGES_PER_CALL) {
            self.read_ranges(chunk)?;
        }
        Ok(())
    }

    fn in_bounds(&self, read: &Read<'_>) -> bool {
        read.local.contains(read.local_addr, read.len)
            && self.remote.get(read.remote_region).is_some_and(|r| r.contains(read.remote_addr, read.len))
            && usize::try_from(read.len).is_ok()
    }

    /// One `process_vm_readv` of `(local, remote, len)` ranges (at most
    /// [`MAX_RANGES_PER_CALL`]); every local range is memory this process may write: either a
    /// registered region (checked by [`SameHostPeer::read`]) or the probe's stack buffer.
    fn read_ranges(&self, ranges: &[(u64, u64, usize)]) -> Result<(), String> {
        let local: Vec<libc::iovec> = ranges.iter().map(|&(l, _, len)| libc::iovec { iov_base: l as *mut c_void, iov_len: len }).collect();
        let remote: Vec<libc::iovec> = ranges.iter().map(|&(_, r, len)| libc::iovec { iov_base: r as *mut c_void, iov_len: len }).collect();
        let expected: usize = ranges.iter().map(|r| r.2).sum();
        // SAFETY: process_vm_readv writes only into the local iovecs, each of which lies in
        // memory this process owns and keeps mapped for the call (a registered region, which
        // the engine unmaps only after close, or a local buffer); the remote ranges are read
        // in the other process and a bad one fails the call (EFAULT) instead of touching ours.
        // Both arrays hold `ranges.len()` iovecs, at most UIO_MAXIOV.
        let n = unsafe {
            libc::process_vm_readv(self.pid, local.as_ptr(), local.len() as libc::c_ulong, remote.as_ptr(), remote.len() as libc::c_ulong, 0)
        };
        if n < 0 {
            return Err(format!("process_vm_readv from process {}: {}", self.pid, std::io::Error::last_os_error()));
        }
        if n as usize != expected {
            return Err(format!("process_vm_readv from process {} read {n} of {expected} bytes", self.pid));
        }
        if self.exited() {
            return Err(format!("process {} exited during the read", self.pid));
        }
        Ok(())
    }

    /// Whether the process has exited (its pid may then name another process).
    fn exited(&self) -> bool {
        let mut fds = libc::pollfd { fd: self.pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd, zero timeout.
        let ready = unsafe { libc::poll(&mut fds, 1, 0) };
        ready != 0
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
            (Some("tcp, sm"), true),
            (Some("shm,self"), true),
            (Some("tcp,self"), false),
            (Some("rc,cuda_copy"), false),
            (Some("^cma"), false),
            (Some("^tcp"), true),
            (Some("^sm,tcp"), false),
        ] {
            assert_eq!(ucx_tls_allows_cma(tls), allowed, "UCX_TLS={tls:?}");
        }
    }

    #[test]
    fn the_probe_proves_the_process() {
        let probe = Probe::new().unwrap();
        let pid = std::process::id();
        assert!(SameHostPeer::open(pid, probe.addr(), probe.bytes(), Vec::new()).is_ok());
        let mut wrong = probe.bytes();
        wrong[0] ^= 1;
        let err = SameHostPeer::open(pid, probe.addr(), wrong, Vec::new()).err().unwrap();
        assert!(err.contains("another process"), "{err}");
        // A probe address the process does not map fails the read, not this process.
        let err = SameHostPeer::open(pid, 8, probe.bytes(), Vec::new()).err().unwrap();
        assert!(err.contains("process_vm_readv"), "{err}");
        let err = SameHostPeer::open(u32::MAX, probe.addr(), probe.bytes(), Vec::new()).err().unwrap();
        assert!(err.contains("out of range") || err.contains("pidfd_open"), "{err}");
    }

    #[test]
    fn a_process_that_exits_is_noticed_and_no_longer_read() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id() as libc::pid_t;
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        assert!(fd >= 0);
        // SAFETY: fd was just returned by pidfd_open and is owned by nobody else.
        let peer = SameHostPeer { pid, pidfd: unsafe { OwnedFd::from_raw_fd(fd as i32) }, remote: Vec::new() };
        assert!(!peer.exited());
        child.kill().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !peer.exited() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(peer.exited(), "an exited (not yet reaped) process is noticed");
        let mut buf = [0u8; 8];
        let err = peer.read_ranges(&[(buf.as_mut_ptr() as u64, 0x1000, buf.len())]).unwrap_err();
        assert!(err.contains("process_vm_readv") || err.contains("exited"), "{err}");
        child.wait().unwrap();
        let err = peer.read_ranges(&[(buf.as_mut_ptr() as u64, 0x1000, buf.len())]).unwrap_err();
        assert!(err.contains("No such process"), "{err}");
    }
}
