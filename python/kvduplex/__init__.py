"""kvduplex: bidirectional KV-cache transfer between vLLM engines over UCX one-sided reads."""

import os


def _default_ucx_lib_dir() -> str | None:
    """The `libucx` wheel's library directory, where the Rust core loads UCX from."""
    try:
        import libucx
    except ImportError:
        return None
    return os.path.join(os.path.dirname(libucx.__file__), "lib")


if "KVDUPLEX_UCX_LIB_DIR" not in os.environ and (_dir := _default_ucx_lib_dir()):
    os.environ["KVDUPLEX_UCX_LIB_DIR"] = _dir

__version__ = "0.1.0"
