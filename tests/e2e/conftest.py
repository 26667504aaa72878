"""Session-wide pieces for end-to-end tests against real vLLM servers on the CPU.

Fixtures:
- `tiny_model_dir`: the tiny Llama (built once, then reused from pytest's cache directory, or
  from $KVDUPLEX_TINY_MODEL_DIR when set).
- `reference_server`: a plain vLLM server (no connector) whose answers are the expected ones.
- `pd_pair`: a factory that starts a prefill/decode pair for a `--kv-transfer-config`.

A vLLM server here takes ~30-50 s to start and ~3 GB of memory, so everything is session-scoped
and at most one P/D pair is alive at a time (reference + 2); a module that needs more servers
starts them for itself (test_router_e2e: a second P and D beside the pair, 5 in all).

Request helpers live in `kvduplex.demo.servers` (`complete`, `with_nonce`, `describe_mismatch`) and
are re-exported here. Mark tests that use these fixtures with `@pytest.mark.e2e`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvduplex.demo.servers import Completion, complete, describe_mismatch, with_nonce
from kvduplex.demo.tiny_model import SERVER_ARGS, build_tiny_model, sample_text
from kvduplex_testing.servers import ServerPair, VllmServer

__all__ = ["Completion", "complete", "describe_mismatch", "with_nonce", "sample_text"]

logger = logging.getLogger(__name__)

PdPairFactory = Callable[..., ServerPair]

# Lookups answer in ~1 ms on loopback, but this suite runs four vLLM servers on two cores, where
# a side-channel round trip was seen to take ~300 ms once; the tests check reuse, not timing,
# so they give lookups more time than the 250 ms default.
E2E_LOOKUP_TIMEOUT_MS = 3000
# There an engine's side channel went silent for 3 s once (CI, four servers of the chat suite):
# its peer took it for dead at the default heartbeat (1 s, 3 missed) and a lookup found nothing.
# Liveness gets 6 s; a killed server is still seen at once (its connections close).
E2E_PEER_HEARTBEAT_S = 2.0
# Every pair's servers run in vLLM's dev mode (`/reset_prefix_cache` and friends, which
# test_reset_e2e calls), so that test shares the pair the other modules of its config use.
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "e2e: starts real vLLM servers (slow; deselect with -m 'not e2e')"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """test_router_e2e runs right after test_reset_e2e, not after test_retention_e2e (name
    order): it shares the session pair of test_connector_e2e's config, which the modules up to
    test_reset_e2e use and test_retention_e2e replaces with its own (a restart saved)."""
    late = [item for item in items if item.path.name == "test_router_e2e.py"]
    rest = [item for item in items if item.path.name != "test_router_e2e.py"]
    after = [n for n, item in enumerate(rest) if item.path.name == "test_reset_e2e.py"]
    if late and after:
        items[:] = rest[: after[-1] + 1] + late + rest[after[-1] + 1 :]


def warm_up(server: VllmServer) -> None:
    """Send one plain request so the server's one-time first-request cost (~20 s on a busy
    2-core machine) is paid here and not inside whatever a test measures or waits for."""
    completion = complete(server.base_url, with_nonce("warm up"), max_tokens=2)
    logger.info("%s server warmed up in %.1f s", server.name, completion.elapsed_s)


@pytest.fixture(scope="session")
def tiny_model_dir(pytestconfig: pytest.Config) -> Path:
    configured = os.environ.get("KVDUPLEX_TINY_MODEL_DIR")
    out_dir = Path(configured) if configured else pytestconfig.cache.mkdir("kvduplex-tiny-model")
    return build_tiny_model(out_dir)


@pytest.fixture(scope="session")
def server_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def reference_server(tiny_model_dir: Path, server_log_dir: Path) -> Iterator[VllmServer]:
    with VllmServer(
        tiny_model_dir, name="reference", extra_args=SERVER_ARGS, log_dir=server_log_dir
    ) as server:
        warm_up(server)
        yield server


@pytest.fixture(scope="session")
def pd_pair(tiny_model_dir: Path, server_log_dir: Path) -> Iterator[PdPairFactory]:
    """Factory: ``pd_pair(kv_transfer_config, ...) -> ServerPair`` (started and warmed up).

    Keyword arguments: `decode_kv_transfer_config` (defaults to the same config),
    `prefill_env` / `decode_env` (e.g. side-channel ports) and `extra_args` for both servers.
    The same arguments return the running pair; different ones stop the previous pair first,
    so choose ports that go into the env (e.g. side channels) once per session, not per call.
    `pd_pair.stop()` stops the running pair (a module that starts servers of its own first
    makes room). All pairs stop at the end of the session.
    """
    current: dict[str, Any] = {"key": None, "pair": None}

    def stop() -> None:
        if current["pair"] is not None:
            current["pair"].__exit__(None, None, None)
            current.update(key=None, pair=None)

    def start(
        kv_transfer_config: Mapping[str, Any],
        *,
        decode_kv_transfer_config: Mapping[str, Any] | None = None,
        prefill_env: Mapping[str, str] | None = None,
        decode_env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
    ) -> ServerPair:
        decode_config = (
            decode_kv_transfer_config
            if decode_kv_transfer_config is not None
            else kv_transfer_config
        )
        key = json.dumps(
            [kv_transfer_config, decode_config, prefill_env, decode_env, list(extra_args)],
            sort_keys=True,
        )
        if current["key"] == key:
            return current["pair"]
        stop()

        def server(name: str, config: Mapping[str, Any], env: Mapping[str, str] | None):
            return VllmServer(
                tiny_model_dir,
                name=name,
                extra_args=[*SERVER_ARGS, *extra_args, "--kv-transfer-config", json.dumps(config)],
                env={**DEV_MODE, **(env or {})},
                log_dir=server_log_dir,
            )

        pair = ServerPair(
            prefill=server("prefill", kv_transfer_config, prefill_env),
            decode=server("decode", decode_config, decode_env),
        )
        pair.__enter__()
        try:
            warm_up(pair.prefill)
            warm_up(pair.decode)
        except BaseException:
            pair.__exit__(None, None, None)
            raise
        current.update(key=key, pair=pair)
        return pair

    start.stop = stop  # type: ignore[attr-defined]
    yield start
    stop()
