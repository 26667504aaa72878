"""The end-to-end harness itself: the reference server is a usable source of expected outputs,
and a server is pinned to the CPUs it is given."""

import os
import re
import time
from pathlib import Path

import pytest

from kvduplex.demo.servers import (
    SERVER_ENV_DEFAULTS,
    ServerError,
    complete,
    describe_mismatch,
    with_nonce,
)
from kvduplex.demo.tiny_model import sample_text
from kvduplex_testing.servers import VllmServer, node_cpu_sets

# ~300 tokens: the nonce sits in the first 128-token KV block, generation starts in the third.
PROMPT_WORDS = 150
MAX_TOKENS = 8


@pytest.mark.e2e
def test_reference_server_is_deterministic_and_history_sensitive(reference_server):
    prompt = with_nonce(sample_text(PROMPT_WORDS))
    first = complete(reference_server.base_url, prompt, MAX_TOKENS)
    # The repeat is served partly from the prefix cache: cached KV must give the same answer.
    second = complete(reference_server.base_url, prompt, MAX_TOKENS)

    assert len(first.prompt_token_ids) > 2 * 128
    assert len(first.token_ids) == len(first.logprobs) == MAX_TOKENS
    assert all(len(alternatives) >= 5 for alternatives in first.top_logprobs)
    assert describe_mismatch(first, second, logprob_atol=1e-5) is None

    # Only the nonce differs, two blocks before generation starts: if that changed nothing,
    # comparing outputs could not reveal KV blocks that were lost or taken from another prompt.
    other_prompt = with_nonce(sample_text(PROMPT_WORDS))
    other_history = complete(reference_server.base_url, other_prompt, MAX_TOKENS)
    differences = [abs(a - b) for a, b in zip(first.logprobs, other_history.logprobs, strict=True)]
    assert max(differences) > 1e-2, differences


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning to a half needs 2 CPUs")
def test_server_processes_are_pinned_to_the_cpus_given(tmp_path):
    # The launcher itself, with a stand-in interpreter that prints the CPUs it may run on (what
    # vLLM's engine and worker processes inherit) and its OpenMP threads, and exits: a server
    # that "died" at startup, leaving a file where vLLM puts its processes' sockets.
    stand_in = tmp_path / "python"
    stand_in.write_text(
        "#!/bin/sh\ngrep Cpus_allowed_list /proc/self/status\necho threads=$OMP_NUM_THREADS\n"
        'echo ipc=$VLLM_RPC_BASE_PATH\ntouch "$VLLM_RPC_BASE_PATH/socket"\n'
    )
    stand_in.chmod(0o755)
    first, second = node_cpu_sets(2)
    assert first and second and not first & second
    cases = [(half, half, str(len(half))) for half in (first, second)]
    cases.append((None, os.sched_getaffinity(0), SERVER_ENV_DEFAULTS["OMP_NUM_THREADS"]))
    for cpus, expected, threads in cases:
        server = VllmServer(
            tmp_path, name="stand-in", python=str(stand_in), log_dir=tmp_path, cpus=cpus
        )
        server.start()
        with pytest.raises(ServerError) as died:
            while not server.poll_ready():
                time.sleep(0.05)
        allowed = re.search(r"Cpus_allowed_list:\s*(\S+)", str(died.value))
        assert allowed is not None, str(died.value)
        assert parse_cpu_list(allowed.group(1)) == set(expected)
        assert f"threads={threads}" in str(died.value)
        ipc = Path(re.search(r"ipc=(\S+)", str(died.value)).group(1))
        assert (ipc / "socket").exists()
        server.stop()
        assert not ipc.exists(), "the server's socket directory outlived it"

    with pytest.raises(ValueError, match="empty CPU set"):
        VllmServer(tmp_path, cpus=[])
    with pytest.raises(ValueError, match="at least"):
        node_cpu_sets(len(os.sched_getaffinity(0)) + 1)


def parse_cpu_list(text: str) -> set[int]:
    """The kernel's CPU list format ("0-3,5")."""
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus
