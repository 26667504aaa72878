"""The KV cache layout cases of `gpu_check.py`, also run on the CPU by
`tests/test_gpu_check_layouts.py`.

vLLM 0.32 gives every attention layer one logical shape, `[blocks, kv_heads, block_size,
2 * head_size]`, in the strides of its resolved `KVCacheLayout` (token-major LBNHC, "NHD", by
default for FlashAttention and Triton; head-major LBHNC, "HND", for FlashInfer on Blackwell, the
CPU backend, and where a connector asks for it, as DuplexConnector does). Here caches laid out
as vLLM does (`kvduplex_testing.kv_caches`, checked against vLLM's own allocation by the tests)
go through the connector's own layout code (`kvduplex.connector.kv_layout`, `tp`), and an owner
process serves them to this one through kvduplex:

- same TP, same layout: whole pages, byte for byte;
- token-major owner, head-major reader, the same logical shape: refused at the handshake;
- TP 1 owner, TP 2 reader ranks, head-major (LBHNC, BLHNC): each rank reads its heads, a slice
  of every page, byte for byte; a token-major side at another TP size: refused;
- LHBNC, BHLNC (a layer's page of a block is not one byte range): refused at start.

Every check compares values, not only bytes read: a page paired with the wrong layout reads
without error and holds the wrong KV. `python benches/_gpu_layouts.py owner DEVICE SHAPE`
is the owner process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from kvduplex import _core
from kvduplex.connector import tp
from kvduplex.connector.kv_layout import describe_kv_caches, head_major_bytes, page_layout
from kvduplex_testing.kv_caches import vllm_kv_caches

SEED = 20261207
# A Llama-3-8B-like layer at a quarter of its depth: 8 KV heads of 128, bf16, blocks of 16.
GPU_SHAPE = {
    "num_layers": 8, "num_blocks": 64, "kv_heads": 8, "block_size": 16, "head_size": 128,
    "dtype": "bfloat16",
}
# (owner layout, owner TP size, reader layout, reader TP size, what must happen), grouped by
# owner layout: the owner process serves each in turn.
CASES = [
    ("LBHNC", 1, "LBHNC", 1, "read"),
    ("LBHNC", 1, "LBNHC", 1, "refused"),
    ("LBHNC", 1, "LBHNC", 2, "read"),
    ("LBHNC", 1, "BLHNC", 2, "read"),
    ("LBHNC", 1, "LBNHC", 2, "refused"),
    ("LBNHC", 1, "LBNHC", 1, "read"),
    ("LBNHC", 1, "LBHNC", 1, "refused"),
    ("LBNHC", 1, "LBHNC", 2, "refused"),
    ("BLHNC", 1, "LBHNC", 2, "read"),
]
# A layer's page of one block is several runs in these: refused when described.
SPLIT_PAGES = ("LHBNC", "BHLNC")


def _caches(shape: dict, layout: str, tp_size: int, device: str, seed: int | None) -> dict:
    return vllm_kv_caches(
        layout,
        num_layers=shape["num_layers"],
        num_blocks=shape["num_blocks"],
        kv_heads=shape["kv_heads"] // tp_size,
        block_size=shape["block_size"],
        head_size=shape["head_size"],
        dtype=getattr(torch, shape["dtype"]),
        device=device,
        seed=seed,
    )


def _engine(name: str, shape: dict, caches: dict, tp_size: int) -> tuple[_core.Engine, int | None]:
    """An engine serving `caches` as the connector's worker registers them: the layout's
    segments, and the page layout in its fingerprint. Returns it and the head-major head bytes."""
    layout = describe_kv_caches(caches, shape["num_blocks"])
    head_bytes = head_major_bytes(caches, layout, shape["kv_heads"] // tp_size)
    fingerprint = {"check": "gpu-layouts", "page_layout": page_layout(caches, head_bytes, tp_size)}
    engine = _core.Engine(name, fingerprint, host="127.0.0.1")
    for addr, length in layout.regions:
        engine.register_region(addr, length)
    engine.set_layout(
        list(layout.segment_bases), layout.block_len, layout.block_stride, layout.num_blocks
    )
    return engine, head_bytes


def owner(device: str, shape: dict) -> None:
    """Serves each owner layout of `CASES` in turn (one engine at a time), each announced as a
    JSON line; the next once "next" is read."""
    for layout in dict.fromkeys(case[0] for case in CASES):
        caches = _caches(shape, layout, 1, device, SEED)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        engine, _ = _engine(f"layout-owner-{layout}", shape, caches, 1)
        print(json.dumps({"layout": layout, "port": engine.side_channel_port}), flush=True)
        answer = sys.stdin.readline().strip()
        engine.close()
        if answer != "next":
            return


def check(device: str, shape: dict = GPU_SHAPE) -> list[dict]:
    """Runs every case against an owner process on `device`; one row per case (and per
    split-page layout), `ok` when what happened is what must."""
    rows = [_split_page_row(layout, device, shape) for layout in SPLIT_PAGES]
    child = subprocess.Popen(
        [sys.executable, str(Path(__file__)), "owner", device, json.dumps(shape)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        served = None
        for owner_layout, owner_tp, reader_layout, reader_tp, must in CASES:
            if served is None or served["layout"] != owner_layout:
                if served is not None:
                    child.stdin.write("next\n")
                    child.stdin.flush()
                line = child.stdout.readline()
                if not line:
                    raise RuntimeError(f"the layout owner process exited with {child.wait()}")
                served = json.loads(line)
                if served["layout"] != owner_layout:
                    raise RuntimeError(f"the owner serves {served['layout']}, not {owner_layout}")
            expected = _caches(shape, owner_layout, owner_tp, device, SEED)
            outcome = _read_case(device, shape, served["port"], expected, reader_layout, reader_tp)
            rows.append(
                {
                    "case": f"{owner_layout} TP{owner_tp} -> {reader_layout} TP{reader_tp}",
                    "must": must,
                    "outcome": outcome,
                    "ok": outcome == must,
                }
            )
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    return rows


def _split_page_row(layout: str, device: str, shape: dict) -> dict:
    try:
        describe_kv_caches(_caches(shape, layout, 1, device, None), shape["num_blocks"])
        outcome = "described"
    except ValueError:
        outcome = "refused"
    ok = outcome == "refused"
    return {"case": f"{layout} at start", "must": "refused", "outcome": outcome, "ok": ok}


def _read_case(device, shape, port, expected, reader_layout, reader_tp) -> str:
    """'read' when every reader rank's blocks hold exactly its heads of the owner's, 'refused'
    when the handshake refused the pair (naming the page layout) and nothing was written, else
    what went wrong."""
    num_blocks, heads = shape["num_blocks"], shape["kv_heads"] // reader_tp
    remote = list(range(0, num_blocks, 2))  # every other block: scattered reads
    local = list(reversed(range(num_blocks // 2)))
    outcomes = set()
    for rank in range(reader_tp):
        caches = _caches(shape, reader_layout, reader_tp, device, None)
        engine, head_bytes = _engine(f"layout-reader-{rank}", shape, caches, reader_tp)
        try:
            try:
                peer = engine.connect("127.0.0.1", port, timeout_s=30)
            except _core.IncompatiblePeerError as exc:
                written = any(bool(t.any()) for t in caches.values())
                outcomes.add("refused" if "page_layout" in str(exc) and not written else str(exc))
                continue
            reads = tp.rank_reads(shape["kv_heads"], reader_tp, rank, 1, head_bytes)
            for read in reads:
                engine.read_blocks(
                    peer, local, remote, timeout_s=60, block_slice=read.block_slice
                ).wait(60)
            theirs = slice(rank * heads, (rank + 1) * heads)
            exact = all(
                torch.equal(caches[name][local], expected[name][remote][:, theirs])
                for name in caches
            )
            untouched = sorted(set(range(num_blocks)) - set(local))
            exact = exact and not any(bool(t[untouched].any()) for t in caches.values())
            outcomes.add("read" if exact else "bytes differ")
        finally:
            engine.close()
    return outcomes.pop() if len(outcomes) == 1 else " / ".join(sorted(outcomes))


if __name__ == "__main__" and sys.argv[1:2] == ["owner"]:
    owner(sys.argv[2], json.loads(sys.argv[3]))
