//! The side channel over TCP: an owner's [`SideChannelServer`] hands its metadata to readers
//! and receives their notifications; a reader's [`PeerLink`] is the kept-open, authenticated
//! connection to one owner.
//!
//! Blocking `std::net` sockets with a thread per connection; the protocol decisions (framing,
//! auth, liveness) are made by [`crate::handshake`]. Every read during a handshake is bounded
//! by a deadline and every established link by its peer's heartbeat, so no peer can pin a
//! thread, and [`SideChannelServer::shutdown`] unblocks every thread by shutting its socket.
//!
//! Rooms: `server` (the owner's side: accepting readers, the handshake, notifications and
//! lookups), `announce` (the owner's side: telling each reader what its lookups can find),
//! `link` (the reader's side: one kept-open link, its lookups and the owner's announcements),
//! `outbox` (a link's frames, written by its own thread, so a stalled owner stalls only it),
//! `framing` (frames over a blocking socket, their authentication, and the liveness loop both
//! sides run); this module keeps the bounds, the configuration and what both sides share.

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use log::{info, warn};

use crate::clock::{deadline_after, later};
use crate::handshake::auth::{self, Direction, FrameAuth};
use crate::handshake::peers::{Liveness, LivenessAction};
use crate::handshake::wire::{
    self, AuthProof, ClientHello, Frame, FrameBuffer, Refusal, ServerHello,
};
use crate::handshake::{EngineMetadata, Fingerprint, HandshakeError};
use crate::holds::{LookupReply, LookupRequest};
use crate::sender::sender_name;

mod announce;
mod framing;
mod link;
mod outbox;
mod server;

pub use announce::HeldSource;
use framing::*;
pub use link::{HeldSink, LookupOutcome, LookupReplyHandler, PeerLink};
pub use outbox::MAX_QUEUED_BYTES;
pub use server::SideChannelServer;

/// How long the server gives a client to complete the handshake.
pub const SERVER_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once, handshaking or established; more are refused.
pub const MAX_CONNECTIONS: usize = 1024;
/// Connections still in their handshake (not yet authenticated) at once; a new one past it
/// closes the oldest, so idle or slow-drip sockets can neither take every slot nor keep a
/// thread each beyond this bound, and a real peer (whose handshake takes milliseconds) still
/// gets through.
pub const MAX_PENDING_HANDSHAKES: usize = 64;
/// Notifications received and not yet taken, and their payloads' bytes; past either, new ones
/// are dropped, logged and counted (a dropped release only delays freeing until the hold's own
/// end). Notifications carry request ids, so real ones stay far below both.
pub const MAX_QUEUED_NOTIFICATIONS: usize = 65_536;
pub const MAX_QUEUED_NOTIFICATION_BYTES: usize = 64 << 20;
/// Connections served at once from one IP address; more from it are refused. Peers on this
/// host all connect from the loopback address, so this bounds what local processes together
/// may hold (a real engine holds one connection per engine it reads from or looks up).
pub const MAX_CONNECTIONS_PER_ADDRESS: usize = 256;
/// Bounds every write, so a peer that stops reading cannot block its writer forever.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the accept loop checks for shutdown: std cannot interrupt a blocking `accept`,
/// so the listener is non-blocking and polled.
const ACCEPT_POLL: Duration = Duration::from_millis(20);
const READ_CHUNK: usize = 16 << 10;

#[derive(Clone)]
pub struct SideChannelConfig {
    pub host: String,
    /// 0 picks a free port; see [`SideChannelServer::local_addr`].
    pub port: u16,
    /// Shared secret both sides must hold; `None` serves without authentication.
    pub secret: Option<Vec<u8>>,
    /// How often each established connection is pinged.
    pub heartbeat: Duration,
    /// Listen on a non-loopback address without a shared secret (trusted networks only).
    pub allow_unauthenticated: bool,
}

impl Default for SideChannelConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".to_owned(),
            port: 0,
            secret: None,
            heartbeat: Duration::from_secs(1),
            allow_unauthenticated: false,
        }
    }
}

// By hand, so the secret never lands in a log.
impl fmt::Debug for SideChannelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SideChannelConfig")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .field("heartbeat", &self.heartbeat)
            .finish()
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// Who sent it: see [`sender_name`].
    pub sender: String,
    pub payload: Vec<u8>,
}

type Waker = Arc<dyn Fn() + Send + Sync>;

/// Answers a lookup from the named sender (see [`sender_name`]).
pub type LookupHandler = Arc<dyn Fn(&str, &LookupRequest) -> LookupReply + Send + Sync>;

/// An authenticated client that announced where its own side channel listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KnownPeer {
    pub engine_id: String,
    pub side_channel: String,
}

pub(super) fn unexpected(expected: &str, got: &Frame) -> HandshakeError {
    HandshakeError::Malformed(format!("expected a {expected} frame, got a {:?} frame", got.kind()))
}

/// Loopback addresses (and `localhost`) are reachable from this host only.
pub(super) fn is_loopback(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    match bare.parse::<std::net::IpAddr>() {
        Ok(ip) => ip.is_loopback(),
        Err(_) => bare.eq_ignore_ascii_case("localhost"),
    }
}

pub(super) fn check_secret(secret: Option<&[u8]>) -> Result<(), HandshakeError> {
    match secret {
        Some([]) => Err(HandshakeError::Config("the shared secret is empty".to_owned())),
        _ => Ok(()),
    }
}

/// A poisoned lock only means another thread panicked while holding it; the data (queues,
/// sockets, statuses) stays consistent at every point a panic could occur.
pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
