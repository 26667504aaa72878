"""kvduplex as a new user gets it: the wheel `maturin build` makes, `pip install`ed into a clean
virtual environment (no system site-packages, none of this repository's environment), with only
the dependencies the wheel declares. Then the CLI, the missing-extra messages, and one two-engine
transfer run from that environment.

Needs the network to PyPI for the wheel's dependencies (libucx-cu12); the wheel build reuses the
repository's cargo target directory, so it only recompiles what changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

# A second release build and a venv installed from PyPI: `make test` runs it, `make test-fast` not.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SUBCOMMANDS = ("proxy", "demo")
PROXY_MESSAGE = "kvduplex proxy needs the 'proxy' extra: pip install 'kvduplex[proxy]'"


def run(cmd: list[str], *, env: dict[str, str], cwd: Path, timeout: float):
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def clean_env(venv: Path) -> dict[str, str]:
    """The environment a user's shell would have with `venv` activated: nothing pointing into
    this repository's .venv (the Makefile exports KVDUPLEX_UCX_LIB_DIR there), no PYTHONPATH."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTHON", "KVDUPLEX_", "UCX_", "VIRTUAL_ENV", "CONDA"))
    }
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["UCX_NET_DEVICES"] = "lo"
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # `-i sys.executable`: the interpreter `make build` (maturin develop in .venv) uses, so the
    # cargo fingerprints match and neither build invalidates the other's artifacts.
    cmd = [sys.executable, "-m", "maturin", "build", "--release", "-i", sys.executable, "-o", str(out)]
    started = time.monotonic()
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"maturin build failed:\n{result.stdout}\n{result.stderr}"
    print(f"\nwheel built in {time.monotonic() - started:.1f} s")
    (path,) = out.glob("kvduplex-*.whl")
    return path


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A fresh venv with the wheel and what it declares installed, nothing else."""
    root = tmp_path_factory.mktemp("clean-venv")
    venv = root / "venv"
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = clean_env(venv)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    pip = run([*pip, str(wheel)], env=env, cwd=root, timeout=600)
    assert pip.returncode == 0, f"pip install of the wheel failed:\n{pip.stdout}\n{pip.stderr}"
    print(f"\nclean venv with the wheel installed in {time.monotonic() - started:.1f} s")
    return venv, env


def test_wheel_is_manylinux_abi3(wheel):
    # Tag: cp310-abi3-manylinux_2_XX_<arch> (pyproject: compatibility = "pypi" never falls back
    # to a plain `linux` tag).
    name_tags = wheel.name.removesuffix(".whl").split("-")[2:]
    assert name_tags[:2] == ["cp310", "abi3"], wheel.name
    assert name_tags[2].startswith("manylinux_"), wheel.name
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = zf.read(metadata_name).decode()
        # The license the metadata declares, its text beside the metadata.
        (license_name,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        license_text = zf.read(license_name).decode()
        modules = sorted(n for n in names if n.endswith((".py", ".pyi")))
        sources = {n: zf.read(n).decode() for n in modules}
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "kvduplex/_core.abi3.so" in names
    # The product and the demo's servers and model; the tests' harness stays in the checkout:
    # nothing shipped imports it, nor pins servers to CPUs (`kvduplex_testing.servers`).
    assert not [n for n in modules if not n.startswith("kvduplex/")], modules
    assert "kvduplex/demo/servers.py" in modules and "kvduplex/demo/tiny_model.py" in modules
    harness = ("from kvduplex_testing", "import kvduplex_testing", "sched_setaffinity")
    assert not [n for n, text in sources.items() if any(h in text for h in harness)]
    assert "Requires-Dist: libucx-cu12" in metadata
    for extra in ("proxy", "demo"):
        assert f"Provides-Extra: {extra}" in metadata


def test_cli_help_lists_subcommands(venv):
    venv_dir, env = venv
    result = run([str(venv_dir / "bin" / "kvduplex"), "--help"], env=env, cwd=venv_dir, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    for command in SUBCOMMANDS:
        assert command in result.stdout
    # Without their extras, both are listed as not installed.
    assert result.stdout.count("[not installed]") == len(SUBCOMMANDS), result.stdout


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["proxy", "--help"], PROXY_MESSAGE),
        (["proxy", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"], PROXY_MESSAGE),
        (["demo"], "kvduplex demo needs vLLM >= 0.32"),
    ],
)
def test_subcommand_without_its_extra_names_it_in_one_line(venv, argv, expected):
    venv_dir, env = venv
    result = run([str(venv_dir / "bin" / "kvduplex"), *argv], env=env, cwd=venv_dir, timeout=60)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(expected), lines[0]


def test_connector_without_vllm_names_the_requirement(venv):
    venv_dir, env = venv
    python = str(venv_dir / "bin" / "python")
    # Its settings import without vLLM; the connector class, which vLLM loads, names it.
    code = "import kvduplex.connector.config\nfrom kvduplex.connector import DuplexConnector"
    result = run([python, "-c", code], env=env, cwd=venv_dir, timeout=60)
    assert result.returncode == 1
    assert "ImportError: kvduplex.connector needs vLLM >= 0.32 (tested: 0.32, 0.33; pip install vllm" in result.stderr
    assert "line 2" in result.stderr, result.stderr


def test_two_engine_transfer_from_the_installed_wheel(venv):
    venv_dir, env = venv
    python = str(venv_dir / "bin" / "python")
    # Run from the venv, not the repository, so `kvduplex` can only come from the installed wheel.
    script = str(ROOT / "tests" / "wheel_transfer.py")
    result = run([python, script], env=env, cwd=venv_dir, timeout=120)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert Path(report["kvduplex"]).is_relative_to(venv_dir), report["kvduplex"]
    # `connect` answers a handle of the checked connection: "<engine id>@<address>#<n>".
    assert report["peer"].startswith("owner@127.0.0.1:")
    assert report["nbytes"] == 6 * 4096
    assert report["notification"]["payload"] == "wheel-check-done"
    assert report["notification"]["from"].startswith("reader#"), report["notification"]


def test_proxy_extra_is_enough_for_the_proxy(wheel, tmp_path):
    """`pip install 'kvduplex[proxy]'` (own venv, so the tests above keep seeing no extras)."""
    venv_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv_dir)], check=True, timeout=120)
    env = clean_env(venv_dir)
    pip = [str(venv_dir / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    installed = run([*pip, f"kvduplex[proxy] @ {wheel.as_uri()}"], env=env, cwd=tmp_path, timeout=600)
    assert installed.returncode == 0, f"{installed.stdout}\n{installed.stderr}"
    kvduplex = str(venv_dir / "bin" / "kvduplex")
    result = run([kvduplex, "--help"], env=env, cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("[not installed]") == 1, result.stdout  # demo still needs vLLM
    result = run([kvduplex, "proxy", "--help"], env=env, cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--prefill" in result.stdout and "--store" in result.stdout
