//! Where this engine's handed-off prompts went: by a prompt's **end** (the chained fingerprint
//! of all its tokens, as in `expected.rs`), the readers granted the prompt that this engine
//! held for a decode node. The turn that continues such a prompt is computed on one of them:
//! a lookup whose prompt continues it asks those engines, and others only as their
//! announcements say ([`super::HoldBook::handed_to`]), instead of every engine.
//!
//! Pure state, bounded: the latest [`MAX_HANDED`] prompts, the latest [`MAX_READERS`] readers
//! of each.

use std::collections::{HashMap, VecDeque};

use super::BlockFingerprint;

/// The most handed-off prompts remembered (older ones are asked for as before: everywhere).
pub const MAX_HANDED: usize = 4096;
/// The most readers remembered per prompt (a second one is a router's failover).
const MAX_READERS: usize = 4;

#[derive(Debug, Default)]
pub(super) struct HandedOff {
    readers: HashMap<BlockFingerprint, Vec<String>>,
    /// Ends, oldest first.
    order: VecDeque<BlockFingerprint>,
}

impl HandedOff {
    /// `reader` was granted the prompt that ends with `end`.
    pub(super) fn record(&mut self, end: BlockFingerprint, reader: &str) {
        if let Some(readers) = self.readers.get_mut(&end) {
            if let Some(at) = readers.iter().position(|known| known == reader) {
                readers.remove(at);
            } else if readers.len() >= MAX_READERS {
                readers.remove(0);
            }
            readers.push(reader.to_owned());
            return;
        }
        if self.order.len() >= MAX_HANDED {
            if let Some(oldest) = self.order.pop_front() {
                self.readers.remove(&oldest);
            }
        }
        self.order.push_back(end);
        self.readers.insert(end, vec![reader.to_owned()]);
    }

    /// The readers granted the prompt that ends with `end`, oldest first (none: unknown).
    pub(super) fn readers(&self, end: BlockFingerprint) -> &[String] {
        self.readers.get(&end).map_or(&[], Vec::as_slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_keeps_its_latest_readers_and_the_oldest_prompts_are_forgotten() {
        let mut handed = HandedOff::default();
        handed.record(1, "d1#1");
        handed.record(1, "d1#1");
        assert_eq!(handed.readers(1), ["d1#1"]);
        for reader in ["d2#1", "d3#1", "d4#1", "d5#1"] {
            handed.record(1, reader);
        }
        assert_eq!(handed.readers(1), ["d2#1", "d3#1", "d4#1", "d5#1"]);
        assert!(handed.readers(2).is_empty());
        for end in 2..=MAX_HANDED as u64 {
            handed.record(end, "d1#1");
        }
        assert_eq!(handed.readers(1).len(), 4, "{MAX_HANDED} prompts fit");
        handed.record(MAX_HANDED as u64 + 1, "d1#1");
        assert!(handed.readers(1).is_empty(), "the oldest prompt went first");
        assert_eq!(handed.readers(2), ["d1#1"]);
        assert_eq!(handed.readers.len(), MAX_HANDED);
        assert_eq!(handed.order.len(), MAX_HANDED);
    }
}
