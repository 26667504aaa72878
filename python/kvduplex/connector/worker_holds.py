"""Owner side of the worker: TP rank 0's hold book on the transfer core.

Only TP rank 0 keeps the hold book (holds, grants, claims, expiry, eviction: decided once, for
every rank's blocks, which share block ids); `WorkerHolds` reports each ended hold in
`DuplexWorkerMetadata.freed_holds` exactly once (the scheduler's record of what each hold pins,
`holds.py`, drops the blocks' references). Every hold ends when vLLM resets its caches
(`end_all`): held KV is bound to the weights only by that, and the scheduler has given the
blocks back to vLLM already. Other ranks take their notifications (and ignore them) and hold
nothing.
"""

from __future__ import annotations

import time

from vllm.logger import init_logger

from kvduplex import _core, protocol
from kvduplex.connector import metadata as md
from kvduplex.connector import retention
from kvduplex.connector.stats import DuplexConnectorStats

# Under vLLM's logger tree, so vLLM's handler, format and level apply.
logger = init_logger(f"vllm.{__name__}")

# How often TP rank 0 looks again whether the readers of ended holds are done.
_DRAIN_POLL_S = 0.001


class WorkerHolds:
    """One worker's side of its engine's hold book; `DuplexWorker` owns one and sets `engine`
    once the KV caches are registered (None before, and after shutdown)."""

    def __init__(self, tp_rank: int, stats: DuplexConnectorStats) -> None:
        self.engine: _core.Engine | None = None
        self._tp_rank = tp_rank
        self._stats = stats
        self._freed_holds: list[str] = []
        self._claims = 0
        self._awaited = 0

    def take_report(self) -> list[str]:
        """The holds ended since the last report (the step's eviction order is done with the
        step: `retention.py`)."""
        freed, self._freed_holds = self._freed_holds, []
        return freed

    def hold(self, hold: md.HoldSpec) -> None:
        """TP rank 0 keeps the engine's holds (see the module docstring)."""
        if self._tp_rank != 0:
            return
        if self.engine is None:
            self._freed_holds.append(hold.request_id)
            return
        try:
            self.engine.hold(
                hold.request_id,
                hold.num_blocks,
                # The moment the scheduler counts too (and the params announce), not a TTL
                # from now: the scheduler wakes an idle engine then (`holds.py`), and
                # the hold must have ended when that step looks.
                hold.lease_expiry,
                fingerprints=list(hold.fingerprints),
                turn=hold.turn,
                offer=hold.offer,
                prompt_blocks=hold.prompt_blocks,
            )
        except ValueError as exc:
            # E.g. a turn too long to offer: nobody can be granted it, free it now.
            logger.warning("Not holding request %s's blocks for readers: %s", hold.request_id, exc)
            self._freed_holds.append(hold.request_id)
            return
        if hold.turn:
            self._stats.add("turns_offered")

    def end_all(self) -> None:
        """vLLM reset its caches, as it does for a weight update (`holds.py`): the held
        KV was computed with other weights, and the scheduler gave the blocks back to vLLM,
        which may hand them to a request of this very step. TP rank 0 ends every hold at once,
        under the hold book's lock (none is granted again; unclaimed ones are freed now), then
        waits until no reader reads one (released, or past its claim's deadline, by which its
        reads fail) before anything of this step writes KV: a peer never reads a block that a
        new request's forward pass or pull is writing."""
        if self.engine is None or self._tp_rank != 0:
            return
        freed = self.engine.end_holds()
        self._freed_holds.extend(freed)
        logger.info(
            "KV caches reset (new weights): every held block set ended, %d freed at once",
            len(freed),
        )
        left = self.engine.ended_claims_s()
        if left is None:
            return
        logger.info("Waiting up to %.1f s for the readers of ended holds to be done", left)
        started = time.monotonic()
        while left is not None:
            time.sleep(min(left, _DRAIN_POLL_S))
            self.take_notifications()  # their releases
            self.expire()  # claims past their deadline
            left = self.engine.ended_claims_s()
        logger.info("The readers of ended holds were done after %.3f s", time.monotonic() - started)

    def expect(self, turn: md.ExpectedTurn) -> None:
        """TP rank 0 answers lookups that extend a turn in flight with "ask again"
        (`expected_turns.py`)."""
        if self.engine is None or self._tp_rank != 0:
            return
        try:
            self.engine.expect_turn(turn.request_id, turn.end)
        except ValueError as exc:
            logger.warning("Request %s's turn is not expected: %s", turn.request_id, exc)

    def evict(self, order: md.EvictOrder) -> None:
        """TP rank 0 frees unclaimed holds; the step's report says which (`retention.py`)."""
        if self.engine is None or self._tp_rank != 0:
            return
        for request_id in self.engine.evict_holds(order.cap_blocks) if order.cap_blocks else ():
            self._freed_holds.append(request_id)
            self._stats.add("evictions")
            logger.debug("Held turn %s evicted to make room for new turns", request_id)
        freed: list[str] = []
        if order.turn_blocks:
            unread_s = retention.UNREAD_PROMPT_S - retention.UNREAD_MARGIN_S
            freed += self.engine.evict_holds(order.turn_blocks, unread_prompts_s=unread_s)
        if order.any_blocks:
            freed += self.engine.evict_holds(order.any_blocks, prompts=True)
        for request_id in freed:
            self._freed_holds.append(request_id)
            self._stats.add("pressure_evictions")
        if freed:
            logger.info(
                "Gave up %d held block set(s) (%s) for %d blocks the engine's requests need",
                len(freed),
                ", ".join(freed[:4]),
                order.turn_blocks + order.any_blocks,
            )

    def record_occupancy(self) -> None:
        """Claims alive on this engine's holds (TP rank 0), for the stats when it changes,
        and the lookups it told to ask again since the last step."""
        if self.engine is None or self._tp_rank != 0:
            return
        claims, _, awaited = self.engine.hold_occupancy()
        if claims != self._claims:
            self._claims = claims
            self._stats.set_gauge("claims", claims)
        if awaited != self._awaited:
            self._stats.add("lookups_awaited", awaited - self._awaited)
            self._awaited = awaited

    def take_notifications(self) -> None:
        if self.engine is None:
            return
        for sender, payload in self.engine.take_notifications():
            note = protocol.decode_notification(payload)
            if note is None:
                version = protocol.PROTOCOL_VERSION  # (a peer of another version, or malformed)
                logger.warning("Ignoring a notification from %s: not protocol %d's", sender, version)
                continue
            if self._tp_rank != 0:
                continue
            try:
                if isinstance(note, protocol.Renewal):  # (`renewals.py`)
                    if self.engine.renew_hold(note.owner_request_id, note.first_fingerprint):
                        self._stats.add("leases_renewed")
                    continue
                freed = self.engine.release_hold(
                    sender, note.owner_request_id, note.claim_id
                )
            except (ValueError, OverflowError, _core.KvDuplexError) as exc:
                logger.warning("Ignoring a notification from %s: %s", sender, exc)
                continue
            if freed:
                self._freed_holds.append(note.owner_request_id)
                self._stats.add("leases_released")

    def expire(self) -> None:
        if self.engine is None:
            return
        for request_id in self.engine.expire_holds():
            self._freed_holds.append(request_id)
            self._stats.add("lease_expiries")
            logger.debug("Hold of request %s ended; its blocks are freed", request_id)
