"""Fixtures for the proxy tests: fake P/D engines served over real HTTP, the proxy itself served by
uvicorn in a thread, a fake clock, and a real redis-server on loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvduplex.protocol import (
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    REMOTE_BLOCK_FINGERPRINTS,
    REMOTE_BLOCK_IDS,
    REMOTE_ENGINE_ID,
    REMOTE_HOST,
    REMOTE_NUM_TOKENS,
    REMOTE_PORT,
    REMOTE_REQUEST_ID,
    TP_SIZE,
)
from kvduplex.proxy.app import DuplexProxy, create_app
from kvduplex.proxy.config import ProxyConfig, parse_upstream
from kvduplex.proxy.routing import conversation_key, rendezvous_score
from kvduplex.proxy.store import ConversationStore

START_TIMEOUT_S = 20.0
# How long a gated fake stream waits for the test to let its next chunk go.
STREAM_GATE_TIMEOUT_S = 5.0


class FakeClock:
    def __init__(self, start: float = 1_000_000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class ServerThread:
    """A uvicorn server for `app` on 127.0.0.1 in its own thread and event loop."""

    def __init__(self, app: Any, port: int = 0):
        # IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that name it (the default
        # event loop; without it a reused connection waits 40 ms on each delayed ACK).
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))
        self.port = self._sock.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
        )
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.running = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def _run(self) -> None:
        self.loop.run_until_complete(self.server.serve(sockets=[self._sock]))

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.005)
        self.running = True
        return self

    def call(self, coroutine: Any) -> Any:
        """Run a coroutine on the server's event loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(START_TIMEOUT_S)

    def request_stop(self) -> None:
        self.server.should_exit = True

    def stop(self) -> None:
        self.request_stop()
        if self.running:
            self.running = False
            self._thread.join(START_TIMEOUT_S)
        self._sock.close()


class FakeEngine:
    """Answers like a vLLM server running a P/D KV connector: with `do_remote_decode` it is a P
    and returns params for D; otherwise it is a D (or a plain server) that generates and, when it
    was handed P's params, returns params naming the blocks it keeps for a readback."""

    def __init__(self, name: str):
        self.name = name
        self.requests: list[dict[str, Any]] = []
        # kv_transfer_params of every answered generation request, in order (None: none).
        self.returned_params: list[dict[str, Any] | None] = []
        self.healthy = True
        # D: return readback params at the end of a decode; in stream chunks too.
        self.return_decode_params = True
        self.stream_params = True
        # Answer generation requests with this (status, JSON-or-text body) instead.
        self.fail_with: tuple[int, Any] | None = None
        # D: drop the connection after this many streamed chunks.
        self.abort_stream_after: int | None = None
        # D: send each streamed chunk after the first only once the test releases the gate
        # (`gate_timeouts` counts chunks that went after waiting in vain).
        self.stream_gate: threading.Semaphore | None = None
        self.gate_timeouts = 0
        # D: every streamed chunk, as sent.
        self.sent_chunks: list[bytes] = []
        # P: answer as vLLM does with `return_token_ids`: this sampled token after a prompt of
        # `sampled_prompt`, all of which it holds for D (a first token the proxy may stream).
        self.sampled_token: int | None = None
        self.sampled_prompt = [11, 12, 13]
        # D: open a chat stream with vLLM's role-only chunk.
        self.role_chunk = False
        # D: end a streamed answer's body this long after its last event (`data: [DONE]`).
        self.stream_end_delay_s = 0.0
        # Hold each generation request's answer until this is set (None: answer at once).
        self.answer_gate: threading.Event | None = None
        self.port = 0
        self._block_ids = itertools.count(1)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def bodies(self, path: str | None = None) -> list[dict[str, Any]]:
        return [r["body"] for r in self.requests if path is None or r["path"] == path]

    def _blocks(self, n: int) -> list[int]:
        return [next(self._block_ids) for _ in range(n)]

    def prefill_params(self, request_id: str) -> dict[str, Any]:
        return {
            DO_REMOTE_PREFILL: True,
            DO_REMOTE_DECODE: False,
            REMOTE_ENGINE_ID: self.name,
            REMOTE_BLOCK_IDS: self._blocks(2),
            REMOTE_HOST: "127.0.0.1",
            REMOTE_PORT: self.port,
            REMOTE_REQUEST_ID: request_id,
            TP_SIZE: 1,
        }

    def decode_params(self, request_id: str) -> dict[str, Any]:
        blocks = self._blocks(3)
        return {
            DO_REMOTE_DECODE: True,
            DO_REMOTE_PREFILL: False,
            REMOTE_ENGINE_ID: self.name,
            REMOTE_BLOCK_IDS: blocks,
            REMOTE_HOST: "127.0.0.1",
            REMOTE_PORT: self.port,
            REMOTE_REQUEST_ID: request_id,
            REMOTE_NUM_TOKENS: 16 * len(blocks),
            TP_SIZE: 1,
            REMOTE_BLOCK_FINGERPRINTS: [f"{self.name}-{b:04x}" for b in blocks],
        }

    def app(self) -> FastAPI:
        app = FastAPI()

        async def generate(request: Request) -> Response:
            body = await request.json()
            self.requests.append(
                {"path": request.url.path, "body": body, "headers": dict(request.headers)}
            )
            if self.answer_gate is not None:
                await asyncio.to_thread(self.answer_gate.wait, STREAM_GATE_TIMEOUT_S)
            if self.fail_with is not None:
                status, payload = self.fail_with
                if isinstance(payload, str):
                    return Response(payload, status_code=status, media_type="text/plain")
                return JSONResponse(payload, status_code=status)
            request_id = f"{self.name}-{len(self.requests)}"
            params = body.get("kv_transfer_params") or {}
            # A chat completion, a text completion, or (None) a /v1/responses one.
            chat = (
                None
                if request.url.path.endswith("/responses")
                else request.url.path.endswith("/chat/completions")
            )
            if params.get(DO_REMOTE_DECODE):
                out_params = self.prefill_params(request_id)
                self.returned_params.append(out_params)
                answer = self._completion(chat, request_id, "x", out_params)
                if self.sampled_token is not None and body.get("return_token_ids"):
                    out_params[REMOTE_NUM_TOKENS] = len(self.sampled_prompt)
                    answer["created"] = 1
                    answer["choices"][0]["token_ids"] = [self.sampled_token]
                    holder = answer if chat else answer["choices"][0]
                    holder["prompt_token_ids"] = self.sampled_prompt
                return JSONResponse(answer)
            out_params = (
                self.decode_params(request_id)
                if params.get(DO_REMOTE_PREFILL) and self.return_decode_params
                else None
            )
            self.returned_params.append(out_params)
            text = [f"{self.name}", " says", f" {len(json.dumps(body))}"]
            if body.get("stream"):
                return StreamingResponse(
                    self._stream(chat, request_id, text, out_params), media_type="text/event-stream"
                )
            return JSONResponse(self._completion(chat, request_id, "".join(text), out_params))

        app.add_api_route("/v1/completions", generate, methods=["POST"])
        app.add_api_route("/v1/chat/completions", generate, methods=["POST"])
        app.add_api_route("/v1/responses", generate, methods=["POST"])

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if self.healthy else 503)

        @app.get("/v1/models")
        async def models() -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

        return app

    @staticmethod
    def _completion(
        chat: bool | None, request_id: str, text: str, params: dict[str, Any] | None
    ) -> dict[str, Any]:
        """`chat`: a chat completion; False: a text completion; None: a /v1/responses one."""
        if chat is None:
            return {
                "id": request_id,
                "object": "response",
                "model": "tiny",
                "status": "completed",
                "output": [{"type": "message", "role": "assistant",
                            "content": [{"type": "output_text", "text": text}]}],
                "kv_transfer_params": params,
            }
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        return {
            "id": request_id,
            "object": "chat.completion" if chat else "text_completion",
            "model": "tiny",
            "choices": [{**choice, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
            "kv_transfer_params": params,
        }

    async def _stream(
        self, chat: bool | None, request_id: str, pieces: list[str],
        params: dict[str, Any] | None,
    ) -> Any:
        for i, chunk in enumerate(self._stream_chunks(chat, request_id, pieces, params)):
            if self.stream_gate is not None and i > 0:
                released = await asyncio.to_thread(
                    self.stream_gate.acquire, True, STREAM_GATE_TIMEOUT_S
                )
                self.gate_timeouts += not released
            self.sent_chunks.append(chunk)
            yield chunk
            await asyncio.sleep(0)
        await asyncio.sleep(self.stream_end_delay_s)

    def _stream_chunks(
        self, chat: bool | None, request_id: str, pieces: list[str],
        params: dict[str, Any] | None,
    ) -> Iterator[bytes]:
        if chat is None:
            # /v1/responses: typed events; the params ride in the final response object.
            for piece in pieces:
                event = {"type": "response.output_text.delta", "delta": piece}
                yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
            final = self._completion(None, request_id, "".join(pieces), params)
            if not self.stream_params:
                final.pop("kv_transfer_params")
            event = {"type": "response.completed", "response": final}
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
            return
        if chat and self.role_chunk:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""},
                    "finish_reason": None}
            event = {"id": request_id, "object": "chat.completion.chunk", "model": "tiny",
                     "choices": [role]}
            yield f"data: {json.dumps(event)}\n\n".encode()
        for i, piece in enumerate(pieces):
            if self.abort_stream_after is not None and i == self.abort_stream_after:
                raise RuntimeError("fake engine dies mid-stream")
            last = i == len(pieces) - 1
            if chat:
                choice: dict[str, Any] = {"index": 0, "delta": {"content": piece}}
            else:
                choice = {"index": 0, "text": piece}
            choice["finish_reason"] = "length" if last else None
            chunk: dict[str, Any] = {
                "id": request_id,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "model": "tiny",
                "choices": [choice],
            }
            if last and self.stream_params:
                chunk["kv_transfer_params"] = params
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"


@dataclasses.dataclass
class ProxyHandle:
    server: ServerThread
    proxy: DuplexProxy
    client: httpx.Client

    @property
    def url(self) -> str:
        return self.server.url

    def check_health(self) -> None:
        self.server.call(self.proxy.check_health())

    def metric(self, name: str, **labels: str) -> float:
        value = self.proxy.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def upstream_by_hash(
        self, body: dict[str, Any], caller: str = "anonymous", role: str = "decode"
    ) -> str:
        """The D (or P) that rendezvous hashing picks for `body` among all of the proxy's."""
        key = conversation_key(caller, body)
        pool = self.proxy.decode if role == "decode" else self.proxy.prefill
        return max(
            (u.address for u in pool.upstreams),
            key=lambda address: rendezvous_score(key, address),
        )

    def prompt_routed_to(
        self, engine: FakeEngine, label: str = "prompt", role: str = "decode"
    ) -> str:
        """A completions prompt (model "tiny", no caller) that the hash routes to `engine`."""
        for i in itertools.count():
            prompt = f"{label} {i}"
            body = {"model": "tiny", "prompt": prompt}
            if self.upstream_by_hash(body, role=role) == engine.address:
                return prompt
        raise AssertionError("unreachable")


class Cluster:
    """Starts fake engines and proxies; stops all of them at teardown."""

    def __init__(self) -> None:
        self._servers: list[ServerThread] = []
        self._clients: list[httpx.Client] = []
        self.engine_servers: dict[str, ServerThread] = {}

    def engine(self, name: str, port: int = 0) -> FakeEngine:
        engine = FakeEngine(name)
        server = ServerThread(engine.app(), port).start()
        engine.port = server.port
        self._servers.append(server)
        self.engine_servers[name] = server
        return engine

    def stop_engine(self, engine: FakeEngine) -> None:
        self.engine_servers[engine.name].stop()

    def restart_engine(self, engine: FakeEngine) -> None:
        server = ServerThread(engine.app(), engine.port).start()
        self._servers.append(server)
        self.engine_servers[engine.name] = server

    def proxy(
        self,
        prefill: list[FakeEngine],
        decode: list[FakeEngine],
        *,
        store: ConversationStore | str | None = None,
        clock: Callable[[], float] = time.monotonic,
        **settings: Any,
    ) -> ProxyHandle:
        """`store`: a store object the test owns, or a store URL for the proxy's config."""
        if isinstance(store, str):
            settings["store"] = store
            store = None
        settings.setdefault("health_interval_s", 0)
        settings.setdefault("routing_headers", True)
        config = ProxyConfig(
            prefill=tuple(parse_upstream(f"127.0.0.1:{e.port}") for e in prefill),
            decode=tuple(parse_upstream(f"127.0.0.1:{e.port}") for e in decode),
            **settings,
        )
        app = create_app(config, store=store, clock=clock)
        server = ServerThread(app).start()
        self._servers.append(server)
        client = httpx.Client(base_url=server.url, trust_env=False, timeout=30)
        self._clients.append(client)
        return ProxyHandle(server, app.state.proxy, client)

    def close(self) -> None:
        for client in self._clients:
            client.close()
        for server in self._servers:
            server.request_stop()
        for server in self._servers:
            server.stop()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A fresh redis-server on a free loopback port, without persistence."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    redis = pytest.importorskip("redis", reason="the `redis` Python package is not installed")
    port = _free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {port}") from None
                time.sleep(0.01)
        client.close()
        yield url
    finally:
        process.terminate()
        process.wait(START_TIMEOUT_S)
