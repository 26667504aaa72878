//! The owner's announcements to a connected reader: what its lookups can find, a snapshot
//! first and then each change, sent from a thread of the connection's own
//! (see [`crate::holds::feed`] and, on the reader's side, [`crate::held_index`]).

use super::*;
use crate::holds::feed::HeldUpdate;

/// What an owner announces to its readers.
pub trait HeldSource: Send + Sync {
    /// The updates for a reader whose view stands at `cursor` (`None`: it has none yet), and
    /// the cursor after them.
    fn updates_since(&self, cursor: Option<u64>) -> (u64, Vec<HeldUpdate>);
    /// Blocks until there is more past `cursor`, `stop` is set (checked so that a
    /// [`HeldSource::wake`] after setting it is never missed), or `wait` passes.
    fn wait_past(&self, cursor: u64, wait: Duration, stop: &AtomicBool);
    /// Wakes every thread in [`HeldSource::wait_past`].
    fn wake(&self);
}

/// How long an idle announcer waits before it looks again (it is woken by every change and
/// when its connection ends).
const IDLE_WAIT: Duration = Duration::from_secs(5);

/// Sends one connection's announcements until stopped or a write fails.
pub(super) struct Announcer {
    stop: Arc<AtomicBool>,
    source: Arc<dyn HeldSource>,
    thread: JoinHandle<()>,
}

impl Announcer {
    /// Starts announcing to the reader `who` through `writer`; a failed write shuts `socket`
    /// down, which ends the connection.
    pub(super) fn start(
        source: Arc<dyn HeldSource>,
        writer: Arc<Mutex<FrameWriter>>,
        socket: TcpStream,
        who: String,
    ) -> io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let (thread_source, thread_stop) = (Arc::clone(&source), Arc::clone(&stop));
        let thread = thread::Builder::new()
            .name("kvduplex-announce".to_owned())
            .spawn(move || announce(&*thread_source, &writer, &socket, &thread_stop, &who))?;
        Ok(Self { stop, source, thread })
    }

    pub(super) fn stop(self) {
        self.stop.store(true, Ordering::Release);
        self.source.wake();
        let _ = self.thread.join();
    }
}

fn announce(
    source: &dyn HeldSource,
    writer: &Mutex<FrameWriter>,
    socket: &TcpStream,
    stop: &AtomicBool,
    who: &str,
) {
    let mut cursor = None;
    while !stop.load(Ordering::Acquire) {
        let (next, updates) = source.updates_since(cursor);
        for update in updates {
            if let Err(e) = lock(writer).send(&Frame::Held(update)) {
                if !stop.load(Ordering::Acquire) {
                    warn!("side channel: closing the connection of {who}: announcing what this engine holds failed: {e}");
                }
                let _ = socket.shutdown(Shutdown::Both);
                return;
            }
        }
        cursor = Some(next);
        source.wait_past(next, IDLE_WAIT, stop);
    }
}
