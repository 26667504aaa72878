//! `kvduplex._core`: the thin pyo3 layer over [`crate::engine`]. Python inputs are copied into
//! Rust values first, blocking work runs with the GIL released, and every Rust error becomes a
//! typed Python exception (see `python/kvduplex/_core.pyi`).
//!
//! Here: the exceptions, the conversions every verb shares, `Transfer`, `Lookup` and the
//! module; the `Engine` class is `engine.rs`.

mod engine;

use std::time::Duration;

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::descriptors::BlockSlice;
use crate::engine::EngineError;
use crate::handshake;
use engine::Engine;

create_exception!(
    kvduplex._core,
    KvDuplexError,
    PyException,
    "Base class of every kvduplex error."
);
create_exception!(
    kvduplex._core,
    UcxError,
    KvDuplexError,
    "UCX could not be loaded or a UCX call failed."
);
create_exception!(
    kvduplex._core,
    HandshakeError,
    KvDuplexError,
    "The side-channel handshake with a peer failed."
);
create_exception!(
    kvduplex._core,
    IncompatiblePeerError,
    HandshakeError,
    "Protocol version or compatibility fingerprint differs."
);
create_exception!(
    kvduplex._core,
    AuthenticationError,
    HandshakeError,
    "Shared-secret authentication failed."
);
create_exception!(kvduplex._core, TransferError, KvDuplexError, "A batch read failed.");
create_exception!(
    kvduplex._core,
    PeerNotConnectedError,
    KvDuplexError,
    "No ready connection to the named peer."
);

/// `PlanError` must also be a `ValueError`, which `create_exception!` cannot express; it is
/// built with `type()` at module init.
static PLAN_ERROR: pyo3::sync::PyOnceLock<Py<pyo3::types::PyType>> = pyo3::sync::PyOnceLock::new();

fn to_py(py: Python<'_>, err: EngineError) -> PyErr {
    let msg = err.to_string();
    match err {
        EngineError::Ucx(_) => UcxError::new_err(msg),
        EngineError::Handshake(h) => match h {
            handshake::HandshakeError::ProtocolVersion { .. }
            | handshake::HandshakeError::Incompatible { .. } => IncompatiblePeerError::new_err(msg),
            handshake::HandshakeError::AuthRequired
            | handshake::HandshakeError::AuthFailed
            | handshake::HandshakeError::PeerNotAuthenticated => AuthenticationError::new_err(msg),
            _ => HandshakeError::new_err(msg),
        },
        EngineError::Plan(_) => match PLAN_ERROR.get(py) {
            Some(t) => PyErr::from_type(t.bind(py).clone(), msg),
            None => PyValueError::new_err(msg),
        },
        EngineError::PeerNotConnected(_) | EngineError::AmbiguousPeer { .. } => {
            PeerNotConnectedError::new_err(msg)
        }
        EngineError::ConnectFailed { .. } => HandshakeError::new_err(msg),
        EngineError::Transfer(_) | EngineError::Closed => TransferError::new_err(msg),
        EngineError::WaitTimeout(_) => PyTimeoutError::new_err(msg),
        EngineError::InvalidArgument(_) | EngineError::Hold(_) => PyValueError::new_err(msg),
    }
}

fn seconds(name: &str, value: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value).map_err(|_| {
        PyValueError::new_err(format!(
            "{name} must be a finite, non-negative number of seconds, got {value}"
        ))
    })
}

/// `block_slice`: a `(remote_offset, local_offset, len)` sequence of three non-negative ints.
/// Anything else is a `ValueError`; whether the slice fits the blocks is the planner's check.
fn parse_block_slice(value: &Bound<'_, PyAny>) -> PyResult<BlockSlice> {
    let bad = |why: String| {
        PyValueError::new_err(format!("block_slice must be a (remote_offset, local_offset, len) tuple of non-negative ints: {why}"))
    };
    let items: Vec<Bound<'_, PyAny>> = value.extract().map_err(|e: PyErr| bad(e.to_string()))?;
    let [remote_offset, local_offset, len] = items.as_slice() else {
        return Err(bad(format!("got {} items", items.len())));
    };
    let field = |name: &str, item: &Bound<'_, PyAny>| {
        item.extract::<u64>().map_err(|e| bad(format!("{name}: {e}")))
    };
    Ok(BlockSlice {
        remote_offset: field("remote_offset", remote_offset)?,
        local_offset: field("local_offset", local_offset)?,
        len: field("len", len)?,
    })
}

#[pyclass(module = "kvduplex._core", frozen)]
struct Transfer {
    inner: crate::engine::Transfer,
}

#[pymethods]
impl Transfer {
    #[getter]
    fn nbytes(&self) -> u64 {
        self.inner.nbytes
    }

    #[getter]
    fn num_descriptors(&self) -> usize {
        self.inner.num_descriptors
    }

    /// Read directly from a process on this host (`same_host_reads`), not through UCX.
    #[getter]
    fn same_host(&self) -> bool {
        self.inner.same_host()
    }

    /// Takes the worker lock (briefly, to progress UCX): never with the GIL held.
    fn done(&self, py: Python<'_>) -> PyResult<bool> {
        py.detach(|| self.inner.poll()).map_err(|e| to_py(py, e))
    }

    #[pyo3(signature = (timeout_s=None))]
    fn wait(&self, py: Python<'_>, timeout_s: Option<f64>) -> PyResult<()> {
        let timeout = timeout_s.map(|t| seconds("timeout_s", t)).transpose()?;
        py.detach(|| self.inner.wait(timeout)).map_err(|e| to_py(py, e))
    }
}

/// A lookup sent to several owners at once (see `Engine.start_lookup`).
#[pyclass(module = "kvduplex._core", frozen)]
struct Lookup {
    inner: crate::engine::LookupFanOut,
}

/// One owner's answer: (address asked, owner engine id or None, match or None, error or None).
type PyLookupAnswer<'py> =
    (String, Option<String>, Option<(String, u32, u64, f64, Bound<'py, PyBytes>)>, Option<String>);

#[pymethods]
impl Lookup {
    /// How many targets were asked; the others announced they hold none of the prompt and
    /// were answered with no match at once.
    #[getter]
    fn asked(&self) -> usize {
        self.inner.asked()
    }

    /// One entry per target, `None` while that owner has not answered.
    fn answers<'py>(&self, py: Python<'py>) -> Vec<Option<PyLookupAnswer<'py>>> {
        self.inner
            .answers()
            .into_iter()
            .map(|answer| {
                answer.map(|a| match a.outcome {
                    Ok((peer, found)) => {
                        let found = found.map(|m| {
                            (
                                m.owner_request_id,
                                m.matched_blocks,
                                m.claim_id,
                                m.claim_ms as f64 / 1000.0,
                                PyBytes::new(py, &m.offer),
                            )
                        });
                        (a.address, Some(peer), found, None)
                    }
                    Err(e) => (a.address, None, None, Some(e)),
                })
            })
            .collect()
    }
}

/// Token fingerprints travel as 16-character lowercase hex strings (`token_fingerprint.py`).
fn parse_fingerprints(hex: &[String]) -> PyResult<Vec<u64>> {
    hex.iter().map(|h| parse_fingerprint(h)).collect()
}

fn parse_fingerprint(h: &str) -> PyResult<u64> {
    let valid =
        h.len() == 16 && h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    valid.then(|| u64::from_str_radix(h, 16).ok()).flatten().ok_or_else(|| {
        PyValueError::new_err(format!(
            "a fingerprint must be 16 lowercase hex characters, got {h:?}"
        ))
    })
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    pyo3_log::init();
    m.add("ANNOUNCE_STRIDE", crate::holds::feed::ANNOUNCE_STRIDE)?;
    m.add("KvDuplexError", py.get_type::<KvDuplexError>())?;
    m.add("UcxError", py.get_type::<UcxError>())?;
    m.add("HandshakeError", py.get_type::<HandshakeError>())?;
    m.add("IncompatiblePeerError", py.get_type::<IncompatiblePeerError>())?;
    m.add("AuthenticationError", py.get_type::<AuthenticationError>())?;
    m.add("TransferError", py.get_type::<TransferError>())?;
    m.add("PeerNotConnectedError", py.get_type::<PeerNotConnectedError>())?;
    let builtins = py.import("builtins")?;
    let bases = (py.get_type::<KvDuplexError>(), py.get_type::<PyValueError>());
    let namespace = pyo3::types::PyDict::new(py);
    namespace.set_item("__module__", "kvduplex._core")?;
    namespace.set_item(
        "__doc__",
        "Block ids or layouts are invalid (negative, out of range, outside registered memory).",
    )?;
    let plan_error = builtins.getattr("type")?.call1(("PlanError", bases, namespace))?;
    let plan_error = plan_error.cast_into::<pyo3::types::PyType>()?;
    m.add("PlanError", &plan_error)?;
    let _ = PLAN_ERROR.set(py, plan_error.unbind());
    m.add_class::<Engine>()?;
    m.add_class::<Transfer>()?;
    m.add_class::<Lookup>()?;
    Ok(())
}
