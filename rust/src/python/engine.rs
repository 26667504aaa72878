//! `kvduplex._core.Engine`: the engine's verbs, each a call into [`crate::engine::Engine`] with
//! its Python arguments checked and converted first and the GIL released while it runs.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::{parse_block_slice, parse_fingerprint, parse_fingerprints, seconds, to_py};
use super::{Lookup, Transfer};
use crate::descriptors::BlockLayout;
use crate::engine::{self, EngineConfig, EngineError};
use crate::handshake::Fingerprint;
use crate::held_index::AnnouncedChanges;
use crate::holds::{Evict, HoldKind};

/// `Engine.announced_changes`: (cursor, whole, too_large, added, removed, synced).
type PyAnnounced = (u64, bool, bool, Vec<String>, Vec<String>, bool);

#[pyclass(module = "kvduplex._core", frozen)]
pub(super) struct Engine {
    /// Calls share the engine (it is thread-safe), so a slow `connect` or `lookup` to one
    /// peer never waits behind another; only `close` takes it exclusively.
    inner: std::sync::RwLock<Option<engine::Engine>>,
    engine_id: String,
    generation: u64,
    host: String,
    port: u16,
}

impl Engine {
    fn with<T>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&engine::Engine) -> Result<T, EngineError> + Send,
    ) -> PyResult<T>
    where
        T: Send,
    {
        py.detach(|| {
            let guard = self.inner.read().unwrap_or_else(|p| p.into_inner());
            match guard.as_ref() {
                Some(engine) => f(engine),
                None => Err(EngineError::Closed),
            }
        })
        .map_err(|e| to_py(py, e))
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Python drops an unclosed engine with the GIL held, while closing joins threads that
        // log through pyo3-log, which needs the GIL: close with the GIL released.
        let engine = self.inner.get_mut().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(engine) = engine {
            let mut engine = Some(engine);
            let closed = Python::try_attach(|py| {
                let mut engine = engine.take();
                py.detach(move || engine.as_mut().map(engine::Engine::close));
            });
            if closed.is_none() {
                // The interpreter is shutting down: its threads can no longer log through
                // Python, so nothing is joined; the process is ending and the OS reclaims.
                std::mem::forget(engine);
            }
        }
    }
}

#[pymethods]
impl Engine {
    #[new]
    #[allow(clippy::too_many_arguments)] // mirrors the Python keyword arguments one to one
    #[pyo3(signature = (engine_id, fingerprint, *, host="127.0.0.1".to_string(), port=0, secret=None, ucx_lib_dir=None, heartbeat_s=1.0, peer_error_handling=true, lookup_claim_s=30.0, allow_unauthenticated=false, same_host_reads=true))]
    fn new(
        py: Python<'_>,
        engine_id: String,
        fingerprint: BTreeMap<String, String>,
        host: String,
        port: u16,
        secret: Option<Vec<u8>>,
        ucx_lib_dir: Option<PathBuf>,
        heartbeat_s: f64,
        peer_error_handling: bool,
        lookup_claim_s: f64,
        allow_unauthenticated: bool,
        same_host_reads: bool,
    ) -> PyResult<Self> {
        let lookup_claim = seconds("lookup_claim_s", lookup_claim_s)?;
        let heartbeat = seconds("heartbeat_s", heartbeat_s)?;
        if heartbeat.is_zero() {
            return Err(PyValueError::new_err("heartbeat_s must be positive"));
        }
        let config = EngineConfig {
            engine_id: engine_id.clone(),
            fingerprint: Fingerprint(fingerprint),
            host,
            port,
            secret,
            ucx_lib_dir,
            heartbeat,
            peer_error_handling,
            lookup_claim,
            allow_unauthenticated,
            same_host_reads,
        };
        let engine = py.detach(|| engine::Engine::start(config)).map_err(|e| to_py(py, e))?;
        let addr = engine.side_channel_addr().map_err(|e| to_py(py, e))?;
        let generation = engine.generation();
        Ok(Engine {
            inner: std::sync::RwLock::new(Some(engine)),
            engine_id,
            generation,
            host: addr.ip().to_string(),
            port: addr.port(),
        })
    }

    #[getter]
    fn engine_id(&self) -> &str {
        &self.engine_id
    }

    #[getter]
    fn generation(&self) -> u64 {
        self.generation
    }

    #[getter]
    fn side_channel_host(&self) -> &str {
        &self.host
    }

    #[getter]
    fn side_channel_port(&self) -> u16 {
        self.port
    }

    /// The one place a raw address enters the crate (see [`crate::engine::RegionMemory`]).
    #[pyo3(signature = (addr, length, *, owner=None))]
    fn register_region(
        &self,
        py: Python<'_>,
        addr: u64,
        length: u64,
        owner: Option<Py<PyAny>>,
    ) -> PyResult<()> {
        // SAFETY: the FFI edge, where the promise is made for Python, which hands us only the
        // address of memory it owns: `Engine.register_region`'s documented contract (see
        // `_core.pyi`) is that `owner` (the tensor or buffer the range belongs to) keeps the
        // range allocated while it lives, or, without one, that the caller keeps it allocated,
        // for its blocks only, until the engine is closed. The connector registers vLLM's
        // KV-cache tensors with themselves as owners. What can be checked is: a null or empty
        // range is refused, and a host range must be mapped now.
        let memory = unsafe {
            match owner {
                Some(owner) => engine::RegionMemory::kept_alive_by(addr, length, Box::new(owner)),
                None => engine::RegionMemory::new(addr, length),
            }
        };
        self.with(py, |e| e.register_region(memory))
    }

    /// Stop offering this engine's memory (vLLM is about to unmap it): see
    /// `engine::Engine::unregister_regions`. Returns how many regions it unregistered.
    fn unregister_regions(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |e| e.unregister_regions())
    }

    fn set_layout(
        &self,
        py: Python<'_>,
        segment_bases: Vec<u64>,
        block_len: u64,
        block_stride: u64,
        num_blocks: u64,
    ) -> PyResult<()> {
        let layout = BlockLayout { segment_bases, block_stride, block_len, num_blocks };
        self.with(py, |e| e.set_layout(layout))
    }

    #[pyo3(signature = (host, port, timeout_s=10.0))]
    fn connect(&self, py: Python<'_>, host: String, port: u16, timeout_s: f64) -> PyResult<String> {
        let timeout = seconds("timeout_s", timeout_s)?;
        self.with(py, |e| e.connect(&host, port, timeout))
    }

    /// Non-blocking: `("ready", engine_id)`, `("connecting", None)` or `("failed", reason)` for
    /// the side channel at `host:port`, starting a handshake (at most `timeout_s`) when none
    /// is under way and the backoff after a failure has passed. With `expected_engine_id`, a
    /// peer of another id is a failure.
    #[pyo3(signature = (host, port, *, expected_engine_id=None, timeout_s=10.0))]
    fn peer_status(
        &self,
        py: Python<'_>,
        host: String,
        port: u16,
        expected_engine_id: Option<String>,
        timeout_s: f64,
    ) -> PyResult<(&'static str, Option<String>)> {
        let timeout = seconds("timeout_s", timeout_s)?;
        let status = self
            .with(py, |e| Ok(e.peer_status(&host, port, expected_engine_id.as_deref(), timeout)))?;
        Ok(match status {
            engine::PeerStatus::Ready(engine_id) => ("ready", Some(engine_id)),
            engine::PeerStatus::Connecting => ("connecting", None),
            engine::PeerStatus::Failed(reason) => ("failed", Some(reason)),
        })
    }

    fn peer_alive(&self, py: Python<'_>, peer_engine_id: String) -> PyResult<bool> {
        self.with(py, |e| Ok(e.peer_alive(&peer_engine_id)))
    }

    #[pyo3(signature = (peer_engine_id, local_block_ids, remote_block_ids, *, notify=None, timeout_s=30.0, segments=None, block_slice=None))]
    #[allow(clippy::too_many_arguments)]
    fn read_blocks(
        &self,
        py: Python<'_>,
        peer_engine_id: String,
        local_block_ids: Vec<i64>,
        remote_block_ids: Vec<i64>,
        notify: Option<Vec<u8>>,
        timeout_s: f64,
        segments: Option<(usize, usize)>,
        block_slice: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Transfer> {
        let timeout = seconds("timeout_s", timeout_s)?;
        let segments = segments.map(|(start, end)| start..end);
        let slice = block_slice.as_ref().map(parse_block_slice).transpose()?;
        let inner = self.with(py, |e| {
            e.read_blocks(
                &peer_engine_id,
                &local_block_ids,
                &remote_block_ids,
                notify,
                timeout,
                segments,
                slice,
            )
        })?;
        Ok(Transfer { inner })
    }

    fn notify(&self, py: Python<'_>, peer_engine_id: String, payload: Vec<u8>) -> PyResult<()> {
        self.with(py, |e| e.notify(&peer_engine_id, &payload))
    }

    /// `[(engine_id, "host:port")]` of the engines connected to our side channel that
    /// announced their own.
    fn known_peers(&self, py: Python<'_>) -> PyResult<Vec<(String, String)>> {
        let peers = self.with(py, |e| Ok(e.known_peers()))?;
        Ok(peers.into_iter().map(|p| (p.engine_id, p.side_channel)).collect())
    }

    /// Holds a request's blocks for readers: `turn=False`, a prefill node's prompt for its
    /// decode node (granted by name, ends once read); `turn=True`, a decode node's finished
    /// turn (also found by lookups, evictable).
    /// The lease ends at `lease_expiry`, the moment (Unix seconds) the scheduler announced to
    /// readers and wakes an idle engine at: it becomes an instant of the hold book's clock
    /// only here, both clocks read together, so the hold has ended when that wake-up's step
    /// looks (a TTL taken earlier ended a moment late, and that step freed nothing).
    #[pyo3(signature = (request_id, num_blocks, lease_expiry, *, fingerprints, turn, offer=Vec::new(), prompt_blocks=0))]
    #[allow(clippy::too_many_arguments)]
    fn hold(
        &self,
        py: Python<'_>,
        request_id: String,
        num_blocks: usize,
        lease_expiry: f64,
        fingerprints: Vec<String>,
        turn: bool,
        offer: Vec<u8>,
        prompt_blocks: usize,
    ) -> PyResult<()> {
        if !lease_expiry.is_finite() {
            return Err(PyValueError::new_err(format!(
                "lease_expiry must be a finite time in seconds since the Unix epoch, got {lease_expiry}"
            )));
        }
        let fingerprints = parse_fingerprints(&fingerprints)?;
        let kind = if turn { HoldKind::Turn } else { HoldKind::ForDecode };
        let lease_ends = crate::clock::instant_of_unix(lease_expiry);
        self.with(py, |e| {
            e.hold(&request_id, kind, num_blocks, fingerprints, prompt_blocks, offer, lease_ends)
        })
    }

    /// Expect the turn `request_id` computes to be held when it finishes (`end`: the
    /// fingerprint of its whole prompt) until `settle_turns`.
    fn expect_turn(&self, py: Python<'_>, request_id: String, end: String) -> PyResult<()> {
        let end = parse_fingerprint(&end)?;
        self.with(py, |e| e.expect_turn(&request_id, end))
    }

    fn settle_turns(&self, py: Python<'_>, request_ids: Vec<String>) -> PyResult<()> {
        self.with(py, |e| {
            e.settle_turns(&request_ids);
            Ok(())
        })
    }

    fn release_hold(
        &self,
        py: Python<'_>,
        reader: String,
        request_id: String,
        claim_id: u64,
    ) -> PyResult<bool> {
        self.with(py, |e| Ok(e.release_hold(&reader, &request_id, claim_id)))
    }

    /// Renew the lease of a prompt held for a decode node that a reader has queued, whose
    /// prompt's first block has the fingerprint `first_fingerprint`; whether it was renewed.
    fn renew_hold(
        &self,
        py: Python<'_>,
        request_id: String,
        first_fingerprint: String,
    ) -> PyResult<bool> {
        let first = parse_fingerprint(&first_fingerprint)?;
        self.with(py, |e| Ok(e.renew_hold(&request_id, first)))
    }

    fn expire_holds(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        self.with(py, |e| Ok(e.expire_holds()))
    }

    /// `prompts`: prompts held for decode nodes may go too (the engine is short of blocks),
    /// not only finished turns; `unread_prompts_s`: those that no reader has claimed for
    /// that many seconds may.
    #[pyo3(signature = (num_blocks, *, prompts=false, unread_prompts_s=None))]
    fn evict_holds(
        &self,
        py: Python<'_>,
        num_blocks: usize,
        prompts: bool,
        unread_prompts_s: Option<f64>,
    ) -> PyResult<Vec<String>> {
        let which = match (prompts, unread_prompts_s) {
            (true, _) => Evict::AnyHold,
            (false, None) => Evict::Turns,
            (false, Some(seconds)) => {
                Evict::TurnsAndUnread(Duration::try_from_secs_f64(seconds).map_err(|_| {
                    PyValueError::new_err(format!(
                        "unread_prompts_s must be a finite number of seconds >= 0, got {seconds}"
                    ))
                })?)
            }
        };
        self.with(py, |e| Ok(e.evict_holds(num_blocks, which)))
    }

    /// The engine's weights changed: every hold ends, none is granted or found again.
    /// Returns the holds this freed (unclaimed ones); claimed ones are freed, and returned by
    /// `release_hold` / `expire_holds`, once their claims end.
    fn end_holds(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        self.with(py, |e| Ok(e.evict_holds(usize::MAX, Evict::Stale)))
    }

    /// Seconds until the last claim alive on an ended hold ends at the latest (released
    /// earlier, or not); None when no reader reads an ended hold.
    fn ended_claims_s(&self, py: Python<'_>) -> PyResult<Option<f64>> {
        let until = self.with(py, |e| Ok(e.ended_claims_until()))?;
        Ok(until.map(|until| until.saturating_duration_since(Instant::now()).as_secs_f64()))
    }

    /// (claims alive now, blocks held, lookups told to ask again so far) on this engine's
    /// hold book.
    fn hold_occupancy(&self, py: Python<'_>) -> PyResult<(usize, usize, u64)> {
        self.with(py, |e| Ok(e.hold_occupancy()))
    }

    /// The fingerprints announced by the decode engines we are connected to, as changes since
    /// `cursor` (None: the whole set): `(cursor, whole, too_large, added, removed, synced)`,
    /// where `whole` says `added` is the whole set, `too_large` that the whole set was due but
    /// has more than `max_whole` fingerprints (none sent), and `synced` that every one of
    /// `targets` (`(host, port)`) has announced all it holds.
    #[pyo3(signature = (cursor, targets, max_whole))]
    fn announced_changes(
        &self,
        py: Python<'_>,
        cursor: Option<u64>,
        targets: Vec<(String, u16)>,
        max_whole: usize,
    ) -> PyResult<PyAnnounced> {
        let targets: Vec<String> =
            targets.iter().map(|(host, port)| format!("{host}:{port}")).collect();
        let (changes, synced) =
            self.with(py, |e| Ok(e.announced_changes(cursor, &targets, max_whole)))?;
        let hex = |fps: Vec<u64>| fps.into_iter().map(|fp| format!("{fp:016x}")).collect();
        let AnnouncedChanges { cursor, whole, too_large, added, removed } = changes;
        Ok((cursor, whole, too_large, hex(added), hex(removed), synced))
    }

    /// How many answers this engine's lookups have had so far: read before looking at the
    /// lookups' answers, and passed to `wait_for_lookup_answers`.
    fn lookup_answers_seen(&self, py: Python<'_>) -> PyResult<u64> {
        self.with(py, |e| Ok(e.lookup_answers().position()))
    }

    /// Waits (without the GIL) until the engine's lookups have more than `seen` answers in
    /// all, at most `timeout_s`; returns the count. `close` does not wait for it.
    #[pyo3(signature = (seen, timeout_s))]
    fn wait_for_lookup_answers(&self, py: Python<'_>, seen: u64, timeout_s: f64) -> PyResult<u64> {
        let wait = seconds("timeout_s", timeout_s)?;
        let answered = self.with(py, |e| Ok(e.lookup_answers()))?;
        let never = AtomicBool::new(false);
        Ok(py.detach(|| answered.wait_past(seen, wait, &never)))
    }

    /// Asks every `(host, port)` at once for the longest held turn starting with
    /// `fingerprints`, or with `request_id` for a grant of that hold's blocks that carry them,
    /// without waiting (see `engine::Engine::start_lookup`); poll the result. `continues`: the
    /// end of a prompt handed to a decode node that this prompt continues (an owner computing
    /// that turn answers "not yet", and is asked again).
    #[pyo3(signature = (targets, fingerprints, timeout_s=1.0, *, request_id=None, continues=None))]
    fn start_lookup(
        &self,
        py: Python<'_>,
        targets: Vec<(String, u16)>,
        fingerprints: Vec<String>,
        timeout_s: f64,
        request_id: Option<String>,
        continues: Option<String>,
    ) -> PyResult<Lookup> {
        let timeout = seconds("timeout_s", timeout_s)?;
        let fingerprints = parse_fingerprints(&fingerprints)?;
        let continues = continues.as_deref().map(parse_fingerprint).transpose()?;
        let inner = self.with(py, |e| {
            Ok(e.start_lookup(targets, fingerprints, request_id, continues, timeout))
        })?;
        Ok(Lookup { inner })
    }

    fn take_notifications<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Vec<(String, Bound<'py, PyBytes>)>> {
        let notes = self.with(py, |e| Ok(e.take_notifications()))?;
        Ok(notes.into_iter().map(|n| (n.sender, PyBytes::new(py, &n.payload))).collect())
    }

    fn close(&self, py: Python<'_>) {
        py.detach(|| {
            if let Some(mut engine) = self.inner.write().unwrap_or_else(|p| p.into_inner()).take() {
                engine.close();
            }
        });
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, py: Python<'_>, _exc_type: Py<PyAny>, _exc: Py<PyAny>, _tb: Py<PyAny>) {
        self.close(py);
    }

    fn __repr__(&self) -> String {
        format!("Engine(engine_id={:?}, side_channel={}:{})", self.engine_id, self.host, self.port)
    }
}
