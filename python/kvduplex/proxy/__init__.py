"""`kvduplex proxy`: the multi-turn P/D router. See `app.create_app` and `config.ProxyConfig`."""

from .app import create_app
from .config import ProxyConfig, UpstreamAddress, parse_upstream, parse_upstream_list

__all__ = ["ProxyConfig", "UpstreamAddress", "create_app", "parse_upstream", "parse_upstream_list"]
