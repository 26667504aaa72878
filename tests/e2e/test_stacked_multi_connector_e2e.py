"""DuplexConnector as a child of vLLM's `MultiConnector`, beside another connector (vLLM's
`ExampleConnector`, which saves every prompt's KV to disk and loads it back), on P and D: a
two-turn P/D round pulls P->D and then D->P through MultiConnector, and every answer equals a
single server's. Runs after the modules that share the session's P/D pair (it starts its own)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import E2E_LOOKUP_TIMEOUT_MS
from kvduplex.demo.servers import complete, describe_mismatch
from kvduplex.protocol import prefill_request_params
from test_connector_e2e import (
    BLOCK,
    KV_TRANSFER_CONFIG,
    TURN1_ANSWER,
    TURN1_TOKENS,
    TURN2_ANSWER,
    TURN2_NEW_TOKENS,
    Turn,
    counter,
    token_prompt,
    tokenizer,  # noqa: F401 (a fixture)
)


def multi_connector_config(storage: Path) -> dict:
    # vLLM applies the MultiConnector's failure policy; each child sees only its own entry, so
    # the DuplexConnector entry states it too (the connector refuses to start without it).
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "connectors": [
                KV_TRANSFER_CONFIG,
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(storage)},
                },
            ]
        },
    }


@pytest.mark.e2e
def test_two_turns_through_multi_connector_pull_both_ways_and_match_a_single_server(
    pd_pair, reference_server, tokenizer, tmp_path  # noqa: F811
):
    assert KV_TRANSFER_CONFIG["kv_connector_extra_config"]["lookup_timeout_ms"] == E2E_LOOKUP_TIMEOUT_MS
    pair = pd_pair(multi_connector_config(tmp_path / "example-connector"))
    turn1 = token_prompt(tokenizer, TURN1_TOKENS, seed=91)
    first = Turn(pair, turn1, TURN1_ANSWER, prefill_request_params())
    assert describe_mismatch(complete(reference_server.base_url, turn1, TURN1_ANSWER), first.decode) is None
    assert first.decode_pulled == TURN1_TOKENS
    held = first.decode.kv_transfer_params
    assert held is not None and held["remote_num_tokens"] == TURN1_TOKENS + TURN1_ANSWER - 1

    turn2 = turn1 + first.decode.token_ids + token_prompt(tokenizer, TURN2_NEW_TOKENS, seed=92)
    second = Turn(pair, turn2, TURN2_ANSWER, held)
    assert describe_mismatch(complete(reference_server.base_url, turn2, TURN2_ANSWER), second.decode) is None
    # P pulled D's answer back: what its own cache lacked of D's held turn.
    d_held = TURN1_TOKENS + TURN1_ANSWER - 1
    assert second.prefill_pulled_by_connector == d_held - 2 * BLOCK
    # The connector's own metrics are served by vLLM's MultiConnector as well.
    assert counter(pair.prefill.base_url, "vllm:kvduplex_tokens_pulled_total") >= d_held - 2 * BLOCK
