"""DuplexConnector under vLLM's async scheduling (its default in 0.32): vLLM's real
AsyncScheduler builds a step before the step before it has reported, so the test schedules
and reports steps itself."""

from __future__ import annotations

import types

import pytest
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from duplex_harness import Engine, prompt_tokens
from kvduplex.connector import scheduler as scheduler_module

TOKEN = 7


def report(engine: Engine, output: SchedulerOutput) -> dict:
    """The workers' report of `output`'s step, every request sampling `TOKEN` (each step here
    ends its requests' prompts); returns vLLM's outputs by request id."""
    req_ids = list(output.num_scheduled_tokens)
    runner_output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=[[TOKEN] for _ in req_ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
        kv_connector_output=KVConnectorOutput(),
    )
    outputs = engine.scheduler.update_from_output(output, runner_output)
    return {o.request_id: o for eco in outputs.values() for o in eco.outputs}


def test_auto_threshold_pairs_each_report_with_its_own_steps_time_and_tokens(engines, monkeypatch):
    """Step 2 is built while step 1 runs: step 1 took from its build to its report (3 s), step
    2 from step 1's report to its own (1 s), each with its own scheduled tokens."""
    d = engines("D", {"kv_recompute_threshold": "auto"}, async_scheduling=True)
    now = [0.0]
    clock = types.SimpleNamespace(**{**vars(scheduler_module.time), "perf_counter": lambda: now[0]})
    monkeypatch.setattr(scheduler_module, "time", clock)
    estimator = d.duplex._estimator
    observed = []
    observe_step = estimator.observe_step
    monkeypatch.setattr(
        estimator,
        "observe_step",
        lambda seconds, tokens: (observed.append((seconds, tokens)), observe_step(seconds, tokens)),
    )
    d.add("r1", prompt_tokens(100), max_tokens=3)
    now[0] = 10.0
    first = d.scheduler.schedule()
    now[0] = 11.0
    second = d.scheduler.schedule()
    assert (first.total_num_scheduled_tokens, second.total_num_scheduled_tokens) == (100, 1)
    now[0] = 13.0
    report(d, first)
    now[0] = 14.0
    report(d, second)
    assert observed == [(3.0, 100), (1.0, 1)]
    # Without overlap a step's time is from its build to its report.
    now[0] = 20.0
    third = d.scheduler.schedule()
    now[0] = 20.5
    report(d, third)
    assert observed[2:] == [(0.5, 1)]


@pytest.mark.parametrize("kv_role", ["kv_both", "kv_producer"])
def test_a_preempted_requests_output_in_flight_is_delivered(engines, kv_role):
    """Nothing is handed off through vLLM's delayed frees, so vLLM need not drop a preempted
    request's token in flight (`requires_kv_delivery`): it is delivered, not recomputed. Seen
    on a prefill node configured as `kv_producer`: a `kv_both` engine under async scheduling
    defers a preempted request's frees, so vLLM preempts no request with a step in flight."""
    d = engines("P", num_blocks=5, async_scheduling=True, kv_role=kv_role)
    assert d.scheduler.requires_kv_delivery is False
    if kv_role == "kv_both":
        return
    # 4 usable blocks: two 31-token prompts fill them; the first's second decode token needs
    # a fifth block, so vLLM preempts the second while its first decode token is in flight.
    d.add("a", prompt_tokens(31), max_tokens=8)
    d.add("b", prompt_tokens(31, start=300), max_tokens=8)
    first = d.scheduler.schedule()
    second = d.scheduler.schedule()
    assert second.num_scheduled_tokens == {"a": 1, "b": 1}
    report(d, first)
    third = d.scheduler.schedule()
    assert third.preempted_req_ids == {"b"}
    delivered = report(d, second)
    assert delivered["b"].new_token_ids == [TOKEN]
    assert list(d.scheduler.requests["b"].output_token_ids) == [TOKEN, TOKEN]


def test_a_prefill_for_another_engine_preempted_with_its_token_in_flight_offers_no_blocks(
    engines,
):
    """What `requires_kv_delivery` guards against: a request preempted with its output in
    flight, whose blocks the preemption freed, finishing on that output. A prefill for another
    engine (one token) finishes so; the connector offers none of the freed blocks, and the
    prefill's reader computes instead."""
    p = engines("P", num_blocks=5, async_scheduling=True, kv_role="kv_producer")
    # 4 usable blocks: the two prompts fill them; the decode's first token needs a fifth, so
    # vLLM preempts the last running request, the prefill, while its token is in flight.
    p.add("decode", prompt_tokens(32), max_tokens=8)
    p.add("prefill", prompt_tokens(31, start=300), max_tokens=1, params={"do_remote_decode": True})
    first = p.scheduler.schedule()
    second = p.scheduler.schedule()
    assert second.preempted_req_ids == {"prefill"}
    assert second.num_scheduled_tokens == {"decode": 1}
    finished = report(p, first)["prefill"]
    assert finished.finish_reason is not None and finished.new_token_ids == [TOKEN]
    assert not (finished.kv_transfer_params or {}).get("remote_block_ids")
    assert not p.duplex._held
