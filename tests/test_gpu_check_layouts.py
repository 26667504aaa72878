"""`benches/gpu_check.py`'s KV cache layout cases, run here on CPU tensors (the same code; a
GPU run checks them on CUDA memory), and importable where vLLM is not installed (the GPU
machines have none)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCHES = Path(__file__).resolve().parent.parent / "benches"
sys.path.insert(0, str(BENCHES))

import _gpu_layouts  # noqa: E402

SMALL = {
    "num_layers": 2, "num_blocks": 16, "kv_heads": 4, "block_size": 16, "head_size": 32,
    "dtype": "float32",
}


def test_every_layout_case_does_what_it_must_on_cpu_tensors():
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    rows = _gpu_layouts.check("cpu", SMALL)
    assert [row for row in rows if not row["ok"]] == []
    assert len(rows) == len(_gpu_layouts.CASES) + len(_gpu_layouts.SPLIT_PAGES)
    assert {row["outcome"] for row in rows} == {"read", "refused"}


def test_the_layout_cases_import_no_vllm():
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(BENCHES)!r})\n"
        "import _gpu_layouts\n"
        "print('vllm' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
