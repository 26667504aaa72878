"""The tests' and benchmarks' additions to `kvduplex.demo.servers`: `VllmServer` pinned to CPUs
and used as a context manager, several servers started as one, CPU sets and ports for pinned
P/D pairs, streamed completions and prompt-token counters.

Not installed with the wheel (only the `kvduplex` package is): import it from a source checkout
(`make test` installs the checkout in development mode; otherwise put `python/` on PYTHONPATH).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import sys
import time
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Collection,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from kvduplex.demo import sample_sums
from kvduplex.demo import servers as demo_servers
from kvduplex.demo.servers import (
    Completion,
    ServerError,
    completion_body,
    parse_token_id,
    wait_until_ready,
)

# Sets the CPUs (comma-separated) a process and the children it starts may run on, then execs the
# rest of its command line.
_EXEC_PINNED = (
    "import os, sys; os.sched_setaffinity(0, map(int, sys.argv[1].split(','))); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)


class VllmServer(demo_servers.VllmServer):
    """The demo's `VllmServer`, also a context manager (start, wait until healthy, stop on exit),
    and pinned to `cpus` when given.

    `cpus` pins the server (its API, engine and worker processes) to those CPUs, on as many
    OpenMP threads unless `env` says otherwise; by default it may run on any. vLLM keeps the
    pinning only with `VLLM_CPU_OMP_THREADS_BIND=nobind` (the servers' default); vLLM's
    NixlConnector re-pins its CPU worker to the last CPU of each NUMA node whatever it inherited.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        cpus: Collection[int] | None = None,
        env: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        self.cpus = sorted(cpus) if cpus is not None else None
        if self.cpus is not None and not self.cpus:
            raise ValueError(f"{kwargs.get('name', 'vllm')} server: an empty CPU set")
        pinned_threads = {"OMP_NUM_THREADS": str(len(self.cpus))} if self.cpus else {}
        super().__init__(model_dir, env={**pinned_threads, **(env or {})}, **kwargs)

    def command(self) -> list[str]:
        server = super().command()
        if self.cpus is None:
            return server
        return [sys.executable, "-c", _EXEC_PINNED, ",".join(map(str, self.cpus)), *server]

    def __enter__(self) -> VllmServer:
        try:
            self.start()
            self.wait_until_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Return `count` distinct TCP ports that were free a moment ago.

    All sockets stay bound until every port is chosen, so the ports differ from one another.
    Another process can still take one before it is used; callers start servers right away.
    """
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def node_cpu_sets(nodes: int = 2) -> list[frozenset[int]]:
    """This process's CPUs split into `nodes` equal disjoint sets, in CPU number order.

    A benchmark that pins each server of a P/D pair to its own set (`VllmServer(cpus=...)`)
    models nodes that do not share hardware, as disaggregation means. CPUs left over by an
    uneven split go to no set. The split is by CPU number: where SMT siblings are numbered
    apart (N and N + cores), two sets share physical cores. Raises `ValueError` when there are
    fewer CPUs than nodes.
    """
    available = sorted(os.sched_getaffinity(0))
    if len(available) < nodes:
        raise ValueError(
            f"{nodes} nodes need at least {nodes} CPUs; this process may use {len(available)}"
        )
    size = len(available) // nodes
    return [frozenset(available[i * size : (i + 1) * size]) for i in range(nodes)]


def ports_outside_ephemeral_range(count: int) -> list[int]:
    """Free ports for servers that bind them only once started, a minute later.

    Ports from the kernel's ephemeral range (what binding port 0 returns) can be taken by any
    outgoing connection in the meantime; that made a NIXL side channel fail with "Address already
    in use". Falls back to ephemeral ports where the range is unknown.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return free_ports(count)
    candidates = list(range(max(1024, low - 10000), low))
    random.SystemRandom().shuffle(candidates)
    ports: list[int] = []
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise ServerError(f"no {count} free ports below the ephemeral range starting at {low}")


@contextlib.contextmanager
def start_many(
    servers: Sequence[demo_servers.VllmServer],
) -> Iterator[list[demo_servers.VllmServer]]:
    """Start all `servers` at once, wait until all are healthy, stop all on exit.

    If any fails to start, the others are stopped before the error propagates.
    """
    servers = list(servers)
    try:
        for server in servers:
            server.start()
        wait_until_ready(servers)
        yield servers
    finally:
        for server in reversed(servers):
            server.stop()


@dataclass
class ServerPair:
    """A prefill and a decode server for disaggregated serving, started together."""

    prefill: VllmServer
    decode: VllmServer

    def __post_init__(self) -> None:
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> ServerPair:
        self._stack.enter_context(start_many([self.prefill, self.decode]))
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()


def server_cpu_seconds(pid: int) -> float:
    """User and system CPU time of a server's processes so far (API server, engine, workers, and
    the exited children they reaped). Raises `psutil.NoSuchProcess` when the server is gone; a
    child that ends between two readings takes its time out with it, unless its parent reaped it.
    """
    root = psutil.Process(pid)
    total = 0.0
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def prompt_tokens_by_source(base_url: str) -> dict[str, float]:
    """Prompt tokens the server has processed so far, by source, from its Prometheus `/metrics`.

    Sources are vLLM's: "local_compute", "local_cache_hit" and "external_kv_transfer". The
    difference of two readings around a request shows whether its prompt KV was computed,
    found in the prefix cache or pulled from another engine.
    """
    return sample_sums(base_url, "vllm:prompt_tokens_by_source_total", "source")


_SSE_DONE = "[DONE]"


def parse_sse_line(line: str, url: str) -> dict[str, Any] | str | None:
    """The JSON event of one server-sent-event line from `url` (an OpenAI-style stream): the
    string "[DONE]" for its closing ``data: [DONE]``, None for a line that carries no data
    (blank separators, comments, other SSE fields). Raises `ServerError` on an error event."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    if data == _SSE_DONE:
        return _SSE_DONE
    event = json.loads(data)
    if "error" in event:
        raise ServerError(f"POST {url} streamed an error: {event['error']}")
    return event


def sse_events(lines: Iterable[str], url: str) -> Iterator[dict[str, Any]]:
    """The JSON events of an OpenAI-style server-sent-event stream from `url`, up to its closing
    ``data: [DONE]`` (`parse_sse_line`). Raises `ServerError` on an error event, and when the
    lines end before [DONE]."""
    for line in lines:
        event = parse_sse_line(line, url)
        if event == _SSE_DONE:
            return
        if event is not None:
            yield event
    raise ServerError(f"POST {url}: the stream ended without [DONE]")


async def async_sse_events(lines: AsyncIterable[str], url: str) -> AsyncIterator[dict[str, Any]]:
    """`sse_events` of an asyncio stream (e.g. httpx's `aiter_lines`)."""
    async for line in lines:
        event = parse_sse_line(line, url)
        if event == _SSE_DONE:
            return
        if event is not None:
            yield event
    raise ServerError(f"POST {url}: the stream ended without [DONE]")


@dataclass(frozen=True)
class StreamedCompletion(Completion):
    """A `Completion` that came as a server-sent-event stream, with its client-side TTFT."""

    # From sending the request to the first chunk that carries a generated token.
    ttft_s: float | None = None
    chunks: int = 0


def complete_streamed(
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
) -> StreamedCompletion:
    """`complete`'s request with ``"stream": true``: the answer is read chunk by chunk.

    Same body as `complete` (temperature 0, fixed seed, EOS ignored, logprobs, token ids), so
    `describe_mismatch` compares a streamed answer with a non-streamed one. Token ids are the
    chunks' ``token_ids`` where the server sends them, else those of the "token_id:<id>" logprob
    tokens (both must agree when both are there). `ttft_s` is measured on the client: request
    sent to first chunk with a generated token. Raises `ServerError` on a non-200 answer or an
    error event in the stream.
    """
    body = completion_body(prompt, max_tokens, logprobs, kv_transfer_params, seed, cache_salt)
    body["stream"] = True
    text_parts: list[str] = []
    token_ids: list[int] = []
    logprob_tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[int, float]] = []
    prompt_token_ids: list[int] = []
    finish_reason: str | None = None
    answer_kv_params: dict[str, Any] | None = None
    ttft_s: float | None = None
    chunks = 0
    url = f"{base_url}/v1/completions"
    started = time.perf_counter()
    with httpx.stream(
        "POST", url, json=body, headers=dict(headers or {}), timeout=timeout_s
    ) as response:
        if response.status_code != 200:
            response.read()
            raise ServerError(f"POST {url} answered {response.status_code}: {response.text}")
        for event in sse_events(response.iter_lines(), url):
            chunks += 1
            if event.get("kv_transfer_params") is not None:
                answer_kv_params = event["kv_transfer_params"]
            for choice in event.get("choices") or []:
                if choice.get("index", 0) != 0:
                    continue
                if choice.get("prompt_token_ids"):
                    prompt_token_ids = list(choice["prompt_token_ids"])
                delta_ids = list(choice.get("token_ids") or [])
                delta_logprobs = choice.get("logprobs") or {}
                delta_tokens = list(delta_logprobs.get("tokens") or [])
                if ttft_s is None and (choice.get("text") or delta_ids or delta_tokens):
                    ttft_s = time.perf_counter() - started
                text_parts.append(choice.get("text") or "")
                token_ids.extend(delta_ids)
                logprob_tokens.extend(delta_tokens)
                token_logprobs.extend(
                    float(lp) for lp in delta_logprobs.get("token_logprobs") or []
                )
                top_logprobs.extend(
                    {parse_token_id(token): float(lp) for token, lp in (alternatives or {}).items()}
                    for alternatives in delta_logprobs.get("top_logprobs") or []
                )
                if choice.get("finish_reason") is not None:
                    finish_reason = choice["finish_reason"]
    elapsed_s = time.perf_counter() - started
    ids_from_logprobs = [parse_token_id(token) for token in logprob_tokens]
    if token_ids and ids_from_logprobs and token_ids != ids_from_logprobs:
        raise ServerError(
            f"POST {url}: streamed token_ids {token_ids[:8]}... differ from the logprob "
            f"tokens {ids_from_logprobs[:8]}..."
        )
    return StreamedCompletion(
        text="".join(text_parts),
        token_ids=token_ids or ids_from_logprobs,
        prompt_token_ids=prompt_token_ids,
        logprobs=token_logprobs,
        top_logprobs=top_logprobs,
        finish_reason=finish_reason,
        kv_transfer_params=answer_kv_params,
        elapsed_s=elapsed_s,
        ttft_s=ttft_s,
        chunks=chunks,
    )
