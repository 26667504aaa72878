"""Each default, key and name has one owner that everything else imports: code without vLLM can
import the connector's settings, and the command line's defaults are the config classes'."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import uvicorn

import kvduplex.proxy.app
from kvduplex import cli
from kvduplex.connector import config as connector_config
from kvduplex.proxy.config import ProxyConfig, parse_upstream_list


def test_the_connector_settings_and_the_demo_import_without_vllm():
    """vLLM loads `DuplexConnector` by attribute, so importing `kvduplex.connector` (and what
    imports its defaults: the demo, the CLI) must not import vLLM or torch."""
    code = (
        "import sys\n"
        "import kvduplex.cli, kvduplex.connector, kvduplex.connector.config, kvduplex.demo\n"
        "import kvduplex.protocol, kvduplex.proxy\n"
        "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_connector_class_is_there_when_asked_for():
    import kvduplex.connector

    assert kvduplex.connector.DuplexConnector.__name__ == "DuplexConnector"


def test_proxy_command_defaults_are_proxy_config_defaults(monkeypatch):
    built: list[ProxyConfig] = []
    monkeypatch.setattr(kvduplex.proxy.app, "create_app", built.append)
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: None)
    assert cli.main(["proxy", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"]) == 0
    expected = ProxyConfig(
        prefill=parse_upstream_list("127.0.0.1:1", "prefill"),
        decode=parse_upstream_list("127.0.0.1:2", "decode"),
    )
    assert built == [expected]


def test_proxy_command_takes_its_prefill_affinity_slack_or_off(monkeypatch, capsys):
    built: list[ProxyConfig] = []
    monkeypatch.setattr(kvduplex.proxy.app, "create_app", built.append)
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: None)
    upstreams = ["--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"]
    for value, expected in (("5", 5), ("off", None)):
        assert cli.main(["proxy", *upstreams, "--prefill-affinity-slack", value]) == 0
        assert built.pop().prefill_affinity_slack == expected
    for bad in ("-1", "some"):
        with pytest.raises(SystemExit) as exited:
            cli.main(["proxy", *upstreams, "--prefill-affinity-slack", bad])
        assert exited.value.code == 2
        assert "prefill" in capsys.readouterr().err and not built


def test_demo_command_default_threshold_is_the_connectors():
    parser = cli.build_parser()
    args = parser.parse_args(["demo"])
    assert args.recompute_threshold == connector_config.DEFAULT_RECOMPUTE_THRESHOLD
