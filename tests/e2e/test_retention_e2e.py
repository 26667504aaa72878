"""Held blocks under real memory pressure, and holds that end while an engine is idle.

A P/D pair of its own, with a KV cache of 18 blocks of 128 tokens (17 usable) on each server
and 4 s leases on P's prompts. Stops the session's shared pair first (one pair at a time).
"""

from __future__ import annotations

import logging
import time

import httpx
import pytest

from conftest import E2E_LOOKUP_TIMEOUT_MS
from kvduplex import protocol
from kvduplex.demo import duplex_kv_transfer_config
from kvduplex.demo.servers import complete, completion_body, describe_mismatch
from kvduplex.protocol import prefill_request_params
from kvduplex_testing.servers import ServerPair, prompt_tokens_by_source, server_cpu_seconds
from test_connector_e2e import (  # noqa: F401
    BLOCK,
    counter,
    token_prompt,
    tokenizer,
    wait_for_counter,
)
from test_lookup_e2e import relay_streamed

logger = logging.getLogger(__name__)

NUM_BLOCKS = 18
P_LEASE_S = 4.0
RETENTION_CONFIG = duplex_kv_transfer_config(bidirectional=True, recompute_threshold=64)
RETENTION_CONFIG["kv_connector_extra_config"].update(
    lookup_timeout_ms=E2E_LOOKUP_TIMEOUT_MS,
    kv_lease_ttl_s=P_LEASE_S,
    # Held turns may take the whole cache: only pressure evicts them here.
    decode_kv_hold_max_fraction=1.0,
)


@pytest.fixture(scope="module")
def pair(pd_pair) -> ServerPair:
    return pd_pair(RETENTION_CONFIG, extra_args=["--num-gpu-blocks-override", str(NUM_BLOCKS)])


@pytest.mark.e2e
def test_an_idle_engine_frees_an_expired_hold_within_a_second(pair, tokenizer):  # noqa: F811
    """P holds a prompt for a decode node that never reads it; nothing else runs. The hold's
    blocks are free within a second of its lease's end."""
    base = pair.prefill.base_url
    prompt = token_prompt(tokenizer, 2 * BLOCK + 100, seed=41)
    prefill = complete(base, prompt, max_tokens=1, kv_transfer_params=prefill_request_params())
    expiry = prefill.kv_transfer_params[protocol.REMOTE_LEASE_EXPIRY]
    assert expiry - time.time() > 1.0, "the lease is still running"
    assert counter(base, "vllm:kv_cache_usage_perc") > 0
    freed_at = None
    while time.time() < expiry + 5.0:
        usage = counter(base, "vllm:kv_cache_usage_perc")
        if usage == 0:
            freed_at = time.time()
            break
        time.sleep(0.05)
    assert freed_at is not None, "the expired hold was never freed while P was idle"
    logger.info("P's idle hold freed %.3f s after its lease ended", freed_at - expiry)
    # Never before the lease ended (the lease is the owner's promise to its reader).
    assert expiry - 0.1 <= freed_at <= expiry + 1.0
    assert wait_for_counter(base, "vllm:kvduplex_held_blocks", lambda n: n == 0) == 0


@pytest.mark.e2e
def test_a_burst_evicts_the_held_turn_before_any_preemption_and_its_lookup_misses(
    pair,
    reference_server,
    tokenizer,  # noqa: F811
):
    """D holds one turn (4 of its 17 blocks); 3 decodes then grow to 5 blocks each. D gives
    the turn up instead of preempting; the conversation's next turn finds nothing on D,
    computes, and answers as one server does."""
    d, p = pair.decode.base_url, pair.prefill.base_url
    turn1 = token_prompt(tokenizer, 2 * BLOCK + 100, seed=42)
    first, _ = relay_streamed(pair, turn1, 100)
    assert wait_for_counter(d, "vllm:kvduplex_held_blocks", lambda n: n == 4) == 4
    preemptions = counter(d, "vllm:num_preemptions_total")
    evictions = counter(d, "vllm:kvduplex_pressure_evictions_total")

    # One request of three prompts: the engine admits them together, so they reach their
    # fifth block in the same few steps (three requests from threads could start far enough
    # apart on a loaded host for the first to finish before the last needs its fifth block).
    prompts = [token_prompt(tokenizer, 200, seed=50 + i) for i in range(3)]
    body = completion_body(prompts, 400, 0, None, seed=0, cache_salt=None)
    burst = httpx.post(f"{d}/v1/completions", json=body, timeout=300.0)
    assert burst.status_code == 200, burst.text
    assert [len(c["token_ids"]) for c in burst.json()["choices"]] == [400] * 3
    assert counter(d, "vllm:num_preemptions_total") == preemptions
    evicted = wait_for_counter(
        d, "vllm:kvduplex_pressure_evictions_total", lambda n: n - evictions >= 1
    )
    assert evicted - evictions >= 1
    assert wait_for_counter(d, "vllm:kvduplex_held_blocks", lambda n: n == 0) == 0

    # A miss: asked and found nothing, or (P's copy of what D announced being recent enough)
    # ruled out without asking.
    misses = ("vllm:kvduplex_lookups_missed_total", "vllm:kvduplex_lookups_ruled_out_total")
    missed = sum(counter(p, name) for name in misses)
    turn2 = turn1 + first.token_ids + token_prompt(tokenizer, 60, seed=43)
    before = prompt_tokens_by_source(p)
    second, _ = relay_streamed(pair, turn2, 8)
    after = prompt_tokens_by_source(p)
    assert after.get("external_kv_transfer", 0) == before.get("external_kv_transfer", 0)
    assert sum(counter(p, name) for name in misses) - missed == 1
    assert describe_mismatch(complete(reference_server.base_url, turn2, 8), second) is None


@pytest.mark.e2e
def test_an_idle_prefill_node_keeps_its_copy_of_the_announcements_fresh(
    pair,
    tokenizer,  # noqa: F811
):
    """P rules out a lookup by its copy of what D announced only while the copy is recent;
    an idle engine takes no step, so P steps to renew it (`held_mirror.py`). A prompt no D
    holds, sent after a pause several times longer than the copy is trusted without a
    report, prefills without asking D."""
    p = pair.prefill.base_url
    relay_streamed(pair, token_prompt(tokenizer, 2 * BLOCK + 100, seed=60), 8)  # P knows D
    missed, ruled_out = "vllm:kvduplex_lookups_missed_total", "vllm:kvduplex_lookups_ruled_out_total"

    def looked_up(seed: int) -> bool:
        """Sends a prompt nobody holds to P; whether P asked D (False: ruled out)."""
        before = counter(p, missed), counter(p, ruled_out)
        complete(p, token_prompt(tokenizer, BLOCK + 50, seed=seed), max_tokens=1)
        deadline = time.monotonic() + 10.0
        while (now := (counter(p, missed), counter(p, ruled_out))) == before:
            assert time.monotonic() < deadline, "P counted neither a miss nor a ruled-out lookup"
            time.sleep(0.1)
        assert sum(now) - sum(before) == 1
        return now[0] > before[0]

    # P's workers connect to D and get the whole set of its announcements within steps.
    seed, deadline = 70, time.monotonic() + 60.0
    while looked_up(seed):
        assert time.monotonic() < deadline, "P never ruled a lookup out (no copy, or stale)"
        seed += 1
        time.sleep(0.3)
    time.sleep(1.5)
    assert not looked_up(seed + 1), "after a pause, P asked D for a prompt its copy rules out"


@pytest.mark.e2e
def test_an_idle_pair_stepping_for_its_holds_and_its_copy_keeps_no_core_busy(
    pair,
    tokenizer,  # noqa: F811
):
    """D holds a turn (it steps once a second to end holds); P renews its copy of D's
    announcements (five steps a second). vLLM's workers poll their step queue without sleeping
    for a second after each step: each idle server would keep a core busy (measured: 98-100%)
    were it not sent to wait on the queue's socket after such steps (`idle_steps.py`)."""
    relay_streamed(pair, token_prompt(tokenizer, 2 * BLOCK + 100, seed=80), 8)
    d = pair.decode.base_url
    assert wait_for_counter(d, "vllm:kvduplex_held_blocks", lambda n: n > 0) > 0
    time.sleep(1.5)  # the last request's steps' own second of polling
    servers = {"P": pair.prefill.pid, "D": pair.decode.pid}
    before = {role: server_cpu_seconds(pid) for role, pid in servers.items()}
    started = time.monotonic()
    time.sleep(4.0)
    elapsed = time.monotonic() - started
    busy = {
        role: (server_cpu_seconds(pid) - before[role]) / elapsed for role, pid in servers.items()
    }
    logger.info("idle servers' CPU use (cores): %s", busy)
    assert counter(d, "vllm:kvduplex_held_blocks") > 0, "D gave its turn up: nothing to step for"
    assert all(cores < 0.3 for cores in busy.values()), busy
