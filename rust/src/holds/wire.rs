//! The lookup messages between a reader and an owner's book: what the reader asks, and the
//! claimed match (or "not yet") the owner answers.

use serde::{Deserialize, Serialize};

use super::BlockFingerprint;

/// What a reader asks: "grant me the held turn starting with these blocks" (a lookup), or,
/// with `request_id`, "grant me that hold's blocks that carry these blocks' tokens".
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LookupRequest {
    /// Echoed in the reply, so one connection can carry several lookups.
    pub id: u64,
    pub fingerprints: Vec<BlockFingerprint>,
    /// The hold the reader's params name; `None` asks every offered turn.
    #[serde(default)]
    pub request_id: Option<String>,
    /// A lookup's prompt continues the prompt with this end (the chained fingerprint of all
    /// its tokens), which the reader handed to a decode node: if the owner is computing that
    /// turn, it answers "not yet" ([`super::HoldBook::awaited`]).
    #[serde(default)]
    pub continues: Option<BlockFingerprint>,
}

/// The longest held prefix of a lookup's blocks, claimed for the reader.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LookupMatch {
    pub owner_request_id: String,
    /// The first `matched_blocks` of the turn's blocks hold the reader's first blocks.
    pub matched_blocks: u32,
    /// Release this claim when the read is done (or not done).
    pub claim_id: u64,
    /// The turn stays allocated at least this long for this reader.
    pub claim_ms: u64,
    /// What the owner offered with the hold: its `kv_transfer_params` for the whole turn.
    pub offer: Vec<u8>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LookupReply {
    pub id: u64,
    pub found: Option<LookupMatch>,
    /// Nothing granted, and the named hold was never seen, or a lookup continues a turn the
    /// owner is still computing ([`super::HoldBook::awaited`]): the owner may not have taken the hold
    /// yet (its engine registers a hold one step after the request finishes), so asking again
    /// shortly may find it.
    #[serde(default)]
    pub not_yet: bool,
}
