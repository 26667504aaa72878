//! The owner's side of the side channel: accepting readers, the handshake, notifications and
//! lookups.

use std::os::fd::AsRawFd;

use super::announce::Announcer;
use super::*;

/// What the server's threads share.
pub(super) struct ServerState {
    pub(super) secret: Option<Vec<u8>>,
    pub(super) heartbeat: Duration,
    pub(super) metadata: Mutex<Arc<EngineMetadata>>,
    pub(super) notifications: Mutex<NotificationQueue>,
    pub(super) waker: Mutex<Option<Waker>>,
    pub(super) stopping: AtomicBool,
    /// A handle on each served socket, so shutdown can unblock its thread.
    pub(super) connections: Mutex<HashMap<u64, TcpStream>>,
    pub(super) lookup: Mutex<Option<LookupHandler>>,
    /// What each authenticated client is told this engine holds; nothing without one.
    pub(super) held: Mutex<Option<Arc<dyn HeldSource>>>,
    /// Connected clients that announced their side channel, by connection id.
    pub(super) directory: Mutex<HashMap<u64, KnownPeer>>,
    /// Connections still in their handshake, oldest first.
    pub(super) pending: Mutex<std::collections::VecDeque<u64>>,
    pub(super) dropped_notifications: std::sync::atomic::AtomicU64,
    /// Connections served, by the client's IP address.
    pub(super) per_address: Mutex<HashMap<IpAddr, usize>>,
}

/// Received notifications not yet taken, with their payloads' bytes.
#[derive(Default)]
pub(super) struct NotificationQueue {
    pub(super) items: Vec<Notification>,
    pub(super) bytes: usize,
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
            heartbeat: config.heartbeat,
            metadata: Mutex::new(Arc::new(metadata)),
            notifications: Mutex::new(NotificationQueue::default()),
            waker: Mutex::new(None),
            stopping: AtomicBool::new(false),
            connections: Mutex::new(HashMap::new()),
            lookup: Mutex::new(None),
            held: Mutex::new(None),
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

    /// Announces `source` to every client authenticated from now on (see [`HeldSource`]).
    pub fn set_held_source(&self, source: Arc<dyn HeldSource>) {
        *lock(&self.state.held) = Some(source);
    }

    /// Connected, authenticated clients that announced their own side channel: the engines
    /// that read from this one. A client is forgotten when its connection ends.
    pub fn known_peers(&self) -> Vec<KnownPeer> {
        let mut peers: Vec<KnownPeer> = lock(&self.state.directory).values().cloned().collect();
        peers.sort_by(|a, b| (&a.engine_id, &a.side_channel).cmp(&(&b.engine_id, &b.side_channel)));
        peers.dedup();
        peers
    }

    /// Closes every connection served now (their threads then end; readers see their link
    /// die), and goes on accepting new ones.
    pub fn close_connections(&self) {
        for stream in lock(&self.state.connections).values() {
            // Wakes the thread's blocked read or write; an error means it is closed already.
            let _ = stream.shutdown(Shutdown::Both);
        }
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

pub(super) fn accept_loop(listener: &TcpListener, state: &Arc<ServerState>) -> Vec<JoinHandle<()>> {
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
pub(super) fn spawn_connection(
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

pub(super) fn forget_connection_from(state: &ServerState, ip: IpAddr) {
    let mut per_address = lock(&state.per_address);
    if let Some(count) = per_address.get_mut(&ip) {
        *count -= 1;
        if *count == 0 {
            per_address.remove(&ip);
        }
    }
}

/// The client as the handshake left it.
pub(super) struct Client {
    pub(super) engine_id: String,
    pub(super) heartbeat: Duration,
    pub(super) side_channel: Option<String>,
}

pub(super) fn serve_connection(
    state: &ServerState,
    id: u64,
    stream: TcpStream,
    client_addr: SocketAddr,
) {
    // Tags what it sends once the handshake is authenticated (the metadata on), a refusal too;
    // shared with the connection's announcer.
    let writer = match stream.try_clone() {
        Ok(stream) => Arc::new(Mutex::new(FrameWriter::new(stream))),
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
        answer_client(state, &mut reader, &mut lock(&writer), hello, &deadline)
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
                let _ = lock(&writer).send(&Frame::Refused(Refusal::from_error(&e)));
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
    let source = lock(&state.held).clone();
    let announcer = source.and_then(|source| {
        let socket = reader.stream.try_clone();
        let started = socket
            .and_then(|socket| Announcer::start(source, Arc::clone(&writer), socket, who.clone()));
        started
            .inspect_err(|e| {
                warn!("side channel: not announcing what this engine holds to {who}: {e}")
            })
            .ok()
    });
    let liveness = Liveness::new(Instant::now(), state.heartbeat, heartbeat);
    let end = run_link(
        &mut reader,
        liveness,
        || lock(&writer).send(&Frame::Ping),
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
                lock(&writer).send(&Frame::LookupReply(reply))
            }
            other => Err(unexpected("Notify or Lookup", &other)),
        },
    );
    if let Some(announcer) = announcer {
        announcer.stop();
    }
    if state.stopping.load(Ordering::Acquire) {
        info!("side channel: closed the connection of {who} (shutting down)");
    } else {
        info!("side channel: {who} disconnected: {end}");
    }
}

pub(super) fn read_client_hello(
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
/// secret) and naming this connection's socket in its same-host identity.
pub(super) fn answer_client(
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
    if let Some(identity) = &mut metadata.same_host {
        // Which descriptor of this process is this connection's socket: what a reader on this
        // host checks with the kernel.
        identity.socket_fd = reader.stream.as_raw_fd() as u32;
    }
    writer.send_bytes(wire::encode_metadata_frame(&metadata)?)?;
    Ok(Client {
        engine_id: hello.engine_id,
        heartbeat: Duration::from_millis(hello.heartbeat_ms.into()),
        side_channel: hello.side_channel,
    })
}

pub(super) fn queue_notification(state: &ServerState, sender: &str, payload: Vec<u8>) {
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
