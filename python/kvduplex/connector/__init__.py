"""kvduplex's vLLM KV connector.

Enable with `--kv-transfer-config '{"kv_connector": "DuplexConnector",
"kv_connector_module_path": "kvduplex.connector", "kv_role": "kv_both", ...}'`.
"""

from kvduplex.connector.connector import DuplexConnector

__all__ = ["DuplexConnector"]
