"""Two P's and two D's behind vLLM's production router, `vllm-router` (PyPI, Rust, installed in
the test venv by the Makefile), `--vllm-pd-disaggregation`: 4-turn streamed conversations
through the official openai SDK (token ids kept by the client, as test_lookup_e2e's), every
answer equal to a single server's, and on every turn >= 2 P pulls the history it lacks from the
D that holds it.

What the router does (docs/connector.md, "Behind vllm-router"): P gets the client's request
with `max_tokens=1` and its own `kv_transfer_params` (`do_remote_decode`, whatever the client
sent), D gets the client's request with P's params. So nothing in a request names the D that
holds the previous turn: P must know every D by itself (`connector/fleet.py`: on one host, the
fleet directory every engine lists itself in).
- `round_robin` advances the P and the D index together: request k goes to (P[k mod 2],
  D[k mod 2]), so a conversation's next turn lands on the other pair, whose P has never met the
  D that holds the history (turn 2: P1 pulls from D0).
- `cache_aware` keeps a conversation on the P and the D that served its first turn (short
  prompts under its balance thresholds); its `/v1/completions/render` calls (tokenization
  only) move no engine counter.

Servers: the session's P/D pair (conftest's `pd_pair` with test_connector_e2e's config) as P0
and D0, the session's reference server, and one more P and D of the same config for this
module, started while the pair is (re)started. Both policies run on the same four servers (a
router process each); the warm-ups go to the servers directly, not through a router.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import DEV_MODE, warm_up
from kvduplex.demo.servers import Completion, complete, describe_mismatch, wait_until_ready
from kvduplex.demo.tiny_model import SERVER_ARGS
from kvduplex_testing.router import VllmRouter
from kvduplex_testing.servers import VllmServer, prompt_tokens_by_source
from test_connector_e2e import KV_TRANSFER_CONFIG, THRESHOLD, token_prompt, tokenizer  # noqa: F401
from test_lookup_e2e import stream_completion

logger = logging.getLogger(__name__)

BLOCK = 128
TURNS = 4
FIRST_TOKENS = 2 * BLOCK + 100
NEW_TOKENS = 60
ANSWER_TOKENS = 100
assert ANSWER_TOKENS > THRESHOLD  # every later turn's pull is worth it to P, whatever it cached


@dataclass
class Fleet:
    prefills: list[VllmServer]
    decodes: list[VllmServer]

    @property
    def servers(self) -> list[VllmServer]:
        return [*self.prefills, *self.decodes]


@pytest.fixture(scope="module")
def fleet(pd_pair, tiny_model_dir: Path, server_log_dir: Path) -> Iterator[Fleet]:
    config = ["--kv-transfer-config", json.dumps(KV_TRANSFER_CONFIG)]
    more = [
        VllmServer(
            tiny_model_dir, name=name, extra_args=[*SERVER_ARGS, *config], env=DEV_MODE,
            log_dir=server_log_dir,
        )
        for name in ("prefill-1", "decode-1")
    ]
    with contextlib.ExitStack() as stack:
        for server in more:
            stack.callback(server.stop)
            server.start()
        pair = pd_pair(KV_TRANSFER_CONFIG)  # the session's pair; started meanwhile if need be
        wait_until_ready(more)
        for server in more:
            warm_up(server)
        yield Fleet([pair.prefill, more[0]], [pair.decode, more[1]])


@dataclass
class Turn:
    prompt: list[int]
    answer: Completion
    prefill: int
    """Index of the P whose prompt tokens moved."""
    decode: int
    on_p: dict[str, float]
    """That P's prompt tokens by source for the turn."""


def moved(fleet: Fleet, before: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per server that processed prompt tokens since `before`: its tokens by source."""
    out = {}
    for server in fleet.servers:
        after = prompt_tokens_by_source(server.base_url)
        delta = {k: v - before[server.name].get(k, 0) for k, v in after.items()}
        if any(delta.values()):
            out[server.name] = delta
    return out


def conversation(
    router: VllmRouter, fleet: Fleet, reference: VllmServer, tokenizer, seed: int  # noqa: F811
) -> list[Turn]:
    """TURNS turns through `router`, each prompt the history (earlier prompts and answers) and
    a fresh message; every answer equal to the reference's. Returns where each turn ran."""
    turns: list[Turn] = []
    history: list[int] = []
    for number in range(TURNS):
        prompt = history + token_prompt(
            tokenizer, FIRST_TOKENS if number == 0 else NEW_TOKENS, seed=10 * seed + number
        )
        before = {s.name: prompt_tokens_by_source(s.base_url) for s in fleet.servers}
        answer = stream_completion(router.base_url, prompt, ANSWER_TOKENS)
        on = moved(fleet, before)
        expected = complete(reference.base_url, prompt, ANSWER_TOKENS)
        assert describe_mismatch(expected, answer) is None, f"turn {number + 1}"
        (p,) = [i for i, s in enumerate(fleet.prefills) if s.name in on]
        (d,) = [i for i, s in enumerate(fleet.decodes) if s.name in on]
        logger.info("turn %d (%d tokens) on P%d and D%d: %s", number + 1, len(prompt), p, d, on)
        turns.append(Turn(prompt, answer, p, d, on[fleet.prefills[p].name]))
        history = prompt + answer.token_ids
    return turns


def where(turns: list[Turn]) -> str:
    """Each turn's P and D and P's prompt tokens: computed / own cache / pulled."""
    return "; ".join(
        f"turn {n + 1} P{t.prefill} D{t.decode} "
        + "/".join(str(int(t.on_p.get(k, 0))) for k in SOURCES)
        for n, t in enumerate(turns)
    )


SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def check_reuse(turns: list[Turn]) -> None:
    """On every turn >= 2, P pulled from D what its own cache lacks of the history D holds (the
    previous prompt and answer but the answer's last token, which D never computed), and
    computed only the rest: the new message and that token."""
    for number in range(1, len(turns)):
        previous, turn = turns[number - 1], turns[number]
        held = len(previous.prompt) + len(previous.answer.token_ids) - 1
        pulled = turn.on_p.get("external_kv_transfer", 0)
        computed = turn.on_p.get("local_compute", 0)
        assert pulled > 0 and computed == len(turn.prompt) - held, (
            f"turn {number + 1} pulled {pulled:.0f}, computed {computed:.0f}; {where(turns)}"
        )


@pytest.mark.e2e
def test_round_robin_every_p_pulls_the_history_from_the_d_of_the_other_pair(
    fleet, reference_server, tokenizer, server_log_dir  # noqa: F811
):
    prefills = [s.base_url for s in fleet.prefills]
    decodes = [s.base_url for s in fleet.decodes]
    with VllmRouter(prefills, decodes, "round_robin", server_log_dir, name="router-rr") as router:
        turns = conversation(router, fleet, reference_server, tokenizer, seed=61)
    # The router pairs P[i] with D[i] and moves on by one each request: the turns alternate.
    logger.info("round_robin: %s", where(turns))
    pairs = [(t.prefill, t.decode) for t in turns]
    first = pairs[0][0]
    assert pairs == [((first + n) % 2, (first + n) % 2) for n in range(TURNS)], where(turns)
    # Turn 2's P has never seen the conversation: all its history comes from the D of turn 1,
    # the other pair's.
    held = len(turns[0].prompt) + ANSWER_TOKENS - 1
    pulled = turns[1].on_p.get("external_kv_transfer", 0)
    assert pulled == held, f"turn 2 pulled {pulled:.0f} of {held}; {where(turns)}"
    check_reuse(turns)


@pytest.mark.e2e
def test_cache_aware_keeps_a_conversation_on_one_pair_and_p_pulls_every_later_turn(
    fleet, reference_server, tokenizer, server_log_dir  # noqa: F811
):
    prefills = [s.base_url for s in fleet.prefills]
    decodes = [s.base_url for s in fleet.decodes]
    with VllmRouter(prefills, decodes, "cache_aware", server_log_dir, name="router-ca") as router:
        turns = conversation(router, fleet, reference_server, tokenizer, seed=62)
    logger.info("cache_aware: %s", where(turns))
    check_reuse(turns)
