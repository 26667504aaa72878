//! A link's outbound frames: queued by whoever sends (the engine's progress thread, the model
//! runner's thread asking for a lookup, the link's own heartbeat), written in order by the
//! link's writer thread. A peer that stops reading stalls its own writer only: every sender
//! returns at once, and its frames wait, up to [`MAX_QUEUED_BYTES`], behind the stalled write,
//! which the side channel's write timeout ends (and the link with it).

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use std::time::Instant;

use super::lock;
use crate::handshake::wire::{self, Frame};
use crate::handshake::HandshakeError;

/// Bytes of frames one link keeps queued: past them a send fails (the peer has read nothing
/// for a while; a notification or lookup lost then ends with its hold's own deadline).
pub const MAX_QUEUED_BYTES: usize = 16 << 20;

#[derive(Default)]
pub(super) struct Outbox {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    /// Encoded frames, oldest first.
    frames: VecDeque<Vec<u8>>,
    bytes: usize,
    /// The writer took a frame and is writing it.
    writing: bool,
    /// No more frames: the link is gone (why), or closed here.
    closed: Option<String>,
}

impl Outbox {
    /// Queues `frame` behind those queued before it.
    pub(super) fn push(&self, frame: &Frame) -> Result<(), HandshakeError> {
        let bytes = wire::encode_frame(frame)?;
        let mut state = lock(&self.state);
        if let Some(reason) = &state.closed {
            return Err(HandshakeError::PeerGone(reason.clone()));
        }
        if state.bytes + bytes.len() > MAX_QUEUED_BYTES {
            return Err(HandshakeError::Backlog { queued: state.bytes });
        }
        state.bytes += bytes.len();
        state.frames.push_back(bytes);
        drop(state);
        self.changed.notify_all();
        Ok(())
    }

    /// The writer's next frame, once there is one; `None` once the outbox closed.
    pub(super) fn next(&self) -> Option<Vec<u8>> {
        let mut state = lock(&self.state);
        state.writing = false;
        self.changed.notify_all();
        loop {
            if state.closed.is_some() {
                return None;
            }
            if let Some(frame) = state.frames.pop_front() {
                state.bytes -= frame.len();
                state.writing = true;
                return Some(frame);
            }
            state = self.changed.wait(state).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// No frame is sent any more; those queued are dropped. The first reason stands.
    pub(super) fn close(&self, reason: &str) {
        let mut state = lock(&self.state);
        state.closed.get_or_insert_with(|| reason.to_owned());
        state.frames.clear();
        state.bytes = 0;
        drop(state);
        self.changed.notify_all();
    }

    /// Waits until every frame queued was written (or the outbox closed), at most until
    /// `deadline`; returns whether it was.
    pub(super) fn flush(&self, deadline: Instant) -> bool {
        let mut state = lock(&self.state);
        loop {
            if state.closed.is_some() || (state.frames.is_empty() && !state.writing) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            state = self.changed.wait_timeout(state, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn frames_go_out_in_order_until_the_outbox_closes_and_a_backlog_is_refused() {
        let outbox = Outbox::default();
        outbox.push(&Frame::Notify(b"a".to_vec())).unwrap();
        outbox.push(&Frame::Ping).unwrap();
        assert_eq!(outbox.next(), Some(wire::encode_frame(&Frame::Notify(b"a".to_vec())).unwrap()));
        assert!(!outbox.flush(Instant::now()), "a frame is being written");
        assert_eq!(outbox.next(), Some(wire::encode_frame(&Frame::Ping).unwrap()));
        let big = Frame::Notify(vec![0; 1 << 19]);
        let mut pushed = 0;
        let refused = loop {
            match outbox.push(&big) {
                Ok(()) => pushed += 1,
                Err(e) => break e,
            }
        };
        assert!(matches!(refused, HandshakeError::Backlog { .. }), "{refused}");
        assert!(pushed > 0 && (pushed + 1) << 19 > MAX_QUEUED_BYTES - (1 << 19), "{pushed}");
        outbox.close("peer gone");
        assert!(outbox.flush(Instant::now() + Duration::from_secs(1)));
        assert_eq!(outbox.next(), None);
        assert!(matches!(outbox.push(&Frame::Ping), Err(HandshakeError::PeerGone(_))));
    }
}
