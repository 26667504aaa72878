"""Every test session's engines and servers keep their per-user state (the side-channel secret,
this host's fleet directory: `connector/fleet.py`) in a directory of the session's own, so that
they never join a fleet the user runs on this host, nor one a session before left behind."""

from __future__ import annotations

import os
import shutil
import tempfile

_RUNTIME_DIR = tempfile.mkdtemp(prefix="kvduplex-tests-")
os.environ["XDG_RUNTIME_DIR"] = _RUNTIME_DIR


def pytest_unconfigure(config) -> None:  # noqa: ARG001 - pytest's hook signature
    shutil.rmtree(_RUNTIME_DIR, ignore_errors=True)
