"""Malformed kv_transfer_params never crash the engine: the request runs without transfer, and
its owner is never asked for a grant (so there is no claim to hand back)."""

from __future__ import annotations

import copy
import math
import time

import pytest

from duplex_harness import make_kv_cache_config, prefill, prompt_tokens
from kvduplex.connector.groups import TransferGroups
from kvduplex.connector.params import ParamsContext, Rejected, parse_remote_blocks
from kvduplex.protocol import PROTOCOL_VERSION

PROMPT = prompt_tokens(100)


def _set(key, value):
    def mutate(params):
        params[key] = value

    return mutate


def _delete(key):
    def mutate(params):
        del params[key]

    return mutate


def _edit_ids(edit):
    def mutate(params):
        params["remote_block_ids"] = edit(list(params["remote_block_ids"]))

    return mutate


# (case id, mutation, expected reason fragment)
CASES = [
    ("ids-not-a-list", _set("remote_block_ids", "1,2,3"), "must be a list"),
    ("ids-strings", _edit_ids(lambda ids: [str(i) for i in ids]), "integers only"),
    ("ids-bool", _edit_ids(lambda ids: [True] + ids[1:]), "integers only"),
    ("ids-float", _edit_ids(lambda ids: [1.0] + ids[1:]), "integers only"),
    ("ids-negative", _edit_ids(lambda ids: [-3] + ids[1:]), "out-of-range id -3"),
    ("ids-null-block", _edit_ids(lambda ids: [0] + ids[1:]), "out-of-range id 0"),
    ("ids-huge", _edit_ids(lambda ids: [2**40] + ids[1:]), "out-of-range"),
    ("ids-duplicate", _edit_ids(lambda ids: [ids[1]] + ids[1:]), "duplicate"),
    ("ids-too-few", _edit_ids(lambda ids: ids[:-1]), "need 7 block(s)"),
    ("ids-huge-list", _edit_ids(lambda ids: list(range(1, 100_001))), "100000 ids but"),
    ("ids-empty", _set("remote_block_ids", []), "0 ids but"),
    ("ids-missing", _delete("remote_block_ids"), "missing remote_block_ids"),
    ("tokens-negative", _set("remote_num_tokens", -5), "outside [1, 1024]"),
    ("tokens-string", _set("remote_num_tokens", "100"), "must be an integer"),
    ("tokens-huge", _set("remote_num_tokens", 10**12), "outside [1, 1024]"),
    ("tokens-missing", _delete("remote_num_tokens"), "missing remote_num_tokens"),
    ("engine-self", _set("remote_engine_id", "D"), "names this engine"),
    ("engine-number", _set("remote_engine_id", 17), "non-empty string"),
    ("engine-empty", _set("remote_engine_id", ""), "non-empty string"),
    ("engine-control-chars", _set("remote_engine_id", "P\n"), "printable"),
    ("engine-missing", _delete("remote_engine_id"), "missing remote_engine_id"),
    ("request-id-list", _set("remote_request_id", ["p1"]), "non-empty string"),
    ("request-id-huge", _set("remote_request_id", "x" * 10_000), "at most 512"),
    ("host-number", _set("remote_host", 127), "non-empty string"),
    ("host-missing", _delete("remote_host"), "missing remote_host"),
    ("port-zero", _set("remote_port", 0), "[1, 65535]"),
    ("port-too-big", _set("remote_port", 70000), "[1, 65535]"),
    ("port-string", _set("remote_port", "41001"), "[1, 65535]"),
    ("port-bool", _set("remote_port", True), "[1, 65535]"),
    ("ports-mismatch", _set("remote_ports", [41009]), "differs from remote_ports"),
    ("ports-missing", _delete("remote_ports"), "missing remote_ports"),
    ("tp-size-unmappable", _set("tp_size", 4), "do not split evenly over tensor-parallel size 4"),
    ("tp-size-huge", _set("tp_size", 10**6), "outside [1, 1024]"),
    ("block-size", _set("remote_block_size", 32), "block size 32"),
    ("fingerprints-missing", _delete("remote_block_fingerprints"), "missing"),
    ("fingerprints-short", _set("remote_block_fingerprints", ["00" * 8]), "list of 7"),
    ("fingerprints-not-hex", _set("remote_block_fingerprints", ["zz" * 8] * 7), "hex"),
    ("lease-past", _set("remote_lease_expiry", 1.0), "read margin"),
    ("lease-nan", _set("remote_lease_expiry", math.nan), "finite number"),
    ("lease-string", _set("remote_lease_expiry", "soon"), "finite number"),
    ("protocol-other", _set("kvduplex_protocol", 99), "protocol"),
    ("protocol-missing", _delete("kvduplex_protocol"), "missing kvduplex_protocol"),
    ("flag-not-bool", _set("do_remote_prefill", "yes"), "must be a boolean"),
    ("both-flags", _set("do_remote_decode", True), "both true"),
]


@pytest.mark.parametrize(
    "mutate,reason", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_malformed_params_run_without_transfer(engines, connector_log, mutate, reason):
    p, d = engines("P"), engines("D")
    params = copy.deepcopy(prefill(p, "p1", PROMPT))
    mutate(params)
    d.add("d1", PROMPT, max_tokens=2, params=params)
    step = d.step()
    assert step.meta.loads == []
    assert step.output.num_scheduled_tokens == {"d1": len(PROMPT)}
    assert step.meta.releases == [] and step.meta.lookups == []
    warnings = connector_log.messages("WARNING")
    assert len(warnings) == 1 and "runs without KV transfer" in warnings[0], warnings
    assert reason in warnings[0]
    # The request completes normally afterwards.
    for _ in range(3):
        d.step()
    assert "d1" not in d.scheduler.requests
    assert d.stats.data["fallbacks"] == 1


@pytest.mark.parametrize("params", [["not", "a", "dict"], "string", 42])
def test_params_that_are_not_an_object(params):
    # vLLM's HTTP layer only accepts objects; the parser refuses anything else on its own.
    context = ParamsContext(
        engine_id="D", tp_size=1, total_kv_heads=2, block_size=16, max_model_len=1024, bidirectional=True,
        read_deadline_margin_s=1.0,
        groups=TransferGroups.from_kv_cache_config(make_kv_cache_config(64)),
    )
    rejected = parse_remote_blocks(params, context)
    assert isinstance(rejected, Rejected) and "must be an object" in rejected.reason


def test_pull_from_decode_refused_when_bidirectional_is_off(engines, connector_log):
    p = engines("P")  # bidirectional off on this prefill node
    params = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": "D",
        "remote_request_id": "d1",
        "remote_host": "127.0.0.1",
        "remote_port": 41002,
        "remote_ports": [41002],
        "tp_size": 1,
        "remote_block_ids": [1, 2],
        "remote_num_tokens": 20,
        "remote_block_size": 16,
        "remote_block_fingerprints": ["00" * 8] * 2,
        "remote_lease_expiry": time.time() + 60,
        "kvduplex_protocol": PROTOCOL_VERSION,
    }
    p.add("p1", PROMPT, max_tokens=1, params=params)
    step = p.step()
    assert step.meta.loads == [] and step.meta.lookups == [] and step.meta.releases == []
    assert "bidirectional_kv_xfer is off" in connector_log.text


def test_plain_prefill_params_from_a_proxy_ask_for_no_pull(engines, connector_log):
    """What vLLM's toy proxy sends a prefill node on every turn."""
    p = engines("P")
    p.add("p1", PROMPT, max_tokens=1, params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None,
    })
    step = p.step()
    assert step.meta.loads == [] and step.meta.releases == []
    assert step.finished("p1").kv_transfer_params["remote_num_tokens"] == len(PROMPT)
    assert connector_log.messages("WARNING") == []
