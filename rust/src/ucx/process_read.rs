//! The system call of same-host reads, fenced: `process_vm_readv` from a proven peer process
//! ([`PeerProcess`]) into the local ranges of a checked batch ([`CheckedCopy`]). Which peers are
//! read this way, and how a batch is split into calls, is [`crate::same_host`]'s.
//!
//! The types keep the system call's contract: a [`CheckedCopy`] is made only of reads checked
//! to lie inside a local region that its batch holds from then on (registered, so allocated:
//! [`super::RegionMemory`]'s promise, which also hands the batch's blocks to it until it
//! settles), and it reads only pieces of those ranges, at most one call's worth at a time.

use std::ffi::c_void;
use std::sync::Arc;

use super::endpoint::check_bounds;
use super::peer_process::PeerProcess;
use super::{BatchState, Read};
use crate::descriptors::RegionBounds;

/// Most ranges one `process_vm_readv` call takes on each side (Linux's `UIO_MAXIOV`).
pub const MAX_RANGES_PER_CALL: usize = 1024;

/// Most bytes one call copies: far below the kernel's cap of one call (`MAX_RW_COUNT`, just
/// under 2 GiB, past which it silently stops short), and small enough that a batch failed
/// meanwhile (deadline, dead peer) stops within a few tens of milliseconds.
pub const MAX_BYTES_PER_CALL: usize = 64 << 20;

/// One range of a same-host read: `len` bytes from the peer's `remote` into our `local`.
#[derive(Clone, Copy)]
struct Range {
    local: u64,
    remote: u64,
    len: usize,
}

/// `len` bytes at `offset` into range `range` of a [`CheckedCopy`] (its ranges are its reads,
/// in order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub range: usize,
    pub offset: usize,
    pub len: usize,
}

/// A same-host batch checked for reading from `process`; counted as one unfinished read of its
/// batch until dropped (failed then if it was never [`CheckedCopy::finish`]ed), so that it
/// never stays pending.
pub struct CheckedCopy {
    process: Arc<PeerProcess>,
    ranges: Vec<Range>,
    /// Holds the registered regions the ranges write into (checked by `prepare`), so that they
    /// stay registered, and so allocated ([`super::RegionMemory`]'s promise), for as long
    /// as the copy exists.
    batch: Arc<BatchState>,
    finished: bool,
}

impl CheckedCopy {
    /// Checks every read to lie inside its local region and inside the peer region (of
    /// `remote`, `process`'s registered regions) it names, and counts the batch as one
    /// unfinished read in `batch` until the copy is dropped. The batch, which the copy holds,
    /// holds the local regions from here on ([`BatchState`]). Host memory only (the caller
    /// routes other memory to UCX).
    pub fn prepare(
        process: &Arc<PeerProcess>,
        remote: &[RegionBounds],
        reads: &[Read<'_>],
        batch: &Arc<BatchState>,
    ) -> Result<CheckedCopy, String> {
        check_bounds(reads, remote)?;
        let ranges = reads
            .iter()
            .map(|r| Range { local: r.local_addr, remote: r.remote_addr, len: r.len as usize })
            .collect();
        batch.hold_regions(reads);
        batch.start_reads(1);
        Ok(CheckedCopy {
            process: Arc::clone(process),
            ranges,
            batch: Arc::clone(batch),
            finished: false,
        })
    }

    /// The length of each range, in order.
    pub fn lengths(&self) -> impl ExactSizeIterator<Item = usize> + '_ {
        self.ranges.iter().map(|r| r.len)
    }

    /// Whether the batch was failed meanwhile (its deadline passed, its peer died, the engine
    /// closes): the copy should stop.
    pub fn failed(&self) -> bool {
        self.batch.has_failed()
    }

    /// One `process_vm_readv` of `pieces` (at most [`MAX_RANGES_PER_CALL`] of them and
    /// [`MAX_BYTES_PER_CALL`] bytes, each inside its range); anything short of every byte is an
    /// error.
    pub fn read(&self, pieces: &[Piece]) -> Result<(), String> {
        if pieces.len() > MAX_RANGES_PER_CALL {
            return Err(format!("{} pieces in one call", pieces.len()));
        }
        let mut bytes = 0usize;
        let mut call = Vec::with_capacity(pieces.len());
        for piece in pieces {
            let range = self.ranges.get(piece.range);
            let end = piece.offset.checked_add(piece.len);
            let Some(range) = range.filter(|r| end.is_some_and(|end| end <= r.len)) else {
                return Err(format!("{piece:?} lies outside the copy's ranges"));
            };
            bytes = bytes.saturating_add(piece.len);
            call.push(Range {
                local: range.local + piece.offset as u64,
                remote: range.remote + piece.offset as u64,
                len: piece.len,
            });
        }
        if bytes > MAX_BYTES_PER_CALL {
            return Err(format!("{bytes} bytes in one call"));
        }
        // SAFETY: each piece lies inside a range that `prepare` checked to lie in a local
        // region the batch holds, so registered, and so allocated (RegionMemory's promise)
        // while `self` exists; the promise also hands the batch's blocks to it until it
        // settles, which it does not before `self` is dropped.
        unsafe { read_ranges(&self.process, &call) }
    }

    /// Ends the copy with `result`, which fails the batch when it is an error.
    pub fn finish(mut self, result: Result<(), String>) {
        if let Err(e) = result {
            self.batch.record_read_error(e);
        }
        self.finished = true;
    }
}

impl Drop for CheckedCopy {
    fn drop(&mut self) {
        if !self.finished {
            self.batch.record_read_error("the same-host copy never ran".to_owned());
        }
        let _ = self.batch.reads_finished(1);
    }
}

/// One `process_vm_readv` of at most [`MAX_RANGES_PER_CALL`] ranges and
/// [`MAX_BYTES_PER_CALL`] bytes from `process`; anything short of every byte is an error, and
/// so is `process` having exited by the end of the call.
///
/// # Safety
/// Every local range must be memory of this process that stays mapped and writable for the
/// whole call and that no one else reads or writes meanwhile.
unsafe fn read_ranges(process: &PeerProcess, ranges: &[Range]) -> Result<(), String> {
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
            process.raw_pid(),
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
            process.pid(),
            std::io::Error::last_os_error()
        ));
    }
    if n as usize != expected {
        return Err(format!("process_vm_readv from process {} read {n} of {expected} bytes (a remote range is not mapped)", process.pid()));
    }
    if process.exited() {
        return Err(format!("process {} exited during the read", process.pid()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::same_host::copy_in_calls;

    /// This process, proven as the holder of the other end of a loopback connection.
    fn own_process() -> Arc<PeerProcess> {
        use std::os::fd::AsRawFd;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        let fd = accepted.as_raw_fd() as u32;
        Arc::new(PeerProcess::prove(&client, std::process::id(), fd).unwrap())
    }

    /// Copies `ranges` from `process` in the calls same-host reads make.
    ///
    /// # Safety
    /// As [`read_ranges`], for every range.
    unsafe fn copy(process: &PeerProcess, ranges: &[Range]) -> Result<(), String> {
        copy_in_calls(
            ranges.iter().map(|r| r.len),
            || false,
            |call| {
                let call: Vec<Range> = call
                    .iter()
                    .map(|p| Range {
                        local: ranges[p.range].local + p.offset as u64,
                        remote: ranges[p.range].remote + p.offset as u64,
                        len: p.len,
                    })
                    .collect();
                // SAFETY: pieces of the caller's ranges, which it vouches for.
                unsafe { read_ranges(process, &call) }
            },
        )
    }

    #[test]
    fn copies_cross_the_per_call_limits_byte_for_byte() {
        let process = own_process();
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
        unsafe { copy(&process, &ranges) }.unwrap();
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
        unsafe { copy(&process, &ranges) }.unwrap();
        assert_eq!(into[(64 << 20)..], block[(64 << 20)..]);
        assert_eq!(into[..(64 << 20)], block[4096..(64 << 20) + 4096]);
    }

    #[test]
    fn a_copy_keeps_the_region_it_writes_into_registered_until_it_ends_and_reads_only_it() {
        let worker = super::super::Worker::new("copy-holds-regions", None).expect("UCX loads");
        let source = vec![5u8; 4096];
        let mut dest = vec![0u8; 4096];
        // SAFETY: `dest` is this test's, declared before the region and the copy, so it
        // outlives them; it is read only once the copy ran.
        let memory = unsafe { super::super::RegionMemory::new(dest.as_mut_ptr() as u64, 4096) };
        let into = Arc::new(worker.register(memory).unwrap());
        let bounds = RegionBounds { addr: source.as_ptr() as u64, len: 4096 };
        let batch = BatchState::new(&worker, Arc::default(), 0);
        let read = Read {
            local_addr: into.addr,
            local: &into,
            remote_addr: bounds.addr,
            remote_region: 0,
            len: 4096,
        };
        let copy = CheckedCopy::prepare(&own_process(), &[bounds], &[read], &batch).unwrap();
        let registered = Arc::downgrade(&into);
        drop((into, batch));
        assert!(registered.upgrade().is_some(), "the caller's region went, the copy's stays");
        let piece = |range, offset, len| Piece { range, offset, len };
        assert!(copy.read(&[piece(1, 0, 8)]).is_err(), "no such range");
        assert!(copy.read(&[piece(0, 4090, 8)]).is_err(), "past the range's end");
        assert!(copy.read(&[piece(0, usize::MAX, 2)]).is_err(), "past the address space");
        assert!(copy.read(&vec![piece(0, 0, 1); MAX_RANGES_PER_CALL + 1]).is_err());
        assert_eq!(dest, [0u8; 4096], "nothing read by a refused call");
        let result = copy.read(&[piece(0, 0, 4096)]);
        copy.finish(result);
        assert_eq!(dest, source);
        assert!(registered.upgrade().is_none(), "unregistered once the copy is gone");
    }

    #[test]
    fn a_process_that_exits_is_noticed_and_no_longer_read() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let process = PeerProcess::open(child.id() as libc::pid_t).unwrap();
        assert!(!process.exited());
        child.kill().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !process.exited() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(process.exited(), "an exited (not yet reaped) process is noticed");
        child.wait().unwrap();
        let mut buf = [0u8; 8];
        let range = Range { local: buf.as_mut_ptr() as u64, remote: 0x1000, len: buf.len() };
        // SAFETY: the local range is `buf`.
        let err = unsafe { read_ranges(&process, &[range]) }.unwrap_err();
        assert!(err.contains("No such process"), "{err}");
    }
}
