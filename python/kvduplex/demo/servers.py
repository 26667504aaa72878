"""Start and stop local vLLM OpenAI-compatible servers: what `kvduplex demo` needs. The tests and
benchmarks build on it in `kvduplex_testing.servers` (not installed): CPU pinning, several
servers started as one, streamed completions.

`VllmServer` runs ``python -m vllm.entrypoints.openai.api_server`` in its own session (process
group) with the environment a CPU-only, loopback-only machine needs, logs to a file, waits for
``/health`` and on exit stops the whole group, so no EngineCore process outlives it. The server
also gets SIGTERM when the process that started it dies (Linux parent-death signal), so a killed
test run does not leave servers behind. `wait_until_ready` waits for several started servers at
once: startup (~30 s on a CPU) is the slow part, so their waits overlap. `complete` sends the
greedy completion requests that the demo compares with `describe_mismatch`.

Only the standard library and httpx are used.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import httpx

logger = logging.getLogger(__name__)

# What every server gets on a CPU-only test machine (callers' env overrides these):
SERVER_ENV_DEFAULTS = {
    # UCX's tcp transport otherwise also listens on and connects to non-loopback addresses.
    "UCX_NET_DEVICES": "lo",
    # Else the engine's message queue binds another interface's address.
    "VLLM_HOST_IP": "127.0.0.1",
    # Models are local directories; never wait on the hub.
    "HF_HUB_OFFLINE": "1",
    # GiB of KV cache; the CPU default would take a large share of RAM per server.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # Several servers share few cores; binding OMP threads to cores makes them fight.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # A P/D pair on one machine splits its cores, as disaggregation splits accelerators: each
    # server computes on half of them. With every server on every core, two servers' OpenMP
    # threads spin on each other's cores (measured on 2 cores: turn-N P/D TTFT 6x slower).
    "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2)),
}
WHOLE_MACHINE_ENV = {"OMP_NUM_THREADS": str(os.cpu_count() or 1)}
"""For a server that runs alone (the single-server reference a P/D pair is compared with)."""


# How long to wait for a live server to answer `/health` (one that exits is seen at once): four
# started together on a loaded 2-core machine took 102-171 s, and past 180 s once on CI.
DEFAULT_STARTUP_TIMEOUT_S = 900.0
_PROGRESS_EVERY_S = 10.0
_POLL_INTERVAL_S = 0.5
_STOP_GRACE_S = 30.0
# A server still starting up does not act on SIGTERM until its engine is up (seen: not within
# 30 s), and has nothing to shut down gracefully: give it little time before the SIGKILL.
_STOP_GRACE_WHILE_STARTING_S = 5.0
_LOG_TAIL_LINES = 40

# Runs in the child before exec: ask the kernel to SIGTERM us when the parent dies, and exit if it
# already died between fork and prctl. PR_SET_PDEATHSIG (1) survives exec. A separate
# interpreter instead of Popen(preexec_fn=...) because preexec_fn is unsafe when the parent has
# threads.
_EXEC_WITH_PARENT_DEATH_SIGNAL = """
import ctypes, os, signal, sys
parent = int(sys.argv[1])
if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)
if os.getppid() != parent:
    sys.exit("parent exited before the server started")
os.execv(sys.argv[2], sys.argv[2:])
"""


class ServerError(RuntimeError):
    """A server failed to start, died, or did not become healthy in time."""


def free_port(host: str = "127.0.0.1") -> int:
    """Return one TCP port that was free a moment ago.

    Another process can still take it before it is used; callers start servers right away.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def spawn_in_own_session(
    argv: Sequence[str], log: BinaryIO, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start `argv` (its first element a path) in a session (process group) of its own, output
    to `log`, with the parent-death signal: it gets SIGTERM when this process dies."""
    launcher = [sys.executable, "-c", _EXEC_WITH_PARENT_DEATH_SIGNAL, str(os.getpid())]
    return subprocess.Popen(
        [*launcher, *argv],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=None if env is None else dict(env),
        start_new_session=True,
    )


class VllmServer:
    """One vLLM OpenAI-compatible API server process.

    Call `start`, `wait_until_ready` (or the module's, for several at once) and `stop`.
    `extra_args` go to the api_server command line unchanged (e.g.
    ``["--kv-transfer-config", json.dumps(cfg), "--enforce-eager"]``); `env` is laid over the
    current environment and `SERVER_ENV_DEFAULTS`; `python` is the interpreter that runs it.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        name: str = "vllm",
        port: int | None = None,
        host: str = "127.0.0.1",
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        python: str = sys.executable,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.name = name
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.gettempdir())
        self.log_path = log_dir / f"{name}-{self.port}.log"
        self.startup_timeout_s = startup_timeout_s
        self.python = python
        self._process: subprocess.Popen[bytes] | None = None
        # vLLM's ZMQ sockets between its processes, removed with the server (vLLM leaves one
        # socket file per process in the temp directory when its processes are killed).
        self._ipc_dir: str | None = None
        self._started_at = 0.0
        self._ready = False

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def command(self) -> list[str]:
        """The server's command line; `start` runs it, its first element a path."""
        return [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--host",
            self.host,
            "--port",
            str(self.port),
            *self.extra_args,
        ]

    def start(self) -> None:
        """Launch the process and return at once; `wait_until_ready` waits for it.

        Call from a thread that lives as long as the server (normally the main thread): the
        parent-death signal fires when the launching *thread* exits.
        """
        if self._process is not None:
            raise ServerError(f"{self.name} server on :{self.port} was already started")
        # Short: a socket's path (this directory and a 36-character uuid) must fit in 107 bytes.
        self._ipc_dir = tempfile.mkdtemp(prefix="kvd")
        try:
            self._launch()
        except BaseException:
            self._remove_ipc_dir()
            raise
        self._started_at = time.monotonic()
        logger.info(
            "starting %s server on :%d (pid %d, log %s)",
            self.name,
            self.port,
            self.pid,
            self.log_path,
        )

    def _launch(self) -> None:
        ipc = {"VLLM_RPC_BASE_PATH": self._ipc_dir}
        env = {**os.environ, **SERVER_ENV_DEFAULTS, **ipc, **self.env}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = self.command()
        with open(self.log_path, "wb") as log:
            log.write(f"$ {' '.join(command)}\n".encode())
            log.flush()
            self._process = spawn_in_own_session(command, log, env)

    def poll_ready(self) -> bool:
        """One non-blocking readiness check: True once `/health` answers 200.

        Raises `ServerError` (with the log tail) when the process has exited or the startup
        timeout has passed.
        """
        if self._process is None:
            raise ServerError(f"{self.name} server on :{self.port} was not started")
        returncode = self._process.poll()
        if returncode is not None:
            raise ServerError(
                f"{self.name} server on :{self.port} exited with code {returncode} "
                f"during startup\n{self._log_tail_message()}"
            )
        elapsed = time.monotonic() - self._started_at
        try:
            if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                self._ready = True
                return True
        except httpx.HTTPError:
            pass
        if elapsed > self.startup_timeout_s:
            raise ServerError(
                f"{self.name} server on :{self.port} not healthy after "
                f"{self.startup_timeout_s:.0f} s\n{self._log_tail_message()}"
            )
        return False

    def wait_until_ready(self) -> None:
        wait_until_ready([self])

    def stop(self) -> None:
        """SIGTERM the server, then SIGKILL its whole process group. Safe to call twice."""
        process = self._process
        if process is None:
            return
        grace_s = _STOP_GRACE_S if self._ready else _STOP_GRACE_WHILE_STARTING_S
        try:
            if process.poll() is None:
                logger.info("stopping %s server on :%d", self.name, self.port)
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    logger.log(
                        logging.WARNING if self._ready else logging.INFO,
                        "%s server on :%d ignored SIGTERM for %.0f s; killing it",
                        self.name,
                        self.port,
                        grace_s,
                    )
        finally:
            # Also after a clean exit, and when a second Ctrl-C cuts the grace period short: the
            # EngineCore and worker processes share the server's session, and a child whose
            # parent is gone does not stop by itself.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            self._remove_ipc_dir()

    def _remove_ipc_dir(self) -> None:
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(cannot read {self.log_path}: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def _log_tail_message(self) -> str:
        return f"--- last lines of {self.log_path} ---\n{self.log_tail()}"

    def __repr__(self) -> str:
        return f"VllmServer({self.name!r}, {self.base_url}, model={str(self.model_dir)!r})"


def wait_until_ready(
    servers: Sequence[VllmServer],
    say: Callable[[str], None] = logger.info,
    every_s: float = _PROGRESS_EVERY_S,
) -> None:
    """Wait until every started server answers `/health`, telling `say` which became ready and,
    every `every_s` seconds, which are still starting.

    Raises `ServerError` for the first server that dies or times out.
    """
    pending = list(servers)
    started = time.monotonic()
    next_progress = started + every_s
    while pending:
        still = []
        for server in pending:
            if server.poll_ready():
                elapsed = time.monotonic() - started
                say(f"  {server.name} server ready on :{server.port} ({elapsed:.0f} s)")
            else:
                still.append(server)
        pending = still
        if not pending:
            return
        now = time.monotonic()
        if now >= next_progress:
            say(f"  still starting: {', '.join(s.name for s in pending)} ({now - started:.0f} s)")
            next_progress = now + every_s
        time.sleep(_POLL_INTERVAL_S)


# --- talking to a server -------------------------------------------------------------------

def with_nonce(text: str) -> str:
    """`text` behind a random 12-hex-digit nonce.

    vLLM's prefix cache would otherwise serve a repeated prompt from local blocks, and a test
    that means to exercise a KV transfer would silently test the cache instead. The nonce
    changes the first block's hash and, through the hash chain, every later block's.
    """
    return f"{secrets.token_hex(6)} {text}"


@dataclass(frozen=True)
class Completion:
    """The parts of a `/v1/completions` answer that tests and benchmarks compare."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    # Logprob of each generated token, and the top-k alternatives by token id.
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str | None
    kv_transfer_params: dict[str, Any] | None
    # Client-side round trip, for reporting only.
    elapsed_s: float


def completion_body(
    prompt: str | Sequence[int] | Sequence[Sequence[int]],
    max_tokens: int,
    logprobs: int,
    kv_transfer_params: Mapping[str, Any] | None,
    seed: int,
    cache_salt: str | None,
) -> dict[str, Any]:
    """The greedy `/v1/completions` body `complete` sends; several token-id prompts make one
    request of several."""
    body: dict[str, Any] = {
        "prompt": prompt if isinstance(prompt, str) else list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": seed,
        "ignore_eos": True,
        "logprobs": logprobs,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


def complete(
    base_url: str,
    prompt: str | Sequence[int],
    max_tokens: int,
    logprobs: int = 5,
    kv_transfer_params: Mapping[str, Any] | None = None,
    *,
    seed: int = 0,
    timeout_s: float = 300.0,
    headers: Mapping[str, str] | None = None,
    cache_salt: str | None = None,
) -> Completion:
    """Greedy `/v1/completions` request (temperature 0, fixed seed, EOS ignored).

    `prompt` is text or token ids. EOS is ignored so every request yields exactly `max_tokens`
    tokens, whatever a random-weight model happens to emit. `headers` go with the request (e.g. a
    proxy's conversation id). Raises `ServerError` with the server's message on a non-200 answer.
    """
    body = completion_body(prompt, max_tokens, logprobs, kv_transfer_params, seed, cache_salt)
    started = time.perf_counter()
    response = httpx.post(
        f"{base_url}/v1/completions", json=body, headers=dict(headers or {}), timeout=timeout_s
    )
    elapsed_s = time.perf_counter() - started
    if response.status_code != 200:
        raise ServerError(
            f"POST {base_url}/v1/completions answered {response.status_code}: {response.text}"
        )
    answer = response.json()
    choice = answer["choices"][0]
    choice_logprobs = choice.get("logprobs") or {}
    return Completion(
        text=choice["text"],
        token_ids=list(choice.get("token_ids") or []),
        prompt_token_ids=list(choice.get("prompt_token_ids") or []),
        logprobs=[float(lp) for lp in choice_logprobs.get("token_logprobs") or []],
        top_logprobs=[
            {parse_token_id(token): float(lp) for token, lp in (alternatives or {}).items()}
            for alternatives in choice_logprobs.get("top_logprobs") or []
        ],
        finish_reason=choice.get("finish_reason"),
        kv_transfer_params=answer.get("kv_transfer_params"),
        elapsed_s=elapsed_s,
    )


def parse_token_id(token: str) -> int:
    # With return_tokens_as_token_ids vLLM names tokens "token_id:<id>".
    prefix, _, token_id = token.partition(":")
    if prefix != "token_id" or not token_id.isdigit():
        raise ServerError(f"expected a 'token_id:<id>' logprob key, got {token!r}")
    return int(token_id)


def describe_mismatch(
    expected: Completion, actual: Completion, logprob_atol: float = 1e-3
) -> str | None:
    """None when `actual` has the same tokens as `expected` and logprobs within `logprob_atol`;
    otherwise a one-line description of the first difference.

    Compare logprobs, not only tokens: a random-weight model repeats tokens, so KV that is
    wrong can still produce the right ids, but it moves logprobs by tenths of a nat or more.
    """
    if expected.prompt_token_ids != actual.prompt_token_ids:
        return "prompt token ids differ"
    if len(expected.token_ids) != len(actual.token_ids):
        return f"{len(actual.token_ids)} tokens instead of {len(expected.token_ids)}"
    for position, (want, got) in enumerate(zip(expected.token_ids, actual.token_ids, strict=True)):
        if want != got:
            return f"token {position}: {got} instead of {want}"
    for position, (want, got) in enumerate(zip(expected.logprobs, actual.logprobs, strict=True)):
        if abs(want - got) > logprob_atol:
            return f"token {position}: logprob {got:.6f} instead of {want:.6f}"
    return None
