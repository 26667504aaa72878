//! The request ids of holds that ended, remembered for [`ENDED_KEEP`] (at most
//! [`MAX_ENDED_KEPT`] of them), so a reader late for one is told it ended rather than that it
//! is not held yet ([`super::Refusal::Ended`]).

use std::collections::{HashSet, VecDeque};
use std::time::Instant;

use super::{ENDED_KEEP, MAX_ENDED_KEPT};
use crate::clock::later;

#[derive(Debug, Default)]
pub(super) struct EndedHolds {
    /// Oldest first, with when each is forgotten.
    pub(super) order: VecDeque<(String, Instant)>,
    pub(super) ids: HashSet<String>,
}

impl EndedHolds {
    pub(super) fn contains(&self, request_id: &str) -> bool {
        self.ids.contains(request_id)
    }

    /// Remembers `request_id` until `now + ENDED_KEEP`, forgetting the oldest when full.
    pub(super) fn remember(&mut self, request_id: &str, now: Instant) {
        if self.ids.contains(request_id) {
            return;
        }
        if self.order.len() >= MAX_ENDED_KEPT {
            if let Some((oldest, _)) = self.order.pop_front() {
                self.ids.remove(&oldest);
            }
        }
        self.order.push_back((request_id.to_owned(), later(now, ENDED_KEEP)));
        self.ids.insert(request_id.to_owned());
    }

    /// Forgets those kept until `now` or earlier.
    pub(super) fn forget_old(&mut self, now: Instant) {
        while let Some((id, keep_until)) = self.order.front() {
            if *keep_until > now {
                break;
            }
            self.ids.remove(id);
            self.order.pop_front();
        }
    }
}
