"""One P or D server as the proxy keeps it: its address, its requests in flight, and whether it
is in rotation (`balancer.UpstreamPool` changes it; the errors and the relay name it)."""

from __future__ import annotations

import dataclasses

from .config import UpstreamAddress


@dataclasses.dataclass
class Upstream:
    role: str
    target: UpstreamAddress
    outstanding: int = 0
    healthy: bool = True
    consecutive_failures: int = 0
    # While taken out: when a request or probe may try it again (balancer clock).
    retry_at: float = 0.0

    @property
    def address(self) -> str:
        return self.target.address

    @property
    def base_url(self) -> str:
        return self.target.base_url
