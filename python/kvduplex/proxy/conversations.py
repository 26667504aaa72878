"""The conversation store as a turn uses it: D's params taken at the turn's start (`recall`),
D's new params kept from its answer (`remember`). A store outage never fails a request: the turn
recomputes, or its next one does."""

from __future__ import annotations

import logging
from typing import Any

from ..protocol import DO_REMOTE_DECODE
from .balancer import UpstreamPool
from .errors import describe
from .metrics import LOOKUP_DECODE_UNAVAILABLE, ProxyMetrics
from .store import ConversationKey, ConversationStore, Lookup
from .upstream import Upstream

logger = logging.getLogger(__name__)


class Conversations:
    def __init__(self, store: ConversationStore, decode: UpstreamPool, metrics: ProxyMetrics):
        self.store = store
        self._decode = decode
        self._metrics = metrics

    async def recall(
        self, key: ConversationKey | None
    ) -> tuple[str, Upstream | None, dict[str, Any] | None]:
        """Take the conversation's entry, and count the lookup: (lookup result, D holding its
        blocks, D's params)."""
        if key is None:
            return "none", None, None
        try:
            lookup, entry = await self.store.take(key)
        except Exception as exc:  # a store outage must not fail the request: it recomputes
            logger.warning("conversation store unavailable, turn recomputes: %s", describe(exc))
            self._metrics.errors.labels("store").inc()
            lookup, entry = Lookup.MISS, None
        result = lookup.value
        pinned = None
        params = None
        if entry is not None:
            holder = self._decode.get(entry.decode)
            if holder is not None and self._decode.is_available(holder):
                pinned, params = holder, entry.params
            else:
                result = LOOKUP_DECODE_UNAVAILABLE
        self._metrics.conversation_lookups.labels(result).inc()
        return result, pinned, params

    async def remember(self, key: ConversationKey | None, upstream: Upstream, params: Any) -> None:
        """Keep D's params for the next turn when D holds the blocks for a readback."""
        if key is None or not isinstance(params, dict) or not params.get(DO_REMOTE_DECODE):
            return
        try:
            result = await self.store.put(key, upstream.address, params)
        except Exception as exc:  # a store outage must not fail the request
            logger.warning("conversation store unavailable, not remembering: %s", describe(exc))
            self._metrics.errors.labels("store").inc()
            return
        if result.stored:
            self._metrics.conversations_stored.inc()
        if result.evicted:
            self._metrics.conversation_evictions.inc(result.evicted)
