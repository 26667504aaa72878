//! kvduplex: move KV-cache blocks between inference engines with UCX one-sided reads.
//!
//! The nouns: an [`engine::Engine`] owns a UCX context/worker and a side-channel listener;
//! it registers memory *regions* and a block *layout*, connects to *peers* through a
//! versioned handshake, and posts *batch reads* planned by [`descriptors`]. The owner of the
//! read memory is *notified* once the last byte of a batch was read. An owner *holds* finished
//! requests' blocks for readers ([`holds`]) and answers *lookups* of held turns by content; it
//! announces what it holds, and a reader's [`held_index`] asks only the owners that may hold a
//! prompt.

mod clock;
pub mod descriptors;
pub mod engine;
pub mod handshake;
pub mod held_index;
pub mod holds;
mod same_host;
mod sender;
pub mod side_channel;
/// UCX and the system calls of same-host reads ([`same_host`]): the crate's only `unsafe`,
/// behind safe functions whose contracts the types keep; the one promise they cannot is the
/// `unsafe fn` that names memory to register ([`engine::RegionMemory`]). Crate-private:
/// [`engine::Engine`] and [`same_host`] are its users.
mod ucx;
/// The checks of a peer's packed worker address and remote keys (public for the fuzzer).
pub use ucx::packed as ucx_packed;

#[cfg(feature = "python")]
mod python;
