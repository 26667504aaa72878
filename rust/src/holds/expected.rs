//! Turns a decode node is computing and will hold when they finish: a lookup whose prompt
//! extends one of them is told "not yet" rather than "none held" ([`super::HoldBook::awaited`]).
//!
//! The race this closes: a client sends its next turn as soon as it has the answer, and the
//! prefill node's lookup can reach the decode node before that node's engine has taken the
//! finished turn's hold. The engine takes it one step after the request finishes, and a turn
//! that ends on a stop string is finished by an abort that vLLM's frontend sends only once the
//! client has its answer. Told "none held", the prefill node computes the whole history; told
//! "not yet", it asks again shortly, until its lookup's deadline.
//!
//! Pure state, bounded: at most [`MAX_EXPECTED`] turns, each prompt at most
//! [`super::MAX_FINGERPRINTS`] blocks (the hold book checks that), and a lookup's check is
//! linear in the lookup's own fingerprints.

use std::collections::HashMap;

use super::BlockFingerprint;

/// The most turns expected at once (a decode node runs at most `max_num_seqs` requests).
pub const MAX_EXPECTED: usize = 4096;

#[derive(Debug, Default)]
pub(super) struct ExpectedTurns {
    /// Request id → the fingerprints of its prompt's full blocks.
    prompts: HashMap<String, Vec<BlockFingerprint>>,
    /// (A prompt's last fingerprint, its blocks) → how many expected turns' prompts end so
    /// (by the chain, an equal fingerprint at an equal position means an equal prompt).
    ends: HashMap<(BlockFingerprint, usize), usize>,
}

impl ExpectedTurns {
    pub(super) fn len(&self) -> usize {
        self.prompts.len()
    }

    pub(super) fn contains(&self, request_id: &str) -> bool {
        self.prompts.contains_key(request_id)
    }

    /// Expects `request_id`'s turn, whose prompt's full blocks have `prompt`: false (nothing
    /// recorded) when the prompt has no full block (no lookup could extend it by content).
    pub(super) fn insert(&mut self, request_id: &str, prompt: Vec<BlockFingerprint>) -> bool {
        let Some(last) = prompt.last() else { return false };
        *self.ends.entry((*last, prompt.len())).or_default() += 1;
        self.prompts.insert(request_id.to_owned(), prompt);
        true
    }

    /// The turn is held or will not be: its prompt's fingerprints, if it was expected.
    pub(super) fn remove(&mut self, request_id: &str) -> Option<Vec<BlockFingerprint>> {
        let prompt = self.prompts.remove(request_id)?;
        if let Some(last) = prompt.last() {
            let end = (*last, prompt.len());
            if let Some(count) = self.ends.get_mut(&end) {
                *count -= 1;
                if *count == 0 {
                    self.ends.remove(&end);
                }
            }
        }
        Some(prompt)
    }

    /// The full blocks of the longest expected prompt that `fingerprints` extend (a strict
    /// prefix of them), or 0 when none.
    pub(super) fn extended_by(&self, fingerprints: &[BlockFingerprint]) -> usize {
        let shorter = fingerprints.len().saturating_sub(1);
        (1..=shorter)
            .rev()
            .find(|&len| self.ends.contains_key(&(fingerprints[len - 1], len)))
            .unwrap_or(0)
    }

    /// Every expected prompt's fingerprints, each once per prompt that has it.
    pub(super) fn fingerprints(&self) -> impl Iterator<Item = &BlockFingerprint> {
        self.prompts.values().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lookup_extends_an_expected_prompt_only_past_its_last_block() {
        let mut expected = ExpectedTurns::default();
        assert!(!expected.insert("empty", vec![]), "a prompt without a full block");
        assert!(expected.insert("a", vec![1, 2]));
        assert!(expected.insert("b", vec![1, 2, 3, 4]));
        assert_eq!(expected.extended_by(&[1, 2, 3]), 2);
        assert_eq!(expected.extended_by(&[1, 2, 3, 4, 5]), 4);
        // The prompt itself, or less of it, extends nothing.
        assert_eq!(expected.extended_by(&[1, 2]), 0);
        assert_eq!(expected.extended_by(&[2, 3, 4]), 0, "another position: another prompt");
        assert_eq!(expected.extended_by(&[1]), 0);
        assert_eq!(expected.extended_by(&[]), 0);
        assert_eq!(expected.remove("b"), Some(vec![1, 2, 3, 4]));
        assert_eq!(expected.extended_by(&[1, 2, 3, 4, 5]), 2);
        // Two turns with one prompt: the prompt stays expected until both are settled.
        assert!(expected.insert("a2", vec![1, 2]));
        assert!(expected.remove("a").is_some());
        assert_eq!(expected.extended_by(&[1, 2, 3]), 2);
        assert!(expected.remove("a2").is_some());
        assert_eq!(expected.extended_by(&[1, 2, 3]), 0);
        assert_eq!(expected.remove("a2"), None);
        assert_eq!((expected.len(), expected.fingerprints().count()), (0, 0));
    }
}
