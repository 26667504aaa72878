"""An owner-side DuplexWorker in its own process, for the two-process worker tests.

Builds KV caches filled from a seed (in vLLM's KV cache layout "layout", LBHNC by default),
registers them, prints its side-channel address as one JSON line, then serves: each stdin line
{"hold": request_id, "ttl_s": seconds, "fingerprints", "turn", optionally "num_blocks", "offer"}
hands the worker a HoldSpec, as the scheduler would, and {"end_holds": true} the order vLLM's
cache reset leads to (`end_holds`; {"holds_ended": true, ...} is printed once the hold book
ended them, and {"ended_holds": true, ...} once that step's `begin_step` returned),
{"sleep": true} / {"sleep": false} vLLM's sleep-mode hooks (`unregister_kv_caches` /
`restore_kv_caches`); the worker is stepped every few milliseconds and every non-empty result
is printed as {"freed_holds": [...], "stats": {...}}. Exits when stdin closes.
Run: python duplex_owner.py '{"model_dir": ..., "engine_id": ..., ...}'
"""

import json
import logging
import os
import select
import sys
import time

from duplex_harness import make_kv_caches, make_worker
from kvduplex.connector.metadata import DuplexConnectorMetadata, HoldSpec


class HoldsEnded(logging.Handler):
    """Prints {"holds_ended": true, ...} once the worker's hold book ended every hold, before
    its step waits for their readers (the worker's log line says so)."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("KV caches reset (new weights)"):
            print(json.dumps({"holds_ended": True, "freed_holds": [], "stats": {}}), flush=True)


def serve(worker, command: dict) -> None:
    """One stdin command (see the module's doc)."""
    if command.get("end_holds"):
        worker.begin_step(DuplexConnectorMetadata(end_holds=True))
        print(json.dumps({"ended_holds": True, "freed_holds": [], "stats": {}}), flush=True)
    elif "sleep" in command:  # vLLM's sleep-mode hooks
        if command["sleep"]:
            worker.unregister_kv_caches()
        else:
            worker.restore_kv_caches()
    else:
        hold = HoldSpec(
            request_id=command["hold"],
            lease_expiry=time.time() + command["ttl_s"],
            num_blocks=command.get("num_blocks", 1),
            fingerprints=tuple(command["fingerprints"]),
            turn=command["turn"],
            offer=command.get("offer", "").encode(),
        )
        worker.begin_step(DuplexConnectorMetadata(holds=[hold]))


def main() -> None:
    spec = json.loads(sys.argv[1])
    kv_caches = make_kv_caches(
        spec["num_blocks"], seed=spec["seed"], layout=spec.get("layout", "LBHNC")
    )
    worker = make_worker(spec["model_dir"], spec["engine_id"], kv_caches, spec.get("extra_config"))
    worker_log = logging.getLogger("vllm.kvduplex.connector.worker_holds")
    worker_log.addHandler(HoldsEnded())
    worker_log.setLevel(logging.INFO)
    address = worker.get_handshake_metadata()
    print(json.dumps({"host": address.host, "port": address.port}), flush=True)
    # Lines are split here, not by `readline`: lines it buffered would be invisible to
    # `select` until more input came.
    pending = b""
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.005)
        lines: list[bytes] = []
        if ready:
            chunk = os.read(sys.stdin.fileno(), 1 << 16)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            serve(worker, json.loads(line))
        worker.get_transfer_results()
        meta = worker.build_connector_worker_meta()
        freed = meta.freed_holds if meta is not None else []
        stats = worker.get_kv_connector_stats()
        if freed or stats is not None:
            print(
                json.dumps(
                    {
                        "freed_holds": freed,
                        "stats": stats.data if stats is not None else {},
                    }
                ),
                flush=True,
            )
    worker.shutdown()


if __name__ == "__main__":
    main()
