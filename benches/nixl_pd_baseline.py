"""Baseline: vLLM's own NixlConnector moving prompt KV from a prefill to a decode server.

Starts three CPU vLLM servers on the tiny model: a reference (no connector), a prefill (P) and a
decode (D) server, both with ``{"kv_connector": "NixlConnector", "kv_role": "kv_both",
"kv_buffer_device": "cpu"}``. Each round sends a fresh prompt to P with ``do_remote_decode`` and
``max_tokens=1``, forwards P's ``kv_transfer_params`` to D as a proxy would, and checks that D's
greedy tokens and logprobs equal the reference server's and that D's prompt KV came from the
transfer (its ``external_kv_transfer`` prompt-token counter grew) rather than being recomputed.

Usage (from the repository root):
    PYTHONPATH=python .venv/bin/python benches/nixl_pd_baseline.py [--rounds 4] [--json OUT]

vLLM imports NIXL as ``nixl._api``; the ``nixl-cu12`` wheel installs it as ``nixl_cu12``. When no
``nixl`` module is importable, the servers get a small alias package on their PYTHONPATH.
Exit status 1 when any round's output differs from the reference or no KV was transferred.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvduplex.demo.servers import ServerError, complete, describe_mismatch, with_nonce
from kvduplex.demo.tiny_model import SERVER_ARGS, build_tiny_model, sample_text
from kvduplex.protocol import prefill_request_params
from kvduplex_testing.servers import (
    VllmServer,
    ports_outside_ephemeral_range,
    prompt_tokens_by_source,
    start_many,
)

logger = logging.getLogger("nixl_pd_baseline")

NIXL_KV_TRANSFER_CONFIG = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_both",
    "kv_buffer_device": "cpu",
}
# NIXL on this machine needs tcp (cma alone has no active-message transport); loopback only.
NIXL_ENV = {
    "UCX_TLS": "tcp,self,sm",
    "UCX_NET_DEVICES": "lo",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
}

NIXL_ALIAS_PACKAGE = '''"""Lets vLLM import the nixl-cu12 wheel as `nixl`."""
import importlib, sys
for _name in ("_bindings", "_utils", "logging", "_api"):
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"nixl_cu12.{_name}")
from nixl_cu12 import *  # noqa: E402,F401,F403
'''


def nixl_pythonpath(work_dir: Path) -> list[str]:
    """Extra PYTHONPATH entries the servers need so that ``import nixl._api`` works."""
    probe = [sys.executable, "-c", "import nixl._api"]
    if subprocess.run(probe, capture_output=True).returncode == 0:
        return []
    alias_dir = work_dir / "nixl-alias"
    (alias_dir / "nixl").mkdir(parents=True, exist_ok=True)
    (alias_dir / "nixl" / "__init__.py").write_text(NIXL_ALIAS_PACKAGE)
    check = subprocess.run(
        probe,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(alias_dir), *_pythonpath()])},
    )
    if check.returncode != 0:
        raise SystemExit(
            "NIXL is not importable: install the nixl-cu12 wheel "
            f"(pip install --no-deps nixl-cu12 numpy)\n{check.stderr}"
        )
    logger.info("no `nixl` module installed; aliasing nixl_cu12 via %s", alias_dir)
    return [str(alias_dir)]


def _pythonpath() -> list[str]:
    return [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]


def nixl_pd_envs(work_dir: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The environments of a NixlConnector P and D: NIXL_ENV, a PYTHONPATH that imports nixl
    (aliased under `work_dir` if need be), and a side-channel port each, outside the ephemeral
    range."""
    pythonpath = os.pathsep.join([*nixl_pythonpath(work_dir), *_pythonpath()])
    prefill_port, decode_port = ports_outside_ephemeral_range(2)

    def env(side_channel_port: int) -> dict[str, str]:
        return {
            **NIXL_ENV,
            "PYTHONPATH": pythonpath,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
        }

    return env(prefill_port), env(decode_port)


def transfer_round(
    reference: VllmServer, prefill: VllmServer, decode: VllmServer, prompt: str, max_tokens: int
) -> dict:
    """One P->D request as a proxy sends it, checked against the reference server."""
    expected = complete(reference.base_url, prompt, max_tokens)
    prefilled = complete(
        prefill.base_url, prompt, max_tokens=1, kv_transfer_params=prefill_request_params()
    )
    if not prefilled.kv_transfer_params:
        raise ServerError(f"prefill server returned no kv_transfer_params: {prefilled}")
    transferred_before = _external_kv_tokens(decode)
    decoded = complete(
        decode.base_url, prompt, max_tokens, kv_transfer_params=prefilled.kv_transfer_params
    )
    logprob_diffs = [
        abs(want - got) for want, got in zip(expected.logprobs, decoded.logprobs, strict=False)
    ]
    return {
        "prompt_tokens": len(expected.prompt_token_ids),
        "reference_s": round(expected.elapsed_s, 3),
        "prefill_s": round(prefilled.elapsed_s, 3),
        "decode_s": round(decoded.elapsed_s, 3),
        "decode_tokens_from_transfer": _external_kv_tokens(decode) - transferred_before,
        "max_logprob_diff": max(logprob_diffs, default=None),
        "mismatch": describe_mismatch(expected, decoded),
    }


def _external_kv_tokens(server: VllmServer) -> int:
    return int(prompt_tokens_by_source(server.base_url).get("external_kv_transfer", 0.0))


def run(args: argparse.Namespace, work_dir: Path) -> dict:
    model_dir = build_tiny_model(args.model_dir or work_dir / "tiny-model")
    prefill_env, decode_env = nixl_pd_envs(work_dir)

    def nixl_server(name: str, env: dict[str, str]) -> VllmServer:
        return VllmServer(
            model_dir,
            name=name,
            extra_args=[*SERVER_ARGS, "--kv-transfer-config", json.dumps(NIXL_KV_TRANSFER_CONFIG)],
            env=env,
            log_dir=work_dir,
        )

    reference = VllmServer(model_dir, name="reference", extra_args=SERVER_ARGS, log_dir=work_dir)
    prefill = nixl_server("prefill", prefill_env)
    decode = nixl_server("decode", decode_env)
    report: dict = {"rounds": []}
    started = time.monotonic()
    with start_many([reference, prefill, decode]):
        report["startup_s"] = round(time.monotonic() - started, 1)
        report["logs"] = {s.name: str(s.log_path) for s in (reference, prefill, decode)}
        # A plain request each: the first forward pass of a fresh server is slow, and this
        # keeps that cost out of the first transfer round.
        report["warm_up_s"] = {
            server.name: round(
                complete(server.base_url, with_nonce("warm up"), max_tokens=2).elapsed_s, 2
            )
            for server in (reference, prefill, decode)
        }
        logger.info(
            "all servers up in %.0f s; warm-up %s", report["startup_s"], report["warm_up_s"]
        )
        for round_index in range(args.rounds):
            prompt = with_nonce(sample_text(args.prompt_words, seed=round_index))
            result = {
                "round": round_index,
                **transfer_round(reference, prefill, decode, prompt, args.max_tokens),
            }
            report["rounds"].append(result)
            logger.info("round %s", json.dumps(result))
    report["ok"] = all(
        r["mismatch"] is None and r["decode_tokens_from_transfer"] > 0 for r in report["rounds"]
    )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, help="tiny model directory (built if missing)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompt-words", type=int, default=300, help="~2 tokens per word")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--work-dir", type=Path, help="logs and files (default: a temp dir)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="nixl-pd-baseline-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    report = run(args, work_dir)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
