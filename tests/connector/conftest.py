"""Fixtures for the connector's unit tests; the harness itself is in duplex_harness.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash

from duplex_harness import TINY_LLAMA, Engine, make_engine


@pytest.fixture(scope="session")
def tiny_config_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = tmp_path_factory.mktemp("tiny-llama-config")
    (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
    init_none_hash(sha256)
    return model_dir


@pytest.fixture
def engines(tiny_config_dir: Path):
    """Factory: engines(name, extra_config=..., num_blocks=..., sliding_window=...) -> Engine."""

    def build(name: str, extra_config: dict[str, Any] | None = None, **kwargs: Any) -> Engine:
        return make_engine(tiny_config_dir, name, extra_config, **kwargs)

    return build


class ConnectorLog:
    """The connector's own log records (loggers under `vllm.kvduplex`)."""

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        self._caplog = caplog

    @property
    def records(self) -> list[logging.LogRecord]:
        return [r for r in self._caplog.records if r.name.startswith("vllm.kvduplex")]

    def messages(self, level: str = "WARNING") -> list[str]:
        return [r.getMessage() for r in self.records if r.levelname == level]

    @property
    def text(self) -> str:
        return "\n".join(r.getMessage() for r in self.records)


@pytest.fixture
def connector_log(caplog: pytest.LogCaptureFixture):
    # vLLM's logging config may stop its loggers from propagating to pytest's root handler.
    logger = logging.getLogger("vllm.kvduplex")
    attach = not logging.getLogger("vllm").propagate
    caplog.set_level(logging.DEBUG, logger="vllm.kvduplex")
    if attach:
        logger.addHandler(caplog.handler)
    try:
        yield ConnectorLog(caplog)
    finally:
        if attach:
            logger.removeHandler(caplog.handler)
