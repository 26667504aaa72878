//! The reader's side: a kept-open, authenticated link to one owner, and its lookups.

use super::outbox::Outbox;
use super::*;
use crate::holds::feed::HeldUpdate;

/// A reader's kept-open, authenticated connection to an owner's side channel: a thread reads
/// it, another writes what `notify`, `send_lookup` and the heartbeat queue ([`Outbox`]).
pub struct PeerLink {
    status: Arc<Mutex<LinkStatus>>,
    /// Frames for the writer thread, which writes them whole and in order.
    outbox: Arc<Outbox>,
    /// For shutting the socket down.
    socket: TcpStream,
    lookups: Arc<PendingLookups>,
    /// Both hellos' hash, which the owner's same-host proof is bound to.
    transcript: auth::Transcript,
}

/// What becomes of a lookup sent on a link: the owner's reply, or why none will come.
pub type LookupOutcome = Result<LookupReply, HandshakeError>;

/// Takes the owner's announcements of what it holds, in order, on the link's thread; dropped
/// when the link ends (see [`crate::held_index`]).
pub type HeldSink = Box<dyn FnMut(HeldUpdate) + Send>;

/// Takes a lookup's outcome; runs exactly once (see [`PeerLink::send_lookup`]).
pub type LookupReplyHandler = Box<dyn FnOnce(LookupOutcome) + Send>;

/// Lookups sent on a link, waiting for their replies (which the link thread delivers).
#[derive(Default)]
pub(super) struct PendingLookups {
    pub(super) next_id: AtomicU64,
    /// By lookup id: when the lookup gives up, its timeout, and who takes the outcome.
    pub(super) waiting: Mutex<HashMap<u64, (Instant, Duration, LookupReplyHandler)>>,
}

impl PendingLookups {
    pub(super) fn add(&self, id: u64, timeout: Duration, handler: LookupReplyHandler) {
        let now = Instant::now();
        let deadline = later(now, timeout);
        // Sweeping here bounds the map by the lookups sent within one timeout, however
        // silent the owner.
        self.expire(now);
        lock(&self.waiting).insert(id, (deadline, timeout, handler));
    }

    /// Hands a reply to its handler. A reply past its lookup's deadline counts as none (the
    /// lookup ends with a timeout), and one nobody waits for any more is dropped: the owner's
    /// claim then ends at its own deadline.
    pub(super) fn deliver(&self, reply: LookupReply, now: Instant) {
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
    pub(super) fn fail(&self, id: u64, error: HandshakeError) {
        let waiting = lock(&self.waiting).remove(&id);
        if let Some((_, _, handler)) = waiting {
            handler(Err(error));
        }
    }

    /// Ends every lookup whose deadline has passed with a timeout.
    pub(super) fn expire(&self, now: Instant) {
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
    pub(super) fn fail_all(&self, reason: &str) {
        let waiting: Vec<_> = lock(&self.waiting).drain().map(|(_, entry)| entry).collect();
        for (_, _, handler) in waiting {
            handler(Err(HandshakeError::PeerGone(reason.to_owned())));
        }
    }
}

pub(super) type DeathCallback = Box<dyn FnOnce(String) + Send>;

pub(super) enum LinkStatus {
    Alive { on_death: Vec<DeathCallback> },
    Dead { reason: String },
}

impl PeerLink {
    /// Connects to the owner at `host:port`, authenticates, checks compatibility and returns
    /// the link together with the owner's metadata. `timeout` bounds the whole handshake;
    /// `heartbeat` is how often we ping the owner once connected. `our_side_channel` tells
    /// the owner where we listen ourselves. `on_held` takes the owner's announcements (without
    /// it they are dropped).
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
        on_held: Option<HeldSink>,
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
        let outbox = Arc::new(Outbox::default());
        let liveness = Liveness::new(
            Instant::now(),
            heartbeat,
            Duration::from_millis(server_hello.heartbeat_ms.into()),
        );
        let lookups = Arc::new(PendingLookups::default());
        let ends = LinkEnds {
            status: Arc::clone(&status),
            outbox: Arc::clone(&outbox),
            lookups: Arc::clone(&lookups),
            socket: stream.try_clone()?,
        };
        let writer_ends = ends.clone()?;
        thread::Builder::new()
            .name("kvduplex-peer-write".to_owned())
            .spawn(move || write_frames(writer, &writer_ends))?;
        let (thread_outbox, thread_lookups) = (Arc::clone(&outbox), Arc::clone(&lookups));
        let spawned =
            thread::Builder::new().name("kvduplex-peer-link".to_owned()).spawn(move || {
                let mut on_held = on_held;
                let end = run_link(
                    &mut reader,
                    liveness,
                    || thread_outbox.push(&Frame::Ping),
                    |frame| match frame {
                        Frame::LookupReply(reply) => {
                            thread_lookups.deliver(reply, Instant::now());
                            Ok(())
                        }
                        Frame::Held(update) => {
                            if let Some(on_held) = &mut on_held {
                                on_held(update);
                            }
                            Ok(())
                        }
                        other => Err(unexpected("Ping, LookupReply or Held", &other)),
                    },
                );
                // The owner's announcements end with the link.
                drop(on_held);
                ends.end(&end.to_string());
            });
        if let Err(e) = spawned {
            outbox.close("the link could not start");
            return Err(e.into());
        }
        Ok((PeerLink { status, outbox, socket: stream, lookups, transcript }, metadata))
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

    /// Queues `payload` for the owner, which receives it as a [`Notification`] from our engine
    /// id: written by the link's own thread, after what was queued before it; `Backlog` when
    /// the owner left [`super::MAX_QUEUED_BYTES`] unread.
    pub fn notify(&self, payload: &[u8]) -> Result<(), HandshakeError> {
        self.send(&Frame::Notify(payload.to_vec()))
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
        continues: Option<u64>,
        timeout: Duration,
        on_reply: LookupReplyHandler,
    ) {
        let id = self.lookups.next_id.fetch_add(1, Ordering::Relaxed);
        self.lookups.add(id, timeout, on_reply);
        // Registered before sending, so a fast reply finds it.
        // A link that dies after this fails every waiting lookup, this one included.
        if let Err(e) =
            self.send(&Frame::Lookup(LookupRequest { id, fingerprints, request_id, continues }))
        {
            self.lookups.fail(id, e);
        }
    }

    /// Queues one whole frame for the writer thread, without waiting for it to be written
    /// (a write that fails later ends the link); `Backlog` when the peer left
    /// [`super::MAX_QUEUED_BYTES`] unread.
    pub(super) fn send(&self, frame: &Frame) -> Result<(), HandshakeError> {
        if let LinkStatus::Dead { reason } = &*lock(&self.status) {
            return Err(HandshakeError::PeerGone(reason.clone()));
        }
        self.outbox.push(frame)
    }

    /// Waits until every frame queued so far was written (true), the link ended, or
    /// `deadline` passed (false).
    pub fn flush(&self, deadline: Instant) -> bool {
        self.outbox.flush(deadline)
    }

    /// Closes the connection; death callbacks are dropped without running them. Also on drop.
    pub fn close(self) {}
}

/// What both of a link's threads end it with: whichever stops first (the reader: the peer
/// gone; the writer: a write failed) marks it dead, fails its lookups, stops the writer and
/// shuts the socket, which stops the reader.
struct LinkEnds {
    status: Arc<Mutex<LinkStatus>>,
    outbox: Arc<Outbox>,
    lookups: Arc<PendingLookups>,
    socket: TcpStream,
}

impl LinkEnds {
    fn clone(&self) -> io::Result<LinkEnds> {
        Ok(LinkEnds {
            status: Arc::clone(&self.status),
            outbox: Arc::clone(&self.outbox),
            lookups: Arc::clone(&self.lookups),
            socket: self.socket.try_clone()?,
        })
    }

    fn end(&self, reason: &str) {
        mark_dead(&self.status, reason.to_owned());
        self.lookups.fail_all(reason);
        self.outbox.close(reason);
        let _ = self.socket.shutdown(Shutdown::Both);
    }
}

/// The writer thread: writes the queued frames in order, each bounded by the socket's write
/// timeout, until the outbox closes or a write fails.
fn write_frames(mut writer: FrameWriter, ends: &LinkEnds) {
    while let Some(frame) = ends.outbox.next() {
        if let Err(e) = writer.send_bytes(frame) {
            ends.end(&format!("writing to the peer failed: {e}"));
            return;
        }
    }
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
        self.outbox.close("closed locally");
        // Wakes the link thread, which then exits on its own; an error means already closed.
        let _ = self.socket.shutdown(Shutdown::Both);
    }
}

pub(super) fn mark_dead(status: &Mutex<LinkStatus>, reason: String) {
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

pub(super) fn connect_stream(
    host: &str,
    port: u16,
    deadline: &Deadline,
) -> Result<TcpStream, HandshakeError> {
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
