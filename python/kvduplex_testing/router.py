"""vLLM's production router (`vllm-router` from PyPI, Rust) in front of P/D servers, for the
tests and benchmarks that run a fleet behind it (`--vllm-pd-disaggregation`).

Not installed with the wheel: the Makefile's deps install `vllm-router` into the test venv.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from kvduplex.demo.servers import ServerError, free_port, spawn_in_own_session

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 60.0
_STOP_GRACE_S = 10.0


class VllmRouter:
    """One `vllm-router --vllm-pd-disaggregation` process over running P and D servers (HTTP
    base URLs), with `policy` for both (`round_robin`, `cache_aware`, ...) and `extra_args`
    after it. A context manager: started, ready (`/health` answers 200, which the router serves
    only once every worker answered its health check), stopped on exit. Its log is
    `log_dir/<name>.log`."""

    def __init__(
        self,
        prefills: Sequence[str],
        decodes: Sequence[str],
        policy: str,
        log_dir: Path,
        *,
        name: str = "vllm-router",
        extra_args: Sequence[str] = (),
    ) -> None:
        self.port = free_port()
        self.name = name
        self.log_path = Path(log_dir) / f"{name}.log"
        self.argv = [
            sys.executable, "-m", "vllm_router.launch_router",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--vllm-pd-disaggregation",
            *(arg for url in prefills for arg in ("--prefill", url)),
            *(arg for url in decodes for arg in ("--decode", url)),
            "--policy", policy,
            # A worker is healthy already; the router's default check interval is 30 s.
            "--worker-startup-check-interval", "1",
            "--log-level", "warning",
            *extra_args,
        ]
        self._process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> VllmRouter:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            self._process = spawn_in_own_session(self.argv, log)
        try:
            self._wait_until_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_until_ready(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if self._process.poll() is not None:
                raise ServerError(f"{self.name} exited with {self._process.returncode}\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    logger.info("%s ready on :%d", self.name, self.port)
                    return
            if time.monotonic() > deadline:
                raise ServerError(f"{self.name} not ready after {STARTUP_TIMEOUT_S:.0f} s\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __exit__(self, *exc_info: object) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        try:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=_STOP_GRACE_S)
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
