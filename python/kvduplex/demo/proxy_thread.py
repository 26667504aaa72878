"""The kvduplex proxy in this process, in front of the demo's servers (and the benchmarks' and
end-to-end tests')."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence
from typing import Any


class ProxyThread:
    """The kvduplex proxy served by uvicorn on 127.0.0.1 in a background thread.

    The listening socket is bound before the thread starts, so the port is known and cannot be
    taken by someone else in between.
    """

    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        *,
        start_timeout_s: float = 30,
        **settings: Any,
    ) -> None:
        """`settings`: other ProxyConfig settings (e.g. `prefill_affinity_slack`)."""
        import uvicorn

        from ..proxy.app import create_app
        from ..proxy.config import ProxyConfig, parse_upstream

        # On a busy 2-core machine a vLLM server's /health can take seconds; with the default
        # 2 s the proxy would take the only D out of rotation and a turn would recompute.
        settings.setdefault("health_timeout_s", 10.0)
        config = ProxyConfig(
            prefill=tuple(parse_upstream(url) for url in prefill_urls),
            decode=tuple(parse_upstream(url) for url in decode_urls),
            **settings,
        )
        # IPPROTO_TCP: an event loop sets TCP_NODELAY on the connections of a socket that names
        # it (a reused connection otherwise waits for a delayed ACK between header and body).
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        app = create_app(config)
        # The proxy itself, for its metrics (`proxy.metrics.registry`).
        self.proxy = app.state.proxy
        self._server = uvicorn.Server(
            uvicorn.Config(
                app,
                log_level="warning",
                access_log=False,
                timeout_graceful_shutdown=5,
            )
        )
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            name="kvduplex-proxy",
            daemon=True,
        )
        self._start_timeout_s = start_timeout_s

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ProxyThread:
        self._thread.start()
        deadline = time.monotonic() + self._start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the kvduplex proxy did not start on :{self.port}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._socket.close()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

