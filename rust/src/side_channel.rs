//! The side channel over TCP: an owner's [`SideChannelServer`] hands its metadata to readers
//! and receives their notifications; a reader's [`PeerLink`] is the kept-open, authenticated
//! connection to one owner.
//!
//! Blocking `std::net` sockets with a thread per connection; the protocol decisions (framing,
//! auth, liveness) are made by [`crate::handshake`]. Every read during a handshake is bounded
//! by a deadline and every established link by its peer's heartbeat, so no peer can pin a
//! thread, and [`SideChannelServer::shutdown`] unblocks every thread by shutting its socket.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use log::{info, warn};

use crate::handshake::auth::{self, Direction, FrameAuth};
use crate::handshake::peers::{Liveness, LivenessAction};
use crate::handshake::wire::{
    self, AuthProof, ClientHello, Frame, FrameBuffer, Refusal, ServerHello,
};
use crate::handshake::{EngineMetadata, Fingerprint, HandshakeError};
use crate::holds::{LookupReply, LookupRequest};

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
    /// The probe key this process keeps at the metadata's `same_host.probe_addr`: with it,
    /// each connection's metadata carries [`auth::same_host_proof`] for that connection.
    pub same_host_key: Option<[u8; 32]>,
}

impl Default for SideChannelConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".to_owned(),
            port: 0,
            secret: None,
            heartbeat: Duration::from_secs(1),
            allow_unauthenticated: false,
            same_host_key: None,
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
            .field("same_host_key", &self.same_host_key.map(|_| "<redacted>"))
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

/// How the server names the sender of a lookup or notification: the engine id the client
/// announced and the connection it came on, `engine-id#connection`. A claim made through one
/// connection is thus released only through it: another client cannot end it by announcing
/// the same engine id.
pub fn sender_name(engine_id: &str, connection: u64) -> String {
    format!("{engine_id}#{connection}")
}

/// An authenticated client that announced where its own side channel listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KnownPeer {
    pub engine_id: String,
    pub side_channel: String,
}

/// What the server's threads share.
struct ServerState {
    secret: Option<Vec<u8>>,
    same_host_key: Option<[u8; 32]>,
    heartbeat: Duration,
    metadata: Mutex<Arc<EngineMetadata>>,
    notifications: Mutex<NotificationQueue>,
    waker: Mutex<Option<Waker>>,
    stopping: AtomicBool,
    /// A handle on each served socket, so shutdown can unblock its thread.
    connections: Mutex<HashMap<u64, TcpStream>>,
    lookup: Mutex<Option<LookupHandler>>,
    /// Connected clients that announced their side channel, by connection id.
    directory: Mutex<HashMap<u64, KnownPeer>>,
    /// Connections still in their handshake, oldest first.
    pending: Mutex<std::collections::VecDeque<u64>>,
    dropped_notifications: std::sync::atomic::AtomicU64,
    /// Connections served, by the client's IP address.
    per_address: Mutex<HashMap<IpAddr, usize>>,
}

/// Received notifications not yet taken, with their payloads' bytes.
#[derive(Default)]
struct NotificationQueue {
    items: Vec<Notification>,
    bytes: usize,
}

/// Serves this engine's metadata to readers and collects their notifications.
pub struct SideChannelServer {
    state: Arc<ServerState>,
    local_addr: SocketAddr,
    /// Returns the connection threads still to be joined.
    acceptor: Option<JoinHandle<Vec<JoinHandle<()>>>>,
}

impl SideChannelServer {
    pub fn start(
        config: SideChannelConfig,
        metadata: EngineMetadata,
    ) -> Result<Self, HandshakeError> {
        wire::heartbeat_ms(config.heartbeat)?;
        check_secret(config.secret.as_deref())?;
        if config.secret.is_none() && !is_loopback(&config.host) {
            if !config.allow_unauthenticated {
                return Err(HandshakeError::Config(format!(
                    "the side channel would listen on {} without a shared secret: any host that \
                     reaches it could read this engine's registered memory; set a secret (e.g. \
                     $KVDUPLEX_SECRET on every engine) or allow unauthenticated peers explicitly \
                     on a trusted network",
                    config.host
                )));
            }
            warn!(
                "side channel on {} accepts unauthenticated peers (allowed explicitly): only for \
                 trusted networks",
                config.host
            );
        }
        wire::encode_metadata_frame(&metadata)?;
        let address = format!("{}:{}", config.host, config.port);
        let bind_error = |source| HandshakeError::Bind { address: address.clone(), source };
        let listener =
            TcpListener::bind((config.host.as_str(), config.port)).map_err(bind_error)?;
        listener.set_nonblocking(true).map_err(bind_error)?;
        let local_addr = listener.local_addr().map_err(bind_error)?;
        let state = Arc::new(ServerState {
            secret: config.secret,
            same_host_key: config.same_host_key,
            heartbeat: config.heartbeat,
            metadata: Mutex::new(Arc::new(metadata)),
            notifications: Mutex::new(NotificationQueue::default()),
            waker: Mutex::new(None),
            stopping: AtomicBool::new(false),
            connections: Mutex::new(HashMap::new()),
            lookup: Mutex::new(None),
            directory: Mutex::new(HashMap::new()),
            pending: Mutex::new(std::collections::VecDeque::new()),
            dropped_notifications: std::sync::atomic::AtomicU64::new(0),
            per_address: Mutex::new(HashMap::new()),
        });
        let acceptor_state = Arc::clone(&state);
        let acceptor = thread::Builder::new()
            .name("kvduplex-side-channel".to_owned())
            .spawn(move || accept_loop(&listener, &acceptor_state))?;
        info!("side channel listening on {local_addr}");
        Ok(Self { state, local_addr, acceptor: Some(acceptor) })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Replaces what later clients receive (regions and layout get registered after start).
    /// Metadata over the frame cap is still stored; clients are then refused with the reason.
    pub fn set_metadata(&self, metadata: EngineMetadata) {
        *lock(&self.state.metadata) = Arc::new(metadata);
    }

    /// Every notification received since the last call, in arrival order.
    pub fn take_notifications(&self) -> Vec<Notification> {
        std::mem::take(&mut *lock(&self.state.notifications)).items
    }

    /// Payload bytes of the notifications waiting to be taken (at most
    /// [`MAX_QUEUED_NOTIFICATION_BYTES`]).
    pub fn queued_notification_bytes(&self) -> usize {
        lock(&self.state.notifications).bytes
    }

    /// Notifications dropped so far because the queue was full.
    pub fn dropped_notifications(&self) -> u64 {
        self.state.dropped_notifications.load(Ordering::Relaxed)
    }

    /// Called on the connection's thread after each notification is queued.
    pub fn set_notification_waker(&self, waker: Box<dyn Fn() + Send + Sync>) {
        *lock(&self.state.waker) = Some(Arc::from(waker));
    }

    /// Serves lookups of authenticated clients; without a handler every lookup finds nothing.
    pub fn set_lookup_handler(&self, handler: LookupHandler) {
        *lock(&self.state.lookup) = Some(handler);
    }

    /// Connected, authenticated clients that announced their own side channel: the engines
    /// that read from this one. A client is forgotten when its connection ends.
    pub fn known_peers(&self) -> Vec<KnownPeer> {
        let mut peers: Vec<KnownPeer> = lock(&self.state.directory).values().cloned().collect();
        peers.sort_by(|a, b| (&a.engine_id, &a.side_channel).cmp(&(&b.engine_id, &b.side_channel)));
        peers.dedup();
        peers
    }

    /// Stops accepting, closes every connection and joins every thread. Also run on drop.
    pub fn shutdown(&mut self) {
        self.state.stopping.store(true, Ordering::Release);
        let Some(acceptor) = self.acceptor.take() else {
            return;
        };
        // The acceptor is joined first, so no connection is registered after the sweep below.
        let handlers = acceptor.join().unwrap_or_default();
        for stream in lock(&self.state.connections).values() {
            // Wakes the thread's blocked read or write; an error means it is closed already.
            let _ = stream.shutdown(Shutdown::Both);
        }
        for handler in handlers {
            let _ = handler.join();
        }
        info!("side channel on {} shut down", self.local_addr);
    }
}

impl Drop for SideChannelServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(listener: &TcpListener, state: &Arc<ServerState>) -> Vec<JoinHandle<()>> {
    let mut handlers: Vec<(u64, JoinHandle<()>)> = Vec::new();
    let mut next_id = 0u64;
    while !state.stopping.load(Ordering::Acquire) {
        let (stream, client_addr) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                thread::sleep(ACCEPT_POLL);
                continue;
            }
            Err(e) => {
                // E.g. out of file descriptors: back off instead of spinning.
                warn!("side channel: accept failed: {e}");
                thread::sleep(ACCEPT_POLL);
                continue;
            }
        };
        handlers.retain(|(_, handler)| !handler.is_finished());
        let from_address = lock(&state.per_address).get(&client_addr.ip()).copied().unwrap_or(0);
        if from_address >= MAX_CONNECTIONS_PER_ADDRESS {
            warn!("side channel: refused {client_addr}: already serving {MAX_CONNECTIONS_PER_ADDRESS} connections from its address");
            let reason = format!("the server is at its limit of {MAX_CONNECTIONS_PER_ADDRESS} connections from one address");
            let _ = write_frame(&stream, &Frame::Refused(Refusal::Other(reason)));
            continue;
        }
        if lock(&state.connections).len() >= MAX_CONNECTIONS {
            warn!("side channel: refused {client_addr}: already serving {MAX_CONNECTIONS} connections");
            let reason = format!("the server is at its limit of {MAX_CONNECTIONS} connections");
            // Best effort: the client learns why instead of seeing a bare close.
            let _ = write_frame(&stream, &Frame::Refused(Refusal::Other(reason)));
            continue;
        }
        next_id += 1;
        let evicted = {
            let mut pending = lock(&state.pending);
            let evicted =
                (pending.len() >= MAX_PENDING_HANDSHAKES).then(|| pending.pop_front()).flatten();
            pending.push_back(next_id);
            evicted
        };
        if let Some(oldest) = evicted {
            if let Some(stream) = lock(&state.connections).get(&oldest) {
                // Its thread's read fails at once and the thread ends.
                let _ = stream.shutdown(Shutdown::Both);
            }
            // Waiting for it keeps the threads at MAX_PENDING_HANDSHAKES however fast
            // clients arrive.
            if let Some(at) = handlers.iter().position(|(id, _)| *id == oldest) {
                let _ = handlers.swap_remove(at).1.join();
            }
            info!("side channel: {MAX_PENDING_HANDSHAKES} handshakes pending; closed the oldest to serve {client_addr}");
        }
        match spawn_connection(state, next_id, stream, client_addr) {
            Ok(handler) => handlers.push((next_id, handler)),
            Err(e) => warn!("side channel: dropped the connection from {client_addr}: {e}"),
        }
    }
    handlers.into_iter().map(|(_, handler)| handler).collect()
}

/// Registers the connection (only the accept loop does, so the limit check above holds)
/// and serves it on a thread of its own.
fn spawn_connection(
    state: &Arc<ServerState>,
    id: u64,
    stream: TcpStream,
    client_addr: SocketAddr,
) -> io::Result<JoinHandle<()>> {
    // Accepted sockets must block (with timeouts) whatever the listener does.
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
    lock(&state.connections).insert(id, stream.try_clone()?);
    *lock(&state.per_address).entry(client_addr.ip()).or_default() += 1;
    let thread_state = Arc::clone(state);
    thread::Builder::new()
        .name(format!("kvduplex-side-channel-{id}"))
        .spawn(move || {
            serve_connection(&thread_state, id, stream, client_addr);
            lock(&thread_state.directory).remove(&id);
            lock(&thread_state.connections).remove(&id);
            forget_connection_from(&thread_state, client_addr.ip());
        })
        .inspect_err(|_| {
            lock(&state.connections).remove(&id);
            forget_connection_from(state, client_addr.ip());
        })
}

fn forget_connection_from(state: &ServerState, ip: IpAddr) {
    let mut per_address = lock(&state.per_address);
    if let Some(count) = per_address.get_mut(&ip) {
        *count -= 1;
        if *count == 0 {
            per_address.remove(&ip);
        }
    }
}

/// The client as the handshake left it.
struct Client {
    engine_id: String,
    heartbeat: Duration,
    side_channel: Option<String>,
}

fn serve_connection(state: &ServerState, id: u64, stream: TcpStream, client_addr: SocketAddr) {
    // Tags what it sends once the handshake is authenticated (the metadata on), a refusal too.
    let writer = match stream.try_clone() {
        Ok(stream) => RefCell::new(FrameWriter::new(stream)),
        Err(e) => {
            warn!("side channel: dropped {client_addr}: {e}");
            return;
        }
    };
    let mut reader = FrameReader::new(stream);
    // Until the client is authenticated it may send hellos and proofs only: nothing larger.
    reader.frames.set_limit(Some(wire::MAX_CONTROL_FRAME_LEN));
    let deadline = Deadline::after(SERVER_HANDSHAKE_TIMEOUT);
    // How the logs name the client; its engine id once its hello has arrived.
    let mut who = client_addr.to_string();
    let handshake = read_client_hello(&mut reader, &deadline).and_then(|hello| {
        who = format!("engine {:?} at {client_addr}", hello.engine_id);
        answer_client(state, &mut reader, &mut writer.borrow_mut(), hello, &deadline)
    });
    lock(&state.pending).retain(|pending| *pending != id);
    let client = match handshake {
        Ok(client) => client,
        Err(e) => {
            if !state.stopping.load(Ordering::Acquire) {
                warn!("side channel: refused {who}: {e}");
            }
            if !matches!(e, HandshakeError::Io(_) | HandshakeError::Timeout { .. }) {
                // Best effort: the client may have gone already.
                let _ = writer.borrow_mut().send(&Frame::Refused(Refusal::from_error(&e)));
            }
            return;
        }
    };
    reader.frames.set_limit(None);
    let Client { engine_id, heartbeat, side_channel } = client;
    let sender = sender_name(&engine_id, id);
    info!("side channel: {who} connected");
    if let Some(side_channel) = side_channel {
        lock(&state.directory).insert(id, KnownPeer { engine_id, side_channel });
    }
    let liveness = Liveness::new(Instant::now(), state.heartbeat, heartbeat);
    let end = run_link(
        &mut reader,
        liveness,
        || writer.borrow_mut().send(&Frame::Ping),
        |frame| match frame {
            Frame::Notify(payload) => {
                queue_notification(state, &sender, payload);
                Ok(())
            }
            Frame::Lookup(request) => {
                let handler = lock(&state.lookup).clone();
                let reply = match handler {
                    Some(handler) => handler(&sender, &request),
                    None => LookupReply { id: request.id, found: None, not_yet: false },
                };
                writer.borrow_mut().send(&Frame::LookupReply(reply))
            }
            other => Err(unexpected("Notify or Lookup", &other)),
        },
    );
    if state.stopping.load(Ordering::Acquire) {
        info!("side channel: closed the connection of {who} (shutting down)");
    } else {
        info!("side channel: {who} disconnected: {end}");
    }
}

fn read_client_hello(
    reader: &mut FrameReader,
    deadline: &Deadline,
) -> Result<ClientHello, HandshakeError> {
    match reader.read_frame_by(deadline, "the client's hello")? {
        Frame::ClientHello(hello) => Ok(hello),
        other => Err(unexpected("ClientHello", &other)),
    }
}

/// The server's part of the handshake after the client's hello: hello, proofs over both
/// hellos, then the compatibility check and the metadata, the first tagged frame (with a
/// secret) and with this connection's same-host proof.
fn answer_client(
    state: &ServerState,
    reader: &mut FrameReader,
    writer: &mut FrameWriter,
    hello: ClientHello,
    deadline: &Deadline,
) -> Result<Client, HandshakeError> {
    let nonce = auth::new_nonce()?;
    let server_hello = ServerHello {
        nonce,
        has_secret: state.secret.is_some(),
        heartbeat_ms: wire::heartbeat_ms(state.heartbeat)?,
    };
    writer.send(&Frame::ServerHello(server_hello.clone()))?;
    let transcript = wire::transcript(&hello, &server_hello);
    let secret = auth::negotiate_auth(state.secret.as_deref(), hello.has_secret)?;
    if let Some(secret) = secret {
        let proof = match reader.read_frame_by(deadline, "the client's proof")? {
            Frame::AuthProof(proof) => proof,
            other => return Err(unexpected("AuthProof", &other)),
        };
        auth::verify(secret, Direction::ClientToServer, &transcript, &proof.mac)?;
        let mac = auth::prove(secret, Direction::ServerToClient, &transcript)?;
        writer.send(&Frame::AuthProof(AuthProof { mac }))?;
        let (ours, theirs) = frame_auths(secret, Direction::ServerToClient, &transcript)?;
        reader.frames.authenticate(theirs);
        writer.authenticate(ours);
    }
    let mut metadata = EngineMetadata::clone(&lock(&state.metadata));
    metadata.fingerprint.check_compatible(&hello.fingerprint)?;
    if let Some(key) = &state.same_host_key {
        let digest = metadata.digest();
        if let Some(identity) = &mut metadata.same_host {
            identity.proof = auth::same_host_proof(key, &transcript, &digest);
        }
    }
    writer.send_bytes(wire::encode_metadata_frame(&metadata)?)?;
    Ok(Client {
        engine_id: hello.engine_id,
        heartbeat: Duration::from_millis(hello.heartbeat_ms.into()),
        side_channel: hello.side_channel,
    })
}

/// (ours, theirs): the authenticators of the frames we send in `ours` and of the peer's.
fn frame_auths(
    secret: &[u8],
    ours: Direction,
    transcript: &auth::Transcript,
) -> Result<(FrameAuth, FrameAuth), HandshakeError> {
    let theirs = match ours {
        Direction::ClientToServer => Direction::ServerToClient,
        Direction::ServerToClient => Direction::ClientToServer,
    };
    Ok((FrameAuth::new(secret, ours, transcript)?, FrameAuth::new(secret, theirs, transcript)?))
}

fn queue_notification(state: &ServerState, sender: &str, payload: Vec<u8>) {
    let mut queue = lock(&state.notifications);
    let full = queue.items.len() >= MAX_QUEUED_NOTIFICATIONS
        || queue.bytes + payload.len() > MAX_QUEUED_NOTIFICATION_BYTES;
    if full {
        let (waiting, bytes) = (queue.items.len(), queue.bytes);
        drop(queue);
        let dropped = state.dropped_notifications.fetch_add(1, Ordering::Relaxed);
        // The first drop, then every power of two: a flood cannot flood the log too.
        if dropped.is_power_of_two() || dropped == 0 {
            warn!(
                "side channel: {waiting} notifications of {bytes} bytes wait to be taken (limits {MAX_QUEUED_NOTIFICATIONS}, \
                 {MAX_QUEUED_NOTIFICATION_BYTES} bytes); dropped one of {} bytes from {sender} ({} dropped so far)",
                payload.len(),
                dropped + 1
            );
        }
        return;
    }
    queue.bytes += payload.len();
    queue.items.push(Notification { sender: sender.to_owned(), payload });
    drop(queue);
    let waker = lock(&state.waker).clone();
    if let Some(waker) = waker {
        waker();
    }
}

/// A reader's kept-open, authenticated connection to an owner's side channel.
pub struct PeerLink {
    status: Arc<Mutex<LinkStatus>>,
    /// Serializes whole frames from `notify`, `lookup` and the link thread's pings.
    writer: Arc<Mutex<FrameWriter>>,
    /// For shutting the socket down without waiting on `writer`.
    socket: TcpStream,
    lookups: Arc<PendingLookups>,
    /// Both hellos' hash, which the owner's same-host proof is bound to.
    transcript: auth::Transcript,
}

/// What becomes of a lookup sent on a link: the owner's reply, or why none will come.
pub type LookupOutcome = Result<LookupReply, HandshakeError>;

/// Takes a lookup's outcome; runs exactly once (see [`PeerLink::send_lookup`]).
pub type LookupReplyHandler = Box<dyn FnOnce(LookupOutcome) + Send>;

/// Lookups sent on a link, waiting for their replies (which the link thread delivers).
#[derive(Default)]
struct PendingLookups {
    next_id: AtomicU64,
    /// By lookup id: when the lookup gives up, its timeout, and who takes the outcome.
    waiting: Mutex<HashMap<u64, (Instant, Duration, LookupReplyHandler)>>,
}

impl PendingLookups {
    fn add(&self, id: u64, timeout: Duration, handler: LookupReplyHandler) {
        let now = Instant::now();
        let deadline = now.checked_add(timeout).unwrap_or_else(far_future);
        // Sweeping here bounds the map by the lookups sent within one timeout, however
        // silent the owner.
        self.expire(now);
        lock(&self.waiting).insert(id, (deadline, timeout, handler));
    }

    /// Hands a reply to its handler. A reply past its lookup's deadline counts as none (the
    /// lookup ends with a timeout), and one nobody waits for any more is dropped: the owner's
    /// claim then ends at its own deadline.
    fn deliver(&self, reply: LookupReply, now: Instant) {
        let waiting = lock(&self.waiting).remove(&reply.id);
        match waiting {
            Some((deadline, _, handler)) if now < deadline => handler(Ok(reply)),
            Some((_, after, handler)) => handler(Err(HandshakeError::Timeout {
                waiting_for: "the owner's lookup reply",
                after,
            })),
            None => {}
        }
    }

    /// The lookup `id` ends with `error` unless its outcome was handed over already.
    fn fail(&self, id: u64, error: HandshakeError) {
        let waiting = lock(&self.waiting).remove(&id);
        if let Some((_, _, handler)) = waiting {
            handler(Err(error));
        }
    }

    /// Ends every lookup whose deadline has passed with a timeout.
    fn expire(&self, now: Instant) {
        let expired: Vec<_> = {
            let mut waiting = lock(&self.waiting);
            let ids: Vec<u64> =
                waiting.iter().filter(|(_, (at, _, _))| *at <= now).map(|(id, _)| *id).collect();
            ids.into_iter().filter_map(|id| waiting.remove(&id)).collect()
        };
        for (_, after, handler) in expired {
            handler(Err(HandshakeError::Timeout {
                waiting_for: "the owner's lookup reply",
                after,
            }));
        }
    }

    /// Ends every lookup still waiting: the link is gone.
    fn fail_all(&self, reason: &str) {
        let waiting: Vec<_> = lock(&self.waiting).drain().map(|(_, entry)| entry).collect();
        for (_, _, handler) in waiting {
            handler(Err(HandshakeError::PeerGone(reason.to_owned())));
        }
    }
}

type DeathCallback = Box<dyn FnOnce(String) + Send>;

enum LinkStatus {
    Alive { on_death: Vec<DeathCallback> },
    Dead { reason: String },
}

impl PeerLink {
    /// Connects to the owner at `host:port`, authenticates, checks compatibility and returns
    /// the link together with the owner's metadata. `timeout` bounds the whole handshake;
    /// `heartbeat` is how often we ping the owner once connected. `our_side_channel` tells
    /// the owner where we listen ourselves.
    #[allow(clippy::too_many_arguments)]
    pub fn connect(
        host: &str,
        port: u16,
        our_engine_id: &str,
        our_side_channel: Option<String>,
        our_fingerprint: &Fingerprint,
        secret: Option<&[u8]>,
        timeout: Duration,
        heartbeat: Duration,
    ) -> Result<(PeerLink, EngineMetadata), HandshakeError> {
        let heartbeat_ms = wire::heartbeat_ms(heartbeat)?;
        check_secret(secret)?;
        let deadline = Deadline::after(timeout);
        let stream = connect_stream(host, port, &deadline)?;
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
        let mut reader = FrameReader::new(stream.try_clone()?);
        let nonce = auth::new_nonce()?;
        let hello = ClientHello {
            engine_id: our_engine_id.to_owned(),
            fingerprint: our_fingerprint.clone(),
            nonce,
            has_secret: secret.is_some(),
            heartbeat_ms,
            side_channel: our_side_channel,
        };
        write_frame(&stream, &Frame::ClientHello(hello.clone()))?;
        let server_hello = match reader.read_frame_by(&deadline, "the server's hello")? {
            Frame::ServerHello(hello) => hello,
            other => return Err(unexpected("ServerHello", &other)),
        };
        let transcript = wire::transcript(&hello, &server_hello);
        let secret = auth::negotiate_auth(secret, server_hello.has_secret)?;
        let mut writer = FrameWriter::new(stream.try_clone()?);
        if let Some(secret) = secret {
            let mac = auth::prove(secret, Direction::ClientToServer, &transcript)?;
            write_frame(&stream, &Frame::AuthProof(AuthProof { mac }))?;
            let proof = match reader.read_frame_by(&deadline, "the server's proof")? {
                Frame::AuthProof(proof) => proof,
                other => return Err(unexpected("AuthProof", &other)),
            };
            auth::verify(secret, Direction::ServerToClient, &transcript, &proof.mac)?;
            // The metadata is the server's first tagged frame.
            let (ours, theirs) = frame_auths(secret, Direction::ClientToServer, &transcript)?;
            reader.frames.authenticate(theirs);
            writer.authenticate(ours);
        }
        let metadata = match reader.read_frame_by(&deadline, "the server's metadata")? {
            Frame::Metadata(metadata) => metadata,
            other => return Err(unexpected("Metadata", &other)),
        };
        // The server checked too; checking here as well keeps a misbehaving server from
        // handing us blocks we cannot interpret.
        our_fingerprint.check_compatible(&metadata.fingerprint)?;
        metadata.validate()?;

        let status = Arc::new(Mutex::new(LinkStatus::Alive { on_death: Vec::new() }));
        let writer = Arc::new(Mutex::new(writer));
        let liveness = Liveness::new(
            Instant::now(),
            heartbeat,
            Duration::from_millis(server_hello.heartbeat_ms.into()),
        );
        let (thread_status, thread_writer) = (Arc::clone(&status), Arc::clone(&writer));
        let lookups = Arc::new(PendingLookups::default());
        let thread_lookups = Arc::clone(&lookups);
        thread::Builder::new().name("kvduplex-peer-link".to_owned()).spawn(move || {
            let end = run_link(
                &mut reader,
                liveness,
                || lock(&thread_writer).send(&Frame::Ping),
                |frame| match frame {
                    Frame::LookupReply(reply) => {
                        thread_lookups.deliver(reply, Instant::now());
                        Ok(())
                    }
                    other => Err(unexpected("Ping or LookupReply", &other)),
                },
            );
            let reason = end.to_string();
            mark_dead(&thread_status, reason.clone());
            thread_lookups.fail_all(&reason);
        })?;
        Ok((PeerLink { status, writer, socket: stream, lookups, transcript }, metadata))
    }

    /// The hash of this connection's hellos ([`wire::transcript`]).
    pub fn transcript(&self) -> &auth::Transcript {
        &self.transcript
    }

    pub fn is_alive(&self) -> bool {
        matches!(*lock(&self.status), LinkStatus::Alive { .. })
    }

    /// `callback` runs exactly once, with the reason, when the owner is gone (connection
    /// closed, I/O error, or no frame for three of its heartbeats): on the link's thread, or
    /// right here if the link is dead already. It never runs after [`PeerLink::close`].
    pub fn on_death(&self, callback: Box<dyn FnOnce(String) + Send>) {
        let mut status = lock(&self.status);
        match &mut *status {
            LinkStatus::Alive { on_death } => on_death.push(callback),
            LinkStatus::Dead { reason } => {
                let reason = reason.clone();
                drop(status);
                callback(reason);
            }
        }
    }

    /// Sends `payload` to the owner, which receives it as a [`Notification`] from our engine id.
    pub fn notify(&self, payload: &[u8]) -> Result<(), HandshakeError> {
        self.send(&Frame::Notify(payload.to_vec()), "sending a notification")
    }

    /// Asks the owner for the longest turn it holds whose blocks start with `fingerprints`,
    /// or with `request_id` for that hold's blocks that carry them (claimed for us when
    /// granted), without waiting: `on_reply` takes the outcome, exactly
    /// once: on the link's thread when the reply arrives or the link dies, or on this thread
    /// when the frame cannot be sent. A reply later than `timeout` counts as none: the lookup
    /// then ends with `Timeout`, when that reply arrives, on a later `send_lookup`, or when
    /// the link ends, whichever is first. Callers that must know sooner keep their own
    /// deadline.
    pub fn send_lookup(
        &self,
        fingerprints: Vec<u64>,
        request_id: Option<String>,
        timeout: Duration,
        on_reply: LookupReplyHandler,
    ) {
        let id = self.lookups.next_id.fetch_add(1, Ordering::Relaxed);
        self.lookups.add(id, timeout, on_reply);
        // Registered before sending, so a fast reply finds it.
        // A link that dies after this fails every waiting lookup, this one included.
        if let Err(e) = self.send(
            &Frame::Lookup(LookupRequest { id, fingerprints, request_id }),
            "sending a lookup",
        ) {
            self.lookups.fail(id, e);
        }
    }

    /// Writes one whole frame; a failed write leaves the stream unusable, so the link dies.
    fn send(&self, frame: &Frame, what: &str) -> Result<(), HandshakeError> {
        if let LinkStatus::Dead { reason } = &*lock(&self.status) {
            return Err(HandshakeError::PeerGone(reason.clone()));
        }
        let sent = lock(&self.writer).send(frame);
        sent.map_err(|e| {
            if matches!(e, HandshakeError::Io(_)) {
                let reason = format!("{what} failed: {e}");
                mark_dead(&self.status, reason.clone());
                self.lookups.fail_all(&reason);
            }
            e
        })
    }

    /// Closes the connection; death callbacks are dropped without running. Also on drop.
    pub fn close(self) {}
}

impl fmt::Debug for PeerLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerLink")
            .field("peer", &self.socket.peer_addr().ok())
            .field("alive", &self.is_alive())
            .finish()
    }
}

impl Drop for PeerLink {
    fn drop(&mut self) {
        // Our own close is not the owner's death: drop the callbacks without running them.
        let closed = LinkStatus::Dead { reason: "closed locally".to_owned() };
        let discarded = std::mem::replace(&mut *lock(&self.status), closed);
        drop(discarded);
        // Wakes the link thread, which then exits on its own; an error means already closed.
        let _ = self.socket.shutdown(Shutdown::Both);
    }
}

fn mark_dead(status: &Mutex<LinkStatus>, reason: String) {
    let on_death = {
        let mut status = lock(status);
        let LinkStatus::Alive { on_death } = &mut *status else {
            // Dead already: the first reason stands and the callbacks have run.
            return;
        };
        let on_death = std::mem::take(on_death);
        *status = LinkStatus::Dead { reason: reason.clone() };
        on_death
    };
    for callback in on_death {
        callback(reason.clone());
    }
}

fn connect_stream(host: &str, port: u16, deadline: &Deadline) -> Result<TcpStream, HandshakeError> {
    let address = format!("{host}:{port}");
    let unreachable = |source| HandshakeError::Unreachable { address: address.clone(), source };
    let mut last_error = None;
    for addr in (host, port).to_socket_addrs().map_err(unreachable)? {
        let left = deadline.left("a TCP connection")?;
        match TcpStream::connect_timeout(&addr, left) {
            Ok(stream) => return Ok(stream),
            Err(e) => last_error = Some(e),
        }
    }
    let no_address = || io::Error::new(io::ErrorKind::NotFound, "the name resolves to no address");
    Err(unreachable(last_error.unwrap_or_else(no_address)))
}

/// Runs an established link until it ends; returns why it ended. Pings only keep the link
/// alive; every other frame goes to `on_frame`.
fn run_link(
    reader: &mut FrameReader,
    mut liveness: Liveness,
    mut send_ping: impl FnMut() -> Result<(), HandshakeError>,
    mut on_frame: impl FnMut(Frame) -> Result<(), HandshakeError>,
) -> HandshakeError {
    loop {
        let now = Instant::now();
        match liveness.poll(now) {
            LivenessAction::Dead { silent_for } => {
                return HandshakeError::PeerGone(format!(
                    "no frame for {silent_for:?}, {} of the peer's heartbeats",
                    Liveness::MISSED_HEARTBEATS
                ))
            }
            LivenessAction::SendPing => match send_ping() {
                Ok(()) => liveness.on_ping_sent(now),
                Err(e) => return e,
            },
            LivenessAction::Wait(wait) => match reader.read_frame_within(wait) {
                Ok(Some(frame)) => {
                    liveness.on_frame_received(Instant::now());
                    if !matches!(frame, Frame::Ping) {
                        if let Err(e) = on_frame(frame) {
                            return e;
                        }
                    }
                }
                Ok(None) => {}
                Err(e) => return e,
            },
        }
    }
}

/// Reads frames off a blocking socket; a read that times out mid-frame loses nothing.
struct FrameReader {
    stream: TcpStream,
    frames: FrameBuffer,
    chunk: Vec<u8>,
}

impl FrameReader {
    fn new(stream: TcpStream) -> Self {
        Self { stream, frames: FrameBuffer::new(), chunk: vec![0; READ_CHUNK] }
    }

    /// The next frame, or `None` if none completed within `wait` (which must be non-zero).
    fn read_frame_within(&mut self, wait: Duration) -> Result<Option<Frame>, HandshakeError> {
        if let Some(frame) = self.frames.next_frame()? {
            return Ok(Some(frame));
        }
        self.stream.set_read_timeout(Some(wait))?;
        match self.stream.read(&mut self.chunk) {
            Ok(0) => Err(HandshakeError::PeerGone("the connection was closed".to_owned())),
            Ok(n) => {
                self.frames.extend(&self.chunk[..n]);
                self.frames.next_frame()
            }
            Err(e) if is_timeout(&e) => Ok(None),
            Err(e) => Err(HandshakeError::Io(e)),
        }
    }

    /// The next frame before `deadline`; a refusal from the peer becomes its error.
    fn read_frame_by(
        &mut self,
        deadline: &Deadline,
        waiting_for: &'static str,
    ) -> Result<Frame, HandshakeError> {
        loop {
            match self.read_frame_within(deadline.left(waiting_for)?)? {
                Some(Frame::Refused(refusal)) => return Err(refusal.into_peer_error()),
                Some(frame) => return Ok(frame),
                None => {}
            }
        }
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

struct Deadline {
    at: Instant,
    total: Duration,
}

impl Deadline {
    fn after(total: Duration) -> Self {
        // A timeout too large for the clock is as good as none.
        let at = Instant::now().checked_add(total).unwrap_or_else(far_future);
        Self { at, total }
    }

    /// Time left, never zero; `Timeout` once the deadline has passed.
    fn left(&self, waiting_for: &'static str) -> Result<Duration, HandshakeError> {
        let left = self.at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(HandshakeError::Timeout { waiting_for, after: self.total });
        }
        Ok(left)
    }
}

fn far_future() -> Instant {
    let year = Duration::from_secs(365 * 24 * 3600);
    let now = Instant::now();
    now.checked_add(year).unwrap_or(now)
}

/// Writes whole frames on an established connection, each followed by its tag when the
/// handshake was authenticated.
struct FrameWriter {
    stream: TcpStream,
    auth: Option<FrameAuth>,
}

impl FrameWriter {
    fn new(stream: TcpStream) -> Self {
        Self { stream, auth: None }
    }

    fn authenticate(&mut self, auth: FrameAuth) {
        self.auth = Some(auth);
    }

    /// One write per frame (and its tag); a failed write leaves the stream unusable.
    fn send(&mut self, frame: &Frame) -> Result<(), HandshakeError> {
        self.send_bytes(wire::encode_frame(frame)?)
    }

    /// [`FrameWriter::send`] of an encoded frame.
    fn send_bytes(&mut self, mut bytes: Vec<u8>) -> Result<(), HandshakeError> {
        if let Some(auth) = &mut self.auth {
            let tag = auth.tag(&bytes);
            bytes.extend_from_slice(&tag);
        }
        (&self.stream).write_all(&bytes)?;
        Ok(())
    }
}

/// Writes one frame during a handshake (no tags yet).
fn write_frame(mut stream: &TcpStream, frame: &Frame) -> Result<(), HandshakeError> {
    stream.write_all(&wire::encode_frame(frame)?)?;
    Ok(())
}

fn unexpected(expected: &str, got: &Frame) -> HandshakeError {
    HandshakeError::Malformed(format!("expected a {expected} frame, got a {:?} frame", got.kind()))
}

/// Loopback addresses (and `localhost`) are reachable from this host only.
fn is_loopback(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    match bare.parse::<std::net::IpAddr>() {
        Ok(ip) => ip.is_loopback(),
        Err(_) => bare.eq_ignore_ascii_case("localhost"),
    }
}

fn check_secret(secret: Option<&[u8]>) -> Result<(), HandshakeError> {
    match secret {
        Some([]) => Err(HandshakeError::Config("the shared secret is empty".to_owned())),
        _ => Ok(()),
    }
}

/// A poisoned lock only means another thread panicked while holding it; the data (queues,
/// sockets, statuses) stays consistent at every point a panic could occur.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
