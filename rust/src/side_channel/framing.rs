//! Frames over a blocking socket: reading within a deadline, writing with tags, and the
//! liveness loop of an established link.

use super::*;

/// How long a link that seems silent reads its socket before it calls the peer gone.
const LATE_FRAME_WAIT: Duration = Duration::from_millis(1);

/// Runs an established link until it ends; returns why it ended. Pings only keep the link
/// alive; every other frame goes to `on_frame`. Silence is the socket's, not this thread's: a
/// thread that went without a core past the peer's heartbeats reads what the peer sent
/// meanwhile before it calls the peer gone.
pub(super) fn run_link(
    reader: &mut FrameReader,
    mut liveness: Liveness,
    mut send_ping: impl FnMut() -> Result<(), HandshakeError>,
    mut on_frame: impl FnMut(Frame) -> Result<(), HandshakeError>,
) -> HandshakeError {
    loop {
        let now = Instant::now();
        let read = match liveness.poll(now) {
            LivenessAction::Dead { silent_for } => {
                match reader.read_frame_within(LATE_FRAME_WAIT) {
                    Ok(None) => {
                        return HandshakeError::PeerGone(format!(
                            "no frame for {silent_for:?}, {} of the peer's heartbeats",
                            Liveness::MISSED_HEARTBEATS
                        ))
                    }
                    read => read,
                }
            }
            LivenessAction::SendPing => match send_ping() {
                Ok(()) => {
                    liveness.on_ping_sent(now);
                    continue;
                }
                Err(e) => return e,
            },
            LivenessAction::Wait(wait) => reader.read_frame_within(wait),
        };
        match read {
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
        }
    }
}

/// Reads frames off a blocking socket; a read that times out mid-frame loses nothing.
pub(super) struct FrameReader {
    pub(super) stream: TcpStream,
    pub(super) frames: FrameBuffer,
    pub(super) chunk: Vec<u8>,
}

impl FrameReader {
    pub(super) fn new(stream: TcpStream) -> Self {
        Self { stream, frames: FrameBuffer::new(), chunk: vec![0; READ_CHUNK] }
    }

    /// The next frame, or `None` if none completed within `wait` (which must be non-zero).
    pub(super) fn read_frame_within(
        &mut self,
        wait: Duration,
    ) -> Result<Option<Frame>, HandshakeError> {
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
    pub(super) fn read_frame_by(
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

pub(super) fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

pub(super) struct Deadline {
    pub(super) at: Instant,
    pub(super) total: Duration,
}

impl Deadline {
    pub(super) fn after(total: Duration) -> Self {
        Self { at: deadline_after(total), total }
    }

    /// Time left, never zero; `Timeout` once the deadline has passed.
    pub(super) fn left(&self, waiting_for: &'static str) -> Result<Duration, HandshakeError> {
        let left = self.at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(HandshakeError::Timeout { waiting_for, after: self.total });
        }
        Ok(left)
    }
}

/// Writes whole frames on an established connection, each followed by its tag when the
/// handshake was authenticated.
pub(super) struct FrameWriter {
    pub(super) stream: TcpStream,
    pub(super) auth: Option<FrameAuth>,
}

impl FrameWriter {
    pub(super) fn new(stream: TcpStream) -> Self {
        Self { stream, auth: None }
    }

    pub(super) fn authenticate(&mut self, auth: FrameAuth) {
        self.auth = Some(auth);
    }

    /// One write per frame (and its tag); a failed write leaves the stream unusable.
    pub(super) fn send(&mut self, frame: &Frame) -> Result<(), HandshakeError> {
        self.send_bytes(wire::encode_frame(frame)?)
    }

    /// [`FrameWriter::send`] of an encoded frame.
    pub(super) fn send_bytes(&mut self, mut bytes: Vec<u8>) -> Result<(), HandshakeError> {
        if let Some(auth) = &mut self.auth {
            let tag = auth.tag(&bytes);
            bytes.extend_from_slice(&tag);
        }
        (&self.stream).write_all(&bytes)?;
        Ok(())
    }
}

/// Writes one frame during a handshake (no tags yet).
pub(super) fn write_frame(mut stream: &TcpStream, frame: &Frame) -> Result<(), HandshakeError> {
    stream.write_all(&wire::encode_frame(frame)?)?;
    Ok(())
}

/// (ours, theirs): the authenticators of the frames we send in `ours` and of the peer's.
pub(super) fn frame_auths(
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

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};

    use super::*;
    use crate::handshake::wire::encode_frame;

    /// A link whose reader last heard the peer `silent` ago, and the peer's end of it.
    fn link_silent_for(silent: Duration) -> (FrameReader, Liveness, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let peer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (ours, _) = listener.accept().unwrap();
        let now = Instant::now();
        let heard = now.checked_sub(silent).unwrap_or(now);
        let heartbeat = Duration::from_millis(100);
        (FrameReader::new(ours), Liveness::new(heard, heartbeat, heartbeat), peer)
    }

    #[test]
    fn a_starved_reader_reads_what_the_peer_sent_before_calling_it_gone() {
        let (mut reader, liveness, mut peer) = link_silent_for(Duration::from_secs(5));
        peer.write_all(&encode_frame(&Frame::Ping).unwrap()).unwrap();
        let closer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drop(peer);
        });
        let end = run_link(&mut reader, liveness, || Ok(()), |_| Ok(()));
        closer.join().unwrap();
        assert!(end.to_string().contains("closed"), "{end}");
    }

    #[test]
    fn a_silent_peer_is_gone_after_its_heartbeats() {
        let (mut reader, liveness, _peer) = link_silent_for(Duration::from_secs(5));
        let end = run_link(&mut reader, liveness, || Ok(()), |_| Ok(()));
        assert!(end.to_string().contains("no frame for"), "{end}");
    }
}
