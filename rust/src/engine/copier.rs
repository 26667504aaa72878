//! Same-host copies run on a thread per peer, never on the caller's thread nor on one thread
//! that all peers share. A copy can block for good: an owner whose memory is backed by
//! userfaultfd or FUSE leaves `process_vm_readv` waiting in the kernel, where no signal short
//! of killing the process ends it. Such a peer then stalls its own later batches only, and
//! [`CopyThreads::join_until`] (the engine's close) gives up on it after a bounded wait.

use std::sync::mpsc;
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::lock;
use crate::same_host::SameHostCopy;

/// How long a copy thread keeps looking for its peer's next batch before it sleeps: batches
/// posted back to back (a layer-by-layer pull, a burst of requests) then skip the wake-up of a
/// sleeping thread, which costs about as much as copying a small batch.
const SPIN_FOR_NEXT: Duration = Duration::from_micros(200);

/// A copy thread: runs its peer's batches in order until the queue closes.
fn copy_loop(queue: mpsc::Receiver<SameHostCopy>) {
    loop {
        let spin_until = Instant::now() + SPIN_FOR_NEXT;
        let next = loop {
            match queue.try_recv() {
                Ok(copy) => break Some(copy),
                Err(mpsc::TryRecvError::Disconnected) => break None,
                Err(mpsc::TryRecvError::Empty) if Instant::now() < spin_until => {
                    std::thread::yield_now()
                }
                Err(mpsc::TryRecvError::Empty) => break queue.recv().ok(),
            }
        };
        match next {
            Some(copy) => copy.run(),
            None => return,
        }
    }
}

/// A peer's copy queue: started by its first batch; dropped (which ends its thread once the
/// batches queued have run) when the peer's connection closes.
#[derive(Default)]
pub(super) enum CopyQueue {
    #[default]
    NotStarted,
    Open(mpsc::Sender<SameHostCopy>),
}

impl CopyQueue {
    /// Queues `copy` for this peer's thread, starting it (and recording it in `threads`) on
    /// first use; `Err` (the copy dropped, so its batch fails) when no thread can be started.
    pub(super) fn submit(
        &mut self,
        copy: SameHostCopy,
        threads: &CopyThreads,
        peer: &str,
    ) -> Result<(), String> {
        if let CopyQueue::NotStarted = self {
            let (sender, queue) = mpsc::channel::<SameHostCopy>();
            let thread = std::thread::Builder::new()
                .name("kvduplex-copy".into())
                .spawn(move || copy_loop(queue))
                .map_err(|e| format!("cannot start a copy thread for peer {peer}: {e}"))?;
            threads.started(peer, thread);
            *self = CopyQueue::Open(sender);
        }
        let CopyQueue::Open(sender) = self else {
            return Err(format!("the copy queue of peer {peer} did not open"));
        };
        sender.send(copy).map_err(|_| format!("the copy thread of peer {peer} is gone"))
    }
}

/// Every peer's copy thread, for the engine's close.
#[derive(Default)]
pub(super) struct CopyThreads {
    running: Mutex<Vec<(String, JoinHandle<()>)>>,
}

impl CopyThreads {
    /// Records a peer's new copy thread, and joins those that ended (their peers' queues
    /// closed): the record holds the threads running, not one per connection ever made.
    fn started(&self, peer: &str, thread: JoinHandle<()>) {
        let mut running = lock(&self.running);
        let (ended, left): (Vec<_>, Vec<_>) = running.drain(..).partition(|(_, t)| t.is_finished());
        *running = left;
        running.push((peer.to_owned(), thread));
        drop(running);
        for (_, thread) in ended {
            let _ = thread.join();
        }
    }

    /// Joins the copy threads that end by `deadline` (their queues must be closed already);
    /// true if all did. One still blocked then is left running, and logged: its batch stays
    /// unfinished, so the engine's memory stays registered rather than be freed under it.
    pub(super) fn join_until(&self, deadline: Instant) -> bool {
        loop {
            let mut running = lock(&self.running);
            let (ended, left): (Vec<_>, Vec<_>) =
                running.drain(..).partition(|(_, t)| t.is_finished());
            *running = left;
            drop(running);
            for (_, thread) in ended {
                let _ = thread.join();
            }
            let running = lock(&self.running);
            if running.is_empty() {
                return true;
            }
            if Instant::now() >= deadline {
                for (peer, _) in running.iter() {
                    log::error!("a same-host copy from peer {peer} has not returned (its memory may be backed by userfaultfd or FUSE); closing without it");
                }
                return false;
            }
            drop(running);
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
