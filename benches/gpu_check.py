"""kvduplex on a CUDA GPU: two processes read CUDA-resident blocks from each other.

`python benches/gpu_check.py [--device N] [--json OUT]` starts an owner process whose KV-like
buffer lives in GPU memory (filled from a seed on the GPU), and reads its blocks from a second
process's GPU buffer through kvduplex (UCX picks `cuda_ipc` / `cuda_copy` for device memory),
for blocks of 64 KiB, 256 KiB and 1 MiB: every byte is checked on the GPU against the same
seeded pattern, and the read's GB/s (median of several batches of a scattered half of the
blocks) is printed next to a same-run device-to-device copy of the same bytes (`torch`).
Exit status: 0 when every byte matched (or there is no CUDA GPU: it says so and does nothing),
1 on a mismatch or failure.

Both processes use one GPU unless `--owner-device` differs (two GPUs on one host: cuda_ipc
over NVLink/PCIe). UCX comes from the `libucx-cu12` wheel as everywhere in kvduplex.

Then the KV cache layout cases (`_gpu_layouts.py`): vLLM-shaped CUDA caches in each of vLLM
0.32's layouts, through the connector's layout code: token-major and head-major pages of the
same shape refused at the handshake, heterogeneous-TP slices of head-major pages read and
compared value for value, pages that are not one byte range refused at start. They need
`kvduplex.connector` and `kvduplex_testing` importable (PYTHONPATH=python), not vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BLOCK_SIZES = (64 << 10, 256 << 10, 1 << 20)
REGION_BYTES = 256 << 20
BATCHES = 7
SEED = 20261203


def pattern(torch, device: str, nbytes: int):
    generator = torch.Generator(device=device).manual_seed(SEED)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=generator)


def engine_for(name: str, buffer, block_bytes: int):
    from kvduplex._core import Engine

    engine = Engine(name, {"check": "gpu", "block_bytes": str(block_bytes)}, host="127.0.0.1")
    engine.register_region(buffer.data_ptr(), buffer.numel())
    engine.set_layout([buffer.data_ptr()], block_bytes, block_bytes, buffer.numel() // block_bytes)
    return engine


def owner(device: str) -> None:
    """Serves its GPU buffer; one engine per block size, announced as a JSON line."""
    import torch

    buffer = pattern(torch, device, REGION_BYTES)
    torch.cuda.synchronize(device)
    for block_bytes in BLOCK_SIZES:
        engine = engine_for(f"gpu-owner-{block_bytes}", buffer, block_bytes)
        print(json.dumps({"block_bytes": block_bytes, "port": engine.side_channel_port}), flush=True)
        if sys.stdin.readline().strip() != "next":
            engine.close()
            return
        engine.close()


def reader(device: str, owner_device: str) -> dict:
    import torch

    child = subprocess.Popen(
        [sys.executable, __file__, "--role", "owner", "--device", owner_device],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    results = []
    try:
        expected = pattern(torch, device, REGION_BYTES)
        destination = torch.zeros(REGION_BYTES, dtype=torch.uint8, device=device)
        for block_bytes in BLOCK_SIZES:
            line = child.stdout.readline()
            if not line:
                raise RuntimeError(f"the owner process exited with {child.wait()}")
            port = json.loads(line)["port"]
            engine = engine_for(f"gpu-reader-{block_bytes}", destination, block_bytes)
            try:
                peer = engine.connect("127.0.0.1", port, timeout_s=30)
                num_blocks = REGION_BYTES // block_bytes
                remote = list(range(0, num_blocks, 2))  # every other block: scattered reads
                local = list(reversed(range(num_blocks // 2)))
                seconds = []
                for _ in range(BATCHES):
                    destination.zero_()
                    torch.cuda.synchronize(device)
                    started = time.perf_counter()
                    engine.read_blocks(peer, local, remote, timeout_s=60).wait(60)
                    seconds.append(time.perf_counter() - started)
                views = destination.view(num_blocks, block_bytes)
                source = expected.view(num_blocks, block_bytes)
                matched = bool(torch.equal(views[local], source[remote]))
                nbytes = len(remote) * block_bytes
                copy_s = device_copy_seconds(torch, device, nbytes)
                results.append(
                    {
                        "block_bytes": block_bytes,
                        "blocks": len(remote),
                        "bytes_match": matched,
                        "kvduplex_GBps": nbytes / statistics.median(seconds) / 1e9,
                        "device_copy_GBps": nbytes / copy_s / 1e9,
                    }
                )
            finally:
                engine.close()
            child.stdin.write("next\n")
            child.stdin.flush()
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    return {"device": torch.cuda.get_device_name(device), "results": results}


def device_copy_seconds(torch, device: str, nbytes: int) -> float:
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    seconds = []
    for _ in range(BATCHES):
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        target.copy_(source)
        torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=("reader", "owner"), default="reader")
    parser.add_argument("--device", type=int, default=0, help="the reader's CUDA device")
    parser.add_argument("--owner-device", type=int, help="the owner's CUDA device (default: same)")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed; nothing to check")
        return 0
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU on this machine; nothing to check")
        return 0
    device = f"cuda:{args.device}"
    if args.role == "owner":
        owner(device)
        return 0
    owner_device = f"cuda:{args.owner_device if args.owner_device is not None else args.device}"
    report = reader(device, owner_device)
    print(f"{'block':>8} {'blocks':>7} {'bytes':>6} {'kvduplex GB/s':>14} {'d2d copy GB/s':>14}")
    for row in report["results"]:
        print(
            f"{row['block_bytes'] >> 10:>6}Ki {row['blocks']:>7} "
            f"{'ok' if row['bytes_match'] else 'WRONG':>6} {row['kvduplex_GBps']:>14.1f} "
            f"{row['device_copy_GBps']:>14.1f}"
        )
    import _gpu_layouts

    report["layouts"] = _gpu_layouts.check(device)
    print(f"\n{'layout case':<32} {'must':>8} {'outcome':>10}")
    for row in report["layouts"]:
        flag = "" if row["ok"] else "  WRONG"
        print(f"{row['case']:<32} {row['must']:>8} {row['outcome']:>10}{flag}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    matched = all(row["bytes_match"] for row in report["results"])
    return 0 if matched and all(row["ok"] for row in report["layouts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
