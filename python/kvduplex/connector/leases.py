"""Owner-side leases: held block sets end exactly once, on release or on expiry.

A worker holds a finished request's blocks from the step the scheduler's HoldSpec arrives
until a reader's release notification names the request or the lease's TTL has passed,
whichever comes first. Each hold ends once and only once, so vLLM sees every held request in
`finished_sending` exactly once (vLLM asserts on a second report). Times are monotonic: a
wall-clock jump cannot end a lease early.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# A release can arrive before its hold when a reader is very fast; it is remembered this long,
# and at most this many are (peers cannot grow the book without bound with bogus releases).
EARLY_RELEASE_KEEP_S = 60.0
MAX_EARLY_RELEASES = 4096


class LeaseBook:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._deadlines: dict[str, float] = {}
        self._early_releases: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._deadlines)

    def hold(self, request_id: str, ttl_s: float) -> bool:
        """Start a lease; False when the reader already released it (free at once)."""
        if self._early_releases.pop(request_id, None) is not None:
            return False
        self._deadlines[request_id] = self._clock() + ttl_s
        return True

    def release(self, request_id: str) -> bool:
        """The reader is done; True when this ended a lease."""
        if self._deadlines.pop(request_id, None) is not None:
            return True
        if len(self._early_releases) >= MAX_EARLY_RELEASES:
            del self._early_releases[next(iter(self._early_releases))]
        self._early_releases[request_id] = self._clock() + EARLY_RELEASE_KEEP_S
        return False

    def expire(self) -> list[str]:
        """End and return the leases whose time is up."""
        now = self._clock()
        expired = [rid for rid, deadline in self._deadlines.items() if deadline <= now]
        for request_id in expired:
            del self._deadlines[request_id]
        for request_id, keep_until in list(self._early_releases.items()):
            if keep_until <= now:
                del self._early_releases[request_id]
        return expired
