"""Upstream selection (least outstanding requests, rendezvous hashing on a routing key, or the
key's choice while it is not much busier than the least busy) and health: an upstream that
fails a request or a health probe is taken out of rotation and tried again after an
exponential backoff."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator

from .config import UpstreamAddress
from .errors import PoolExhausted, ResponseTooLarge, UpstreamTransportError, describe
from .metrics import ProxyMetrics
from .routing import rendezvous_score
from .upstream import Upstream
from .upstream_http import UpstreamClient

logger = logging.getLogger(__name__)

# vLLM's /health answers with an empty body; anything longer than this is not a health answer.
_MAX_HEALTH_BYTES = 64 << 10


class UpstreamPool:
    """The P servers or the D servers. Not thread-safe: used from the proxy's event loop only."""

    def __init__(
        self,
        role: str,
        targets: tuple[UpstreamAddress, ...],
        metrics: ProxyMetrics,
        *,
        backoff_initial_s: float,
        backoff_max_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.role = role
        self.upstreams = [Upstream(role, t) for t in targets]
        self._by_address = {u.address: u for u in self.upstreams}
        self._metrics = metrics
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._clock = clock
        self._rotation = 0
        for u in self.upstreams:
            self._metrics.upstream_healthy.labels(role, u.address).set(1)
            self._metrics.upstream_outstanding.labels(role, u.address).set(0)

    def get(self, address: str) -> Upstream | None:
        return self._by_address.get(address)

    def is_available(self, upstream: Upstream) -> bool:
        """In rotation, or taken out with its backoff over (it gets one trial)."""
        return upstream.healthy or upstream.retry_at <= self._clock()

    def _eligible(self, exclude: frozenset[str] = frozenset()) -> list[Upstream]:
        """What `pick` chooses from: the healthy upstreams, or else those on trial."""
        candidates = [u for u in self.upstreams if u.address not in exclude]
        healthy = [u for u in candidates if u.healthy]
        return healthy or [u for u in candidates if self.is_available(u)]

    def pick(
        self,
        exclude: frozenset[str] = frozenset(),
        key: bytes | None = None,
        slack: int | None = None,
    ) -> Upstream | None:
        """An available upstream not in `exclude`; healthy ones before those on trial. Without
        `key`: the one with the fewest requests in flight, ties going round-robin. With `key`:
        the one rendezvous hashing ranks highest for it, the same on every proxy that lists the
        same upstreams (in any order); with `slack` too, that one only while it has at most
        `slack` requests in flight more than the least busy, else the least busy."""
        pool = self._eligible(exclude)
        if not pool:
            return None
        if key is not None:
            ranked = max(pool, key=lambda u: (rendezvous_score(key, u.address), u.address))
            least = min(u.outstanding for u in pool)
            if slack is None or ranked.outstanding <= least + slack:
                return ranked
        start = self._rotation % len(pool)
        self._rotation += 1
        return min(pool[start:] + pool[:start], key=lambda u: u.outstanding)

    @contextlib.contextmanager
    def track(self, upstream: Upstream) -> Iterator[None]:
        """Count a request as outstanding on `upstream` while the block runs."""
        upstream.outstanding += 1
        gauge = self._metrics.upstream_outstanding.labels(self.role, upstream.address)
        gauge.set(upstream.outstanding)
        try:
            yield
        finally:
            upstream.outstanding -= 1
            gauge.set(upstream.outstanding)

    def mark_failed(self, upstream: Upstream, reason: str) -> None:
        upstream.consecutive_failures += 1
        backoff = min(
            self._backoff_max_s,
            self._backoff_initial_s * 2 ** (upstream.consecutive_failures - 1),
        )
        upstream.retry_at = self._clock() + backoff
        self._metrics.upstream_failures.labels(self.role, upstream.address).inc()
        if upstream.healthy:
            logger.warning(
                "%s upstream %s taken out (%s); retrying in %.1f s",
                self.role,
                upstream.address,
                reason,
                backoff,
            )
            upstream.healthy = False
            self._metrics.upstream_healthy.labels(self.role, upstream.address).set(0)
        else:
            logger.info(
                "%s upstream %s still failing (%s); retrying in %.1f s",
                self.role,
                upstream.address,
                reason,
                backoff,
            )

    def mark_ok(self, upstream: Upstream) -> None:
        upstream.consecutive_failures = 0
        if not upstream.healthy:
            logger.info("%s upstream %s back in rotation", self.role, upstream.address)
            upstream.healthy = True
            self._metrics.upstream_healthy.labels(self.role, upstream.address).set(1)

    def due_for_probe(self) -> list[Upstream]:
        """Healthy upstreams (to notice a death) and taken-out ones whose backoff is over."""
        return [u for u in self.upstreams if self.is_available(u)]

    def any_healthy(self) -> bool:
        return any(u.healthy for u in self.upstreams)


async def probe(
    pool: UpstreamPool, upstream: Upstream, client: UpstreamClient, timeout_s: float
) -> None:
    """GET /health on one upstream; updates its state. vLLM answers 200 while its engine runs.
    A probe that finds every one of the proxy's connections in use says nothing of the
    upstream (the proxy is busy): its state stays, and the next interval probes again."""
    try:
        status, _ = await client.fetch(
            "GET", f"{upstream.base_url}/health", timeout_s=timeout_s, limit=_MAX_HEALTH_BYTES
        )
    except PoolExhausted:
        logger.debug("%s upstream %s not probed: no free connection", pool.role, upstream.address)
        return
    except UpstreamTransportError as exc:
        pool.mark_failed(upstream, f"health probe: {exc}")
        return
    except ResponseTooLarge as exc:
        pool.mark_failed(upstream, f"health probe: {describe(exc)}")
        return
    if status != 200:
        pool.mark_failed(upstream, f"health probe: HTTP {status}")
        return
    pool.mark_ok(upstream)


async def probe_all(pools: list[UpstreamPool], client: UpstreamClient, timeout_s: float) -> None:
    await asyncio.gather(
        *(probe(pool, u, client, timeout_s) for pool in pools for u in pool.due_for_probe())
    )


async def run_health_checks(
    pools: list[UpstreamPool], client: UpstreamClient, interval_s: float, timeout_s: float
) -> None:
    """Probe forever, every `interval_s`; cancelled at proxy shutdown."""
    while True:
        await probe_all(pools, client, timeout_s)
        await asyncio.sleep(interval_s)
