//! Where this engine's handed-off prompts went: by a prompt's **end** (the chained fingerprint
//! of all its tokens, as in `expected.rs`), the engines granted the prompt that this engine
//! held for a decode node. The turn that continues such a prompt is computed on one of them:
//! a lookup whose prompt continues it asks those engines, and others only as their
//! announcements say ([`super::HoldBook::handed_to`]), instead of every engine.
//!
//! An end handed off twice (two conversations opening with the same prompt) is ambiguous: the
//! engine computing one of the turns may have been granted nothing (it had the prompt cached),
//! so such an end names no engine and its lookups ask every engine, as do ends forgotten or
//! never granted. A router's failover after the first engine read the prompt is not seen
//! either (the prompt's hold ended with that read): its lookups ask that first engine, and
//! every engine once it is gone.
//!
//! Pure state, bounded: the latest [`MAX_HANDED`] prompts, the latest [`MAX_ENGINES`] engines
//! of each, engine ids of at most [`MAX_ENGINE_ID_BYTES`].

use std::collections::{HashMap, VecDeque};

use super::BlockFingerprint;

/// The most handed-off prompts remembered (older ones are asked for as before: everywhere).
pub const MAX_HANDED: usize = 4096;
/// The most engines remembered per prompt.
const MAX_ENGINES: usize = 4;
/// Longer engine ids (a peer's value) are not remembered: their prompts ask every engine.
const MAX_ENGINE_ID_BYTES: usize = 256;

#[derive(Debug)]
enum Handed {
    /// The engines granted the prompt, oldest first.
    To(Vec<String>),
    /// Handed off more than once: no engine can be named.
    Ambiguous,
}

#[derive(Debug, Default)]
pub(super) struct HandedOff {
    prompts: HashMap<BlockFingerprint, Handed>,
    /// Ends, oldest first.
    order: VecDeque<BlockFingerprint>,
}

impl HandedOff {
    /// A prompt that ends with `end` is held for a decode node.
    pub(super) fn held(&mut self, end: BlockFingerprint) {
        match self.prompts.get_mut(&end) {
            Some(handed) => *handed = Handed::Ambiguous,
            None => self.insert(end),
        }
    }

    /// The engine `engine_id` was granted the prompt that ends with `end`.
    pub(super) fn granted(&mut self, end: BlockFingerprint, engine_id: &str) {
        if engine_id.len() > MAX_ENGINE_ID_BYTES {
            return;
        }
        let Some(handed) = self.prompts.get_mut(&end) else {
            // Forgotten since it was held: a prompt held this long ago is not asked for.
            return;
        };
        let Handed::To(engines) = handed else { return };
        if let Some(at) = engines.iter().position(|known| known == engine_id) {
            engines.remove(at);
        } else if engines.len() >= MAX_ENGINES {
            engines.remove(0);
        }
        engines.push(engine_id.to_owned());
    }

    /// The engines granted the prompt that ends with `end`, oldest first (none: unknown,
    /// ambiguous or granted to none).
    pub(super) fn engines(&self, end: BlockFingerprint) -> &[String] {
        match self.prompts.get(&end) {
            Some(Handed::To(engines)) => engines,
            _ => &[],
        }
    }

    /// A prompt held for the first time: no engine granted it yet.
    fn insert(&mut self, end: BlockFingerprint) {
        if self.order.len() >= MAX_HANDED {
            if let Some(oldest) = self.order.pop_front() {
                self.prompts.remove(&oldest);
            }
        }
        self.order.push_back(end);
        self.prompts.insert(end, Handed::To(Vec::new()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_names_its_latest_engines_until_handed_off_again_or_forgotten() {
        let mut handed = HandedOff::default();
        handed.granted(1, "d1");
        assert!(handed.engines(1).is_empty(), "granted but never held here: not remembered");
        handed.held(1);
        assert!(handed.engines(1).is_empty());
        handed.granted(1, "d1");
        handed.granted(1, "d1");
        assert_eq!(handed.engines(1), ["d1"]);
        for engine in ["d2", "d3", "d4", "d5"] {
            handed.granted(1, engine);
        }
        assert_eq!(handed.engines(1), ["d2", "d3", "d4", "d5"]);
        handed.granted(1, &"x".repeat(MAX_ENGINE_ID_BYTES + 1));
        assert_eq!(handed.engines(1), ["d2", "d3", "d4", "d5"], "a long id is not kept");
        // The same prompt handed off again: no engine can be named any more.
        handed.held(1);
        handed.granted(1, "d6");
        assert!(handed.engines(1).is_empty());
        // The oldest prompts are forgotten first.
        for end in 2..=MAX_HANDED as u64 {
            handed.held(end);
            handed.granted(end, "d1");
        }
        assert_eq!(handed.engines(2), ["d1"]);
        handed.held(MAX_HANDED as u64 + 1);
        assert!(!handed.prompts.contains_key(&1), "the oldest prompt went first");
        assert_eq!(handed.engines(2), ["d1"]);
        assert_eq!((handed.prompts.len(), handed.order.len()), (MAX_HANDED, MAX_HANDED));
    }
}
