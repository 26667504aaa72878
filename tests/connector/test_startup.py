"""What DuplexConnector checks and derives as it starts, on vLLM's real config objects: the
compatibility fingerprint peers compare at the handshake."""

from __future__ import annotations

import pytest
from duplex_harness import make_kv_cache_config, make_kv_caches, make_vllm_config

from kvduplex.connector.groups import TransferGroups
from kvduplex.connector.worker import compatibility_fingerprint, describe_kv_caches


def _fingerprint(vllm_config) -> dict[str, str]:
    kv_caches = make_kv_caches(8)
    groups = TransferGroups.from_kv_cache_config(make_kv_cache_config(8))
    return compatibility_fingerprint(
        vllm_config, kv_caches, describe_kv_caches(kv_caches, 8), groups, tp_rank=0
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
