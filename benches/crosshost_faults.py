#!/usr/bin/env python3
"""A peer that freezes, dies or drops off the network in the middle of a cross-host KV read.

P and D are vLLM servers (the tiny chat model, DuplexConnector, bidirectional) on the simulated
hosts `p` and `d` of benches/_netns.py: network and pid namespaces of their own, UCX over tcp
on the hosts' veth links (so `same_host` is false: UCX_TLS rules out the same-host path, and the
owner's pid names no process the reader can see), a shared secret. The driver runs on host
`client` and talks to each server directly (no proxy: the faulted owner must not be on the
request's path). A plain server (no connector) on host `client` gives the expected answers.

Two scenarios, each with the reader's and the owner's link capped by `tc tbf` at `--rate-mbit`
so that the read lasts seconds:
- `pull-back`: turn 1 is prefilled on P and decoded on D (D pulls it, links uncapped), which
  holds the turn; P's prefix cache is reset, and turn 2 goes to P alone: P finds the history on
  D and pulls it. Reader P, owner D.
- `pull-prefill`: a prompt is prefilled on P (held for D), then sent to D with P's params: D
  pulls P's blocks. Reader D, owner P.

Faults, each applied once the reader's link has received `--fault-at` of the read's bytes:
`stop` (SIGSTOP to the owner's vLLM worker process, whose transfer core serves the reads;
SIGCONT after),
`kill` (SIGKILL to it), `link-down` (`ip link set eth0 down` on the owner's host; up after);
`none` is the control (the read completes). Per case: the request's TTFT and total time, its
answer against the plain server's (tokens; logprobs within 1e-2), whether the reader's engine
process lives and answers /health, and a next request (a new conversation) to the reader, whose
answer must match too and whose TTFT must be normal: at most 2 x `step` + the lookup timeout +
`--slack`, `step` being the reader's TTFT for a fresh prompt of the same length before the fault
(a full prefill, which is what a recompute adds). The faulted request must answer within
`bound` = lookup timeout + read deadline + step + `--slack`, where the read deadline is
`kv_lease_ttl_s - read_deadline_margin_s` (the reader's claim lasts at most the lease, and it
gives up that margin before the claim ends). The connector's deadlines are set short here
(`--lease`, `--margin`, `--handshake`, `--heartbeat`, `--lookup-ms`) so that a run takes
minutes; `--ucx-peer-error-handling` sets that option (else the connector's default holds).
Every wait is bounded: a request with no answer `--hang-after` seconds past its bound is
reported as a hang (the next request is tried with the fault still in place, then the fault is
lifted and the hung request given `--after-restore` seconds more). A fault case restarts P and D
afterwards.

    sudo PYTHONPATH=python .venv/bin/python benches/crosshost_faults.py --out benches/results \\
        [--scenarios pull-back pull-prefill] [--faults none stop kill link-down]

writes OUT/crosshost_faults.json and prints a table. Exit status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import httpx  # noqa: E402
import psutil  # noqa: E402

from _multihost_sweep import reset_p  # noqa: E402
from _netns import Fabric  # noqa: E402
from history_sweep import prompt  # noqa: E402
from kvduplex.demo import duplex_kv_transfer_config, read_metrics  # noqa: E402
from kvduplex.demo.servers import (  # noqa: E402
    complete,
    describe_mismatch,
    wait_until_ready,
)
from kvduplex.demo.tiny_model import MODEL_CONFIG, SERVER_ARGS  # noqa: E402
from kvduplex.protocol import prefill_request_params  # noqa: E402
from kvduplex_testing.servers import VllmServer, complete_streamed, node_cpu_sets  # noqa: E402
from kvduplex_testing.tiny_model import build_tiny_chat_model  # noqa: E402
from multihost import HOSTS, host_server  # noqa: E402

logger = logging.getLogger("crosshost_faults")
SCENARIOS = {"pull-back": ("p", "d"), "pull-prefill": ("d", "p")}  # (reader, owner)
FAULTS = ("none", "stop", "kill", "link-down")
LOGPROB_ATOL = 1e-2  # servers on other CPUs round differently (history_sweep's tolerance)
# Bytes of KV a token takes in the tiny model: K and V, every layer, float32.
KV_BYTES_PER_TOKEN = (2 * MODEL_CONFIG["num_hidden_layers"] * MODEL_CONFIG["num_key_value_heads"]
                      * MODEL_CONFIG["head_dim"] * 4)
READ_START_LIMIT_S = 120.0  # from the request to --fault-at of the read's bytes


def connector_config(args) -> dict:
    config = duplex_kv_transfer_config(bidirectional=True)
    config["kv_connector_extra_config"].update({
        "kv_lease_ttl_s": args.lease, "read_deadline_margin_s": args.margin,
        "handshake_timeout_s": args.handshake, "peer_heartbeat_s": args.heartbeat,
        "decode_kv_hold_ttl_s": args.hold, "lookup_timeout_ms": args.lookup_ms,
    })
    if args.ucx_peer_error_handling is not None:
        config["kv_connector_extra_config"]["ucx_peer_error_handling"] = args.ucx_peer_error_handling
    return config


@dataclass
class Context:
    fabric: Fabric
    args: argparse.Namespace
    secret: str
    model_dir: Path
    log_dir: Path
    plain: VllmServer
    pool: concurrent.futures.ThreadPoolExecutor
    pairs: int = 0  # started so far: names each pair's logs

    def server(self, role: str) -> VllmServer:
        host = {"prefill": "p", "decode": "d"}[role]
        cpus = node_cpu_sets(2)[0 if host == "p" else 1]
        argv = [*SERVER_ARGS, "--kv-transfer-config", json.dumps(connector_config(self.args))]
        env = {"VLLM_SERVER_DEV_MODE": "1"}  # P's /reset_prefix_cache
        return host_server(self.fabric, host, self.secret, self.model_dir,
                           name=f"{role}{self.pairs}",
                           log_dir=self.log_dir, argv=argv, env=env, cpus=cpus)

    def bound_s(self, step_s: float) -> float:
        a = self.args
        return a.lookup_ms / 1000 + (a.lease - a.margin) + step_s + a.slack

    def expected(self, ids: list[int]):
        return complete_streamed(self.plain.base_url, ids, self.args.answer, timeout_s=300)


def engine_pids(fabric: Fabric, host: str) -> dict[str, int]:
    """The vLLM engine's processes on `host` by role: "engine" (VLLM::EngineCore, the
    scheduler) and "worker" (VLLM::Worker: the model runner, whose KV cache and transfer core
    serve and make the reads)."""
    found: dict[str, int] = {}
    for pid in fabric.pids(host):
        try:
            title = psutil.Process(pid).cmdline()[:1]
        except psutil.Error:
            continue
        for role, name in (("engine", "VLLM::EngineCore"), ("worker", "VLLM::Worker")):
            if title and title[0].startswith(name):
                found[role] = pid
    return found


def apply_fault(fabric: Fabric, fault: str, host: str, pid: int) -> None:
    if fault == "stop":
        os.kill(pid, signal.SIGSTOP)
    elif fault == "kill":
        os.kill(pid, signal.SIGKILL)
    elif fault == "link-down":
        fabric.set_link(host, False)


def lift_fault(fabric: Fabric, fault: str, host: str, pid: int) -> None:
    if fault == "stop":
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    elif fault == "link-down":
        fabric.set_link(host, True)


def set_caps(fabric: Fabric, mbit: float | None) -> None:
    for host in ("p", "d"):
        fabric.set_rate(host, None if mbit is None else mbit / 1000)


def engine_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() not in (
            psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


def healthy(server: VllmServer) -> bool:
    try:
        return httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def compare(expected, answer) -> str | None:
    return describe_mismatch(expected, answer, logprob_atol=LOGPROB_ATOL)


def timed(ctx: Context, send, limit_s: float):
    """(answer, error, seconds) of `send()` run on the pool, waited on for `limit_s` at most;
    a hang is the error "hung" and the future is returned in place of the answer."""
    started = time.monotonic()
    future = ctx.pool.submit(send)
    try:
        return future.result(timeout=limit_s), None, time.monotonic() - started
    except concurrent.futures.TimeoutError:
        return future, "hung", time.monotonic() - started
    except Exception as exc:  # noqa: BLE001 - reported as the case's error
        return None, f"{type(exc).__name__}: {exc}", time.monotonic() - started


def connector_delta(server: VllmServer, before) -> dict:
    try:
        after = read_metrics(server.base_url, timeout_s=10)
    except Exception as exc:  # noqa: BLE001
        return {"error": str(exc)}
    keys = ("failed_transfers", "fallbacks", "tokens_recomputed", "transfers", "lease_expiries")
    delta = {k: after.connector.get(k, 0.0) - before.connector.get(k, 0.0) for k in keys
             if k in after.connector}
    delta["external_kv_tokens"] = (after.prompt_tokens.get("external_kv_transfer", 0.0)
                                   - before.prompt_tokens.get("external_kv_transfer", 0.0))
    return delta


def run_case(ctx: Context, servers: dict[str, VllmServer], scenario: str, fault: str,
             seed: int) -> dict:
    args, fabric = ctx.args, ctx.fabric
    reader_host, owner_host = SCENARIOS[scenario]
    p, d = servers["p"], servers["d"]
    reader = servers[reader_host]
    length = args.history + args.answer + args.new
    row: dict = {"scenario": scenario, "fault": fault, "reader": reader_host,
                 "owner": owner_host, "prompt_tokens": length}
    set_caps(fabric, None)
    # One step: the reader's TTFT for a fresh prompt of this length (a full prefill).
    fresh = prompt(length, seed=seed + 1)
    want = ctx.expected(fresh)
    got = complete_streamed(reader.base_url, fresh, args.answer, timeout_s=300)
    row["step_s"] = got.ttft_s
    row["bound_s"] = ctx.bound_s(got.ttft_s)
    if (mismatch := compare(want, got)) is not None:
        return {**row, "ok": False, "errors": [f"fresh prompt before the fault: {mismatch}"]}
    if scenario == "pull-back":
        turn1 = prompt(args.history, seed=seed + 2)
        pre = complete(p.base_url, turn1, 1, kv_transfer_params=prefill_request_params())
        first = complete(d.base_url, turn1, args.answer, kv_transfer_params=pre.kv_transfer_params)
        ids = turn1 + first.token_ids + prompt(args.new, seed=seed + 3)
        reset_p(p)
        expected = ctx.expected(ids)
        set_caps(fabric, args.rate_mbit)
        time.sleep(1.0)
        params = None
    else:
        ids = prompt(length, seed=seed + 2)
        expected = ctx.expected(ids)
        set_caps(fabric, args.rate_mbit)
        pre = complete(p.base_url, ids, 1, kv_transfer_params=prefill_request_params())
        params = pre.kv_transfer_params
    read_bytes = len(ids) * KV_BYTES_PER_TOKEN
    row["read_bytes_about"] = read_bytes
    owner_pids, reader_pids = engine_pids(fabric, owner_host), engine_pids(fabric, reader_host)
    row.update(owner_pids=owner_pids, reader_pids=reader_pids)
    if len(owner_pids) != 2 or len(reader_pids) != 2:
        return {**row, "ok": False, "errors": ["no EngineCore or Worker process found"]}
    owner_pid = owner_pids["worker"]
    before = read_metrics(reader.base_url)
    rx0 = fabric.link_bytes(reader_host)["rx"]
    hang_limit = row["bound_s"] + args.hang_after
    http_timeout = hang_limit + args.after_restore + 30
    started = time.monotonic()
    future = ctx.pool.submit(lambda: complete_streamed(
        reader.base_url, ids, args.answer, kv_transfer_params=params, timeout_s=http_timeout))
    errors: list[str] = []
    fault_at = None
    if fault != "none":
        threshold = rx0 + args.fault_at * read_bytes
        while time.monotonic() - started < READ_START_LIMIT_S and not future.done():
            rx = fabric.link_bytes(reader_host)["rx"]
            if rx >= threshold:
                apply_fault(fabric, fault, owner_host, owner_pid)
                fault_at = time.monotonic() - started
                row["fault_at_s"] = round(fault_at, 3)
                row["rx_at_fault"] = rx - rx0
                logger.info("%s %s: fault applied %.2f s after the request, %.1f MB read",
                            scenario, fault, fault_at, (rx - rx0) / 1e6)
                break
            time.sleep(0.02)
        if fault_at is None:
            errors.append("the read never reached --fault-at of its bytes before the request "
                          "ended (or within the limit): the fault did not hit a read")
    answer, error, _ = None, None, 0.0
    try:
        answer = future.result(timeout=max(0.0, hang_limit - (time.monotonic() - started)))
    except concurrent.futures.TimeoutError:
        error = "hung"
    except Exception as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {exc}"
    elapsed = time.monotonic() - started
    row["rx_during"] = fabric.link_bytes(reader_host)["rx"] - rx0
    if answer is not None:
        row.update(ttft_s=answer.ttft_s, total_s=answer.elapsed_s)
        if (mismatch := compare(expected, answer)) is not None:
            errors.append(f"answer differs from the plain server's: {mismatch}")
        row["answer_matches"] = mismatch is None
        if answer.ttft_s is not None and answer.ttft_s > row["bound_s"]:
            errors.append(f"TTFT {answer.ttft_s:.1f} s past the bound {row['bound_s']:.1f} s")
    elif error == "hung":
        row["hung_s"] = round(elapsed, 1)
        errors.append(f"no answer {elapsed:.0f} s after the request (bound "
                      f"{row['bound_s']:.1f} s): hung")
    else:
        errors.append(f"request failed after {elapsed:.1f} s: {error}")
    # The reader lives and serves a new conversation, with the fault still in place.
    row["reader_engine_alive"] = all(engine_alive(pid) for pid in reader_pids.values())
    row["reader_healthy"] = healthy(reader)
    if not (row["reader_engine_alive"] and row["reader_healthy"]):
        errors.append("the reader's engine died or stopped answering /health")
    else:
        fresh = prompt(length, seed=seed + 4)
        want = ctx.expected(fresh)
        next_bound = 2 * row["step_s"] + args.lookup_ms / 1000 + args.slack
        got, next_error, _ = timed(ctx, lambda: complete_streamed(
            reader.base_url, fresh, args.answer, timeout_s=next_bound + args.hang_after + 30),
            next_bound + args.hang_after)
        row["next_bound_s"] = next_bound
        if next_error is not None:
            errors.append(f"next request: {next_error}")
        else:
            row["next_ttft_s"] = got.ttft_s
            if (mismatch := compare(want, got)) is not None:
                errors.append(f"next request's answer differs: {mismatch}")
            if got.ttft_s is not None and got.ttft_s > next_bound:
                errors.append(f"next request's TTFT {got.ttft_s:.1f} s is not normal "
                              f"(bound {next_bound:.1f} s)")
    row["reader_connector"] = connector_delta(reader, before)
    lift_fault(fabric, fault, owner_host, owner_pid)
    if error == "hung":  # what the hung request does once the owner is back (or gone for good)
        try:
            late = future.result(timeout=args.after_restore)
            row["answered_after_restore_s"] = round(time.monotonic() - started - elapsed, 1)
            row["late_answer_matches"] = compare(expected, late) is None
            row.update(ttft_s=late.ttft_s, total_s=late.elapsed_s)
        except concurrent.futures.TimeoutError:
            row["answered_after_restore_s"] = None
        except Exception as exc:  # noqa: BLE001
            row["late_error"] = f"{type(exc).__name__}: {exc}"
    row["errors"] = errors
    row["ok"] = not errors
    logger.info("%s %s: %s", scenario, fault, json.dumps(row))
    return row


def start_pair(ctx: Context) -> dict[str, VllmServer]:
    ctx.pairs += 1
    servers = {"p": ctx.server("prefill"), "d": ctx.server("decode")}
    try:
        for server in servers.values():
            server.start()
        wait_until_ready(list(servers.values()))
        for server in servers.values():
            complete(server.base_url, prompt(8, seed=-1), 2, timeout_s=300)
    except BaseException:
        stop_pair(servers)
        raise
    return servers


def stop_pair(servers: dict[str, VllmServer] | None) -> None:
    for server in (servers or {}).values():
        server.stop()


def inner(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    fabric = Fabric(HOSTS, prefix=args.prefix)  # set up by the outer process
    log_dir = Path(tempfile.mkdtemp(prefix="crosshost-faults-", dir=args.out))
    started = time.monotonic()
    rows: list[dict] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        plain = host_server(fabric, "client", os.environ["KVDUPLEX_SECRET"], args.model_dir,
                            name="plain", log_dir=log_dir, argv=list(SERVER_ARGS))
        ctx = Context(fabric, args, os.environ["KVDUPLEX_SECRET"], args.model_dir, log_dir,
                      plain, pool)
        servers = None
        try:
            plain.start()
            plain.wait_until_ready()
            seed = 1000
            for scenario in args.scenarios:
                for fault in args.faults:
                    seed += 100
                    if servers is None:
                        servers = start_pair(ctx)
                    try:
                        rows.append(run_case(ctx, servers, scenario, fault, seed))
                    except Exception as exc:  # noqa: BLE001 - reported, the next case runs
                        logger.exception("%s %s failed", scenario, fault)
                        rows.append({"scenario": scenario, "fault": fault, "ok": False,
                                     "errors": [f"{type(exc).__name__}: {exc}"]})
                    if fault != "none" or not rows[-1]["ok"]:
                        set_caps(fabric, None)
                        stop_pair(servers)
                        servers = None
        finally:
            stop_pair(servers)
            plain.stop()
            pool.shutdown(wait=False, cancel_futures=True)
    report = {
        "code": subprocess.run(["git", "-C", str(HERE), "rev-parse", "HEAD"],
                               capture_output=True, text=True).stdout.strip(),
        "connector": connector_config(args)["kv_connector_extra_config"],
        "read_deadline_s": args.lease - args.margin, "rate_mbit": args.rate_mbit,
        "history": args.history, "answer": args.answer, "new": args.new,
        "fault_at": args.fault_at, "slack_s": args.slack, "ucx_tls": "tcp",
        "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "load_average": os.getloadavg(),
        "seconds": round(time.monotonic() - started), "logs": str(log_dir), "cases": rows,
        "ok": all(r.get("ok") for r in rows),
    }
    path = args.out / "crosshost_faults.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(format_table(report))
    print(f"wrote {path}")
    return 0 if report["ok"] else 1


def format_table(report: dict) -> str:
    def s(v):
        return f"{v:.1f}" if isinstance(v, (int, float)) else "-"

    lines = [f"read deadline {report['read_deadline_s']:g} s (kv_lease_ttl_s "
             f"{report['connector']['kv_lease_ttl_s']:g} - read_deadline_margin_s "
             f"{report['connector']['read_deadline_margin_s']:g}), link {report['rate_mbit']:g} "
             f"Mbit/s, code {report['code'][:10]}",
             f"{'scenario':<13}{'fault':<10}{'step':>6}{'bound':>7}{'fault@':>7}{'TTFT':>7}"
             f"{'total':>7}{'match':>7}{'alive':>7}{'next':>6}  ok / errors"]
    for r in report["cases"]:
        lines.append(
            f"{r['scenario']:<13}{r['fault']:<10}{s(r.get('step_s')):>6}{s(r.get('bound_s')):>7}"
            f"{s(r.get('fault_at_s')):>7}{s(r.get('ttft_s')):>7}{s(r.get('total_s')):>7}"
            f"{str(r.get('answer_matches', '-')):>7}{str(r.get('reader_engine_alive', '-')):>7}"
            f"{s(r.get('next_ttft_s')):>6}  {'ok' if r.get('ok') else '; '.join(r['errors'])}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    parser.add_argument("--rate-mbit", type=float, default=8.0,
                        help="the P and D links' cap during the faulted read")
    parser.add_argument("--history", type=int, default=1600)
    parser.add_argument("--answer", type=int, default=16)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--fault-at", type=float, default=0.3,
                        help="fault once the reader's link has received this share of the read")
    parser.add_argument("--lease", type=float, default=15.0, help="kv_lease_ttl_s")
    parser.add_argument("--margin", type=float, default=1.0, help="read_deadline_margin_s")
    parser.add_argument("--handshake", type=float, default=3.0, help="handshake_timeout_s")
    parser.add_argument("--heartbeat", type=float, default=1.0, help="peer_heartbeat_s")
    parser.add_argument("--hold", type=float, default=60.0, help="decode_kv_hold_ttl_s")
    parser.add_argument("--lookup-ms", type=int, default=1000, help="lookup_timeout_ms")
    parser.add_argument("--ucx-peer-error-handling", action=argparse.BooleanOptionalAction,
                        help="set the connector's ucx_peer_error_handling (default: its default)")
    parser.add_argument("--slack", type=float, default=3.0,
                        help="seconds added to every bound (a busy 2-core machine)")
    parser.add_argument("--hang-after", type=float, default=30.0,
                        help="seconds past its bound after which a request counts as hung")
    parser.add_argument("--after-restore", type=float, default=30.0)
    parser.add_argument("--model-dir", type=Path,
                        default=Path(tempfile.gettempdir()) / "kvduplex-tiny-chat-model")
    parser.add_argument("--prefix", default="kvdxf", help="namespace name prefix")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        return inner(args)
    if os.geteuid() != 0:
        parser.error("needs root (network namespaces, tc, signals to the servers)")
    length = args.history + args.answer + args.new
    read_s = length * KV_BYTES_PER_TOKEN / (args.rate_mbit * 1e6 / 8)
    if read_s > 0.7 * (args.lease - args.margin):
        parser.error(f"a read takes ~{read_s:.1f} s at {args.rate_mbit:g} Mbit/s: too close to "
                     f"the read deadline {args.lease - args.margin:g} s (raise --lease)")
    args.out.mkdir(parents=True, exist_ok=True)
    build_tiny_chat_model(args.model_dir)
    secret = secrets.token_hex(16)
    with Fabric(HOSTS, prefix=args.prefix) as fabric:
        # On host `client`'s network, in this pid namespace: it sees (and signals) every
        # host's processes.
        command = ["ip", "netns", "exec", fabric.namespace("client"), sys.executable,
                   str(Path(__file__).resolve()), *sys.argv[1:], "--inner"]
        return subprocess.run(command, env=dict(os.environ, KVDUPLEX_SECRET=secret)).returncode


if __name__ == "__main__":
    sys.exit(main())
