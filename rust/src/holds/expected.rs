//! Turns a decode node is computing and will hold when they finish: a lookup that says its
//! prompt continues one of them is told "not yet" rather than "none held"
//! ([`super::HoldBook::awaited`]).
//!
//! The race this closes: a client sends its next turn as soon as it has the answer, and the
//! prefill node's lookup can reach the decode node before that node's engine has taken the
//! finished turn's hold. The engine takes it one step after the request finishes, and a turn
//! that ends on a stop string is finished by an abort that vLLM's frontend sends only once the
//! client has its answer. Told "none held", the prefill node computes the whole history; told
//! "not yet", it asks again shortly, until its lookup's deadline.
//!
//! A turn is known by its prompt's **end**: the chained fingerprint of all the prompt's tokens
//! (a partial last block's covers the tokens it has). The reader names the end of the prompt it
//! handed to a decode node when its new prompt continues exactly that prompt, tokens of the
//! partial last block included: so a prompt that merely shares full blocks with a turn being
//! computed (a common system prompt) never waits for it.
//!
//! Pure state, bounded: at most [`MAX_EXPECTED`] turns.

use std::collections::HashMap;

use super::BlockFingerprint;

/// The most turns expected at once (a decode node runs at most `max_num_seqs` requests).
pub const MAX_EXPECTED: usize = 4096;

#[derive(Debug, Default)]
pub(super) struct ExpectedTurns {
    /// Request id → its prompt's end.
    ends: HashMap<String, BlockFingerprint>,
    /// A prompt's end → how many expected turns have it.
    counts: HashMap<BlockFingerprint, usize>,
}

impl ExpectedTurns {
    pub(super) fn len(&self) -> usize {
        self.ends.len()
    }

    pub(super) fn contains(&self, request_id: &str) -> bool {
        self.ends.contains_key(request_id)
    }

    pub(super) fn insert(&mut self, request_id: &str, end: BlockFingerprint) {
        if self.ends.insert(request_id.to_owned(), end).is_none() {
            *self.counts.entry(end).or_default() += 1;
        }
    }

    /// The turn is held or will not be; false if it was not expected.
    pub(super) fn remove(&mut self, request_id: &str) -> bool {
        let Some(end) = self.ends.remove(request_id) else { return false };
        if let Some(count) = self.counts.get_mut(&end) {
            *count -= 1;
            if *count == 0 {
                self.counts.remove(&end);
            }
        }
        true
    }

    /// Whether a turn whose prompt ends with `end` is being computed.
    pub(super) fn computing(&self, end: BlockFingerprint) -> bool {
        self.counts.contains_key(&end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_end_is_expected_until_every_turn_with_it_is_settled() {
        let mut expected = ExpectedTurns::default();
        expected.insert("a", 7);
        expected.insert("a", 7);
        expected.insert("b", 7);
        expected.insert("c", 9);
        assert_eq!(expected.len(), 3);
        assert!(expected.computing(7) && expected.computing(9) && !expected.computing(8));
        assert!(expected.remove("a"));
        assert!(!expected.remove("a"));
        assert!(expected.computing(7), "b computes the same prompt");
        assert!(expected.remove("b"));
        assert!(!expected.computing(7));
        assert!(expected.contains("c") && !expected.contains("b"));
    }
}
