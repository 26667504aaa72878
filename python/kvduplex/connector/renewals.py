"""A decode node renews the prefill node's lease on a prompt while the request waits in its queue.

The prefill node holds a prompt for its decode node for its own `kv_lease_ttl_s`; the decode
node asks for the grant only when vLLM's waiting loop reaches the request (`lookup.py`), so on a
decode node whose queue is longer than the lease the hold would end first and the whole prompt be
computed on the node that is already overloaded. From the moment the scheduler sees the request
(`on_new_request`) until it asks for the grant or the request ends, `Renewals` has TP rank 0 ask
the owner to renew the hold: a notification over the side channel (`protocol.encode_renewal`,
sent by `worker_lookup.py`) with the request's own first block's fingerprint, which the owner
checks like a grant (`rust/src/holds/renew.rs`: prompts held for a decode node only, unclaimed,
at most ten first leases in all). It goes with the first step built while the request waits,
then every quarter of the lease time the params had left when the request arrived. A request
that vLLM's waiting loop reaches in the step that saw it asks for its grant at once and renews
nothing. Pure: time comes in as an argument.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from kvduplex.connector import metadata as md

# Renew every this much of the lease the params had left on arrival (vLLM's NixlConnector
# renews every sixth of its lease), and at most this often.
RENEW_FRACTION = 0.25
MIN_INTERVAL_S = 0.05


@dataclass(frozen=True)
class _Queued:
    spec: md.RenewSpec
    interval: float
    entry: int
    """Its entry in the schedule (one left behind by a request gone is skipped)."""


class Renewals:
    """The requests whose owner's hold is renewed until their grant is asked; `Lookups` owns
    one."""

    def __init__(self) -> None:
        self._queued: dict[str, _Queued] = {}
        # (due, entry, request id), earliest first; entries of requests gone are dropped as
        # they come due.
        self._due: list[tuple[float, int, str]] = []
        self._entries = itertools.count()

    def add(self, request_id: str, spec: md.RenewSpec, lease_left_s: float, now: float) -> None:
        """The request's params name the owner's hold, whose lease ends in `lease_left_s`:
        renewed from the first step built at or after `now` (not at all if it has ended)."""
        if lease_left_s <= 0:
            return
        entry = next(self._entries)
        interval = max(MIN_INTERVAL_S, lease_left_s * RENEW_FRACTION)
        self._queued[request_id] = _Queued(spec, interval, entry)
        heapq.heappush(self._due, (now, entry, request_id))

    def remove(self, request_id: str) -> None:
        """The request asked for its grant, or ended: nothing more to renew."""
        self._queued.pop(request_id, None)

    def take(self, now: float) -> list[md.RenewSpec]:
        """The renewals due at `now`, for the step being built."""
        due: list[md.RenewSpec] = []
        while self._due and self._due[0][0] <= now:
            _, entry, request_id = heapq.heappop(self._due)
            queued = self._queued.get(request_id)
            if queued is None or queued.entry != entry:
                continue
            due.append(queued.spec)
            heapq.heappush(self._due, (now + queued.interval, entry, request_id))
        return due
