//! Renewing the lease of a prompt held for a decode node while that node has the request
//! queued: the decode node asks for its grant only once vLLM's waiting loop reaches the
//! request, which may be later than the lease, so from the moment its scheduler sees the
//! request it renews the hold ([`HoldBook::renew`], sent as a notification over the side
//! channel, see `kvduplex.protocol`).
//!
//! A renewal is a peer's input, bounded like a grant: it names the hold and presents the
//! fingerprint of the reader's own first block, which must equal the hold's (what a grant
//! needs at least). Only a prompt held for a decode node, not ended, not past its lease and
//! not claimed yet is renewed (a claim keeps it from then on); a renewal extends the lease to
//! `now` plus the first lease's length, never past [`MAX_RENEWED_LIFE`] first leases from
//! when it was taken, so no peer keeps blocks for ever. A renewal does not count as a read:
//! an unclaimed prompt is evicted under memory pressure as before ([`super::Evict`]).

use std::time::Instant;

use super::{BlockFingerprint, HoldBook, HoldKind, MAX_REQUEST_ID_BYTES};
use crate::clock::later;

/// A hold lives at most this many of its first leases, renewed or not.
pub const MAX_RENEWED_LIFE: u32 = 10;

impl HoldBook {
    /// Renews the lease of `request_id`'s prompt held for a decode node, for a reader whose
    /// prompt's first block has the fingerprint `first`; returns the lease's new end, or `None`
    /// when nothing was renewed: no such hold (unknown, not a prompt for a decode node, ended,
    /// past its lease or claimed) or other tokens.
    pub fn renew(
        &mut self,
        request_id: &str,
        first: BlockFingerprint,
        now: Instant,
    ) -> Option<Instant> {
        if request_id.len() > MAX_REQUEST_ID_BYTES {
            return None;
        }
        let held = self.held.get_mut(request_id)?;
        let renewable = held.kind == HoldKind::ForDecode
            && !held.ended
            && held.lease_ends > now
            && held.claims.is_empty()
            && held.fingerprints.first() == Some(&first);
        if !renewable {
            return None;
        }
        let until = later(now, held.lease).min(held.life_ends);
        held.lease_ends = held.lease_ends.max(until);
        Some(held.lease_ends)
    }
}
