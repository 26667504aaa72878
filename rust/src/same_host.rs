//! Same-host reads: an engine on this host is read with `process_vm_readv`, many ranges per
//! system call, where UCX's cma transport makes one call per range. On a scattered batch of
//! small blocks the per-call cost (finding the process, the ptrace access check) is most of
//! the time, so this is what makes such batches faster than UCX itself.
//!
//! Host memory only, and only a process the kernel shows to be the peer on the other end of
//! the side channel the peer's metadata came on ([`PeerProcess::prove`]): a peer can therefore
//! only point a reader at regions of its own process. The reader keeps a pidfd to the process
//! and reports a read good only if the process was still alive after it, so a pid reused by
//! another process after the owner exited can never go unnoticed.
//!
//! Here: whether this host and UCX's configuration allow them, the peer read, and how a batch
//! is split into calls. The system call itself, and the checks that make it safe, are in
//! `ucx/process_read.rs` ([`CheckedCopy`]), with the crate's other `unsafe`.

use std::sync::Arc;

use crate::descriptors::RegionBounds;
use crate::ucx::{
    BatchState, CheckedCopy, PeerProcess, Piece, Read, MAX_BYTES_PER_CALL, MAX_RANGES_PER_CALL,
};

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

/// A process on this host whose memory is read directly.
pub struct SameHostPeer {
    process: Arc<PeerProcess>,
    /// The peer's registered regions (its `Peer`'s, shared), by the index the handshake gave
    /// them.
    remote: Arc<[RegionBounds]>,
}

impl SameHostPeer {
    /// Reads `process`, whose registered regions (as its metadata on the connection that
    /// proved it gave them) are `remote`.
    pub fn new(process: PeerProcess, remote: Arc<[RegionBounds]>) -> SameHostPeer {
        SameHostPeer { process: Arc::new(process), remote }
    }

    /// Checks every read to lie inside its local region and inside the peer region it names,
    /// and counts the batch as one unfinished read in `batch` until [`SameHostCopy::run`]
    /// ends it ([`CheckedCopy::prepare`]). Host memory only (the caller routes other memory
    /// to UCX).
    pub fn prepare(
        &self,
        reads: &[Read<'_>],
        batch: &Arc<BatchState>,
    ) -> Result<SameHostCopy, String> {
        CheckedCopy::prepare(&self.process, &self.remote, reads, batch).map(SameHostCopy)
    }
}

/// A checked same-host batch, to be copied once by [`SameHostCopy::run`] (on its peer's copy
/// thread); the batch settles when it has run, or failed when it is dropped without running
/// (so that it never stays pending).
pub struct SameHostCopy(CheckedCopy);

impl SameHostCopy {
    /// Copies the batch, or as much of it as it takes to notice that the batch was failed
    /// meanwhile (its deadline passed, its peer died, the engine closes), and settles it.
    pub fn run(self) {
        let copy = self.0;
        let result = copy_in_calls(copy.lengths(), || copy.failed(), |call| copy.read(call));
        copy.finish(result);
    }
}

/// Copies ranges of `lengths` with `read`, in calls of at most [`MAX_RANGES_PER_CALL`] pieces
/// and [`MAX_BYTES_PER_CALL`] bytes (a longer range is split), stopping early when `stop` says
/// so between calls.
pub(crate) fn copy_in_calls(
    lengths: impl ExactSizeIterator<Item = usize>,
    stop: impl Fn() -> bool,
    mut read: impl FnMut(&[Piece]) -> Result<(), String>,
) -> Result<(), String> {
    let mut call: Vec<Piece> = Vec::with_capacity(lengths.len().min(MAX_RANGES_PER_CALL));
    let mut call_bytes = 0usize;
    for (range, len) in lengths.enumerate() {
        let mut done = 0usize;
        while done < len {
            let piece = (len - done).min(MAX_BYTES_PER_CALL - call_bytes);
            call.push(Piece { range, offset: done, len: piece });
            call_bytes += piece;
            done += piece;
            if call.len() == MAX_RANGES_PER_CALL || call_bytes == MAX_BYTES_PER_CALL {
                if stop() {
                    return Err("stopped".to_owned());
                }
                read(&call)?;
                call.clear();
                call_bytes = 0;
            }
        }
    }
    if !call.is_empty() {
        if stop() {
            return Err("stopped".to_owned());
        }
        read(&call)?;
    }
    Ok(())
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

    /// The calls `copy_in_calls` makes for ranges of `lengths`.
    fn calls(lengths: &[usize]) -> Vec<Vec<Piece>> {
        let mut calls = Vec::new();
        let record = |call: &[Piece]| {
            calls.push(call.to_vec());
            Ok(())
        };
        copy_in_calls(lengths.iter().copied(), || false, record).unwrap();
        calls
    }

    #[test]
    fn calls_stay_within_the_per_call_limits_and_cover_every_byte_in_order() {
        // 2,500 scattered 64-byte ranges: three calls of at most 1,024 ranges.
        let made = calls(&[64; 2500]);
        assert_eq!(made.iter().map(Vec::len).collect::<Vec<_>>(), [1024, 1024, 452]);
        let pieces: Vec<Piece> = made.concat();
        assert!(pieces
            .iter()
            .enumerate()
            .all(|(i, p)| *p == Piece { range: i, offset: 0, len: 64 }));
        // More than the kernel copies in one call (~2 GiB): a 200 MiB range, then 40 of 64 MiB,
        // split into pieces of at most MAX_BYTES_PER_CALL.
        let mut lengths = vec![200usize << 20];
        lengths.extend([64usize << 20; 40]);
        let made = calls(&lengths);
        for call in &made {
            let bytes: usize = call.iter().map(|p| p.len).sum();
            assert!(bytes <= MAX_BYTES_PER_CALL && call.len() <= MAX_RANGES_PER_CALL);
        }
        let mut next = vec![0usize; lengths.len()];
        for piece in made.concat() {
            assert_eq!(piece.offset, next[piece.range], "in order, no gap, no overlap");
            next[piece.range] += piece.len;
        }
        assert_eq!(next, lengths, "every byte");
    }

    #[test]
    fn a_failed_batch_stops_between_calls() {
        let (mut made, checks) = (Vec::new(), std::cell::Cell::new(0));
        let stop = || {
            checks.set(checks.get() + 1);
            checks.get() > 1
        };
        let result = copy_in_calls([4096; 2048].into_iter(), stop, |call| {
            made.push(call.len());
            Ok(())
        });
        assert!(result.is_err());
        assert_eq!(made, [1024], "the first call made, nothing after the stop");
    }
}
