"""An owner-side DuplexWorker in its own process, for the two-process worker tests.

Builds KV caches filled from a seed (in vLLM's KV cache layout "layout", LBHNC by default),
registers them, prints its side-channel address as one JSON line, then serves: each stdin line
{"hold": request_id, "ttl_s": seconds, "fingerprints", "turn", optionally "num_blocks", "offer"}
hands the worker a HoldSpec, as the scheduler would, and {"end_holds": true} the order vLLM's
cache reset leads to (`end_holds`; once that step's `begin_step` returned, {"ended_holds":
true, ...} is printed); the worker is stepped every few milliseconds and every non-empty result
is printed as {"freed_holds": [...], "stats": {...}}. Exits when
stdin closes. Run: python duplex_owner.py '{"model_dir": ..., "engine_id": ..., ...}'
"""

import json
import select
import sys
import time

from duplex_harness import make_kv_caches, make_worker
from kvduplex.connector.metadata import DuplexConnectorMetadata, HoldSpec


def main() -> None:
    spec = json.loads(sys.argv[1])
    kv_caches = make_kv_caches(
        spec["num_blocks"], seed=spec["seed"], layout=spec.get("layout", "LBHNC")
    )
    worker = make_worker(spec["model_dir"], spec["engine_id"], kv_caches, spec.get("extra_config"))
    address = worker.get_handshake_metadata()
    print(json.dumps({"host": address.host, "port": address.port}), flush=True)
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.005)
        if ready:
            line = sys.stdin.readline()
            if not line:
                break
            command = json.loads(line)
            if command.get("end_holds"):
                worker.begin_step(DuplexConnectorMetadata(end_holds=True))
                print(json.dumps({"ended_holds": True, "freed_holds": [], "stats": {}}), flush=True)
                continue
            hold = HoldSpec(
                request_id=command["hold"],
                lease_expiry=time.time() + command["ttl_s"],
                num_blocks=command.get("num_blocks", 1),
                fingerprints=tuple(command["fingerprints"]),
                turn=command["turn"],
                offer=command.get("offer", "").encode(),
            )
            worker.begin_step(DuplexConnectorMetadata(holds=[hold]))
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
