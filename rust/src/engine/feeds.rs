//! What owners announce they hold, both sides: an owner's [`BookFeed`] reads its hold book for
//! the readers connected to its side channel; a reader's [`IndexFeed`] keeps one link's
//! announcements in its [`HeldIndex`], which lookups consult to ask only the owners that may
//! hold a prompt.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::lock;
use crate::held_index::{HeldIndex, OwnerSlot, OwnerState};
use crate::holds::feed::{FeedWatch, HeldUpdate};
use crate::holds::HoldBook;
use crate::side_channel::{HeldSink, HeldSource};

/// Announces an engine's hold book to the readers connected to its side channel.
pub(super) struct BookFeed {
    holds: Weak<Mutex<HoldBook>>,
    watch: Arc<FeedWatch>,
}

impl BookFeed {
    pub(super) fn new(holds: &Arc<Mutex<HoldBook>>) -> Self {
        Self { watch: lock(holds).feed_watch(), holds: Arc::downgrade(holds) }
    }
}

impl HeldSource for BookFeed {
    fn updates_since(&self, cursor: Option<u64>) -> (u64, Vec<HeldUpdate>) {
        match self.holds.upgrade() {
            Some(holds) => lock(&holds).held_since(cursor),
            None => (cursor.unwrap_or(0), Vec::new()),
        }
    }

    fn wait_past(&self, cursor: u64, wait: Duration, stop: &AtomicBool) {
        self.watch.wait_past(cursor, wait, stop);
    }

    fn wake(&self) {
        self.watch.wake();
    }
}

/// One link's announcements, fed into the engine's index; forgotten when dropped (the link
/// ended, or its handshake failed before it began).
pub(super) struct IndexFeed {
    index: Arc<Mutex<HeldIndex>>,
    slot: OwnerSlot,
    address: String,
}

impl IndexFeed {
    /// The index's entry for a new connection to the owner at `address`.
    pub(super) fn open(index: &Arc<Mutex<HeldIndex>>, address: &str) -> Self {
        let slot = lock(index).open(address);
        Self { index: Arc::clone(index), slot, address: address.to_owned() }
    }

    pub(super) fn into_sink(self) -> HeldSink {
        Box::new(move |update| {
            let (overflowed, state) = {
                let mut index = lock(&self.index);
                (index.apply(self.slot, &update), index.state(&self.address))
            };
            if overflowed {
                log::warn!(
                    "the owner at {} announced more than the index keeps of one owner ({} \
                     fingerprints): it is asked on every lookup until it reconnects",
                    self.address,
                    crate::held_index::MAX_ENTRIES_PER_OWNER
                );
            } else if update.synced && state == Some(OwnerState::Synced) {
                log::debug!("the owner at {} announced all it holds", self.address);
            }
        })
    }
}

impl Drop for IndexFeed {
    fn drop(&mut self) {
        lock(&self.index).close(self.slot);
    }
}
