"""Worker side of lookups and grants: TP rank 0 asks the owners on its transfer core.

The scheduler sends one `md.LookupSpec` per grant or lookup (`lookup.py`). TP rank 0 asks the
owner the params named for a grant, or (a lookup) every engine its transfer core knows as a
reader (decode nodes that pulled from us announce their side channel in the handshake) plus
`decode_peers`. The transfer core asks them all at once and takes their replies on its own
threads (no GIL); `WorkerLookups` reports each lookup once in `DuplexWorkerMetadata.lookups`:
when every owner answered, when one holds every block asked (chained fingerprints: none can give
more), or at the lookup's deadline (the one the scheduler set) with whatever answered. The
claims of answers that come after it go back to their owners as they arrive. TP rank 0 also
connects ahead of time to every engine a lookup would ask, so that a lookup rarely pays for a
handshake, and tells the scheduler how many there are (it looks nothing up while there are
none). Before a grant is asked, it sends the owner the renewals of its hold that the scheduler's
queued requests need (`renewals.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vllm.logger import init_logger

from kvduplex import _core, protocol
from kvduplex.connector import metadata as md
from kvduplex.connector.config import DuplexConfig, per_user_secret_path
from kvduplex.connector.fleet import (
    Fleet,
    FleetDirectory,
    advertised_address,
    fleet_key,
    parse_address,
)
from kvduplex.connector.stats import DuplexConnectorStats

# Under vLLM's logger tree, so vLLM's handler, format and level apply.
logger = init_logger(f"vllm.{__name__}")

# How often TP rank 0 checks its connections to lookup targets (connecting new or lost ones).
_PEER_SCAN_INTERVAL_S = 1.0
# The longest a step that computes nothing waits for lookup answers (a hung owner's lookup is
# then reported over several such steps, by its deadline, as before).
IDLE_STEP_WAIT_S = 0.02
# The scheduler's copy of what the decode nodes announced (`WorkerLookups.announced`): the most
# fingerprints its whole set is sent with, and how often at most.
_MAX_WHOLE = 1 << 18
_WHOLE_INTERVAL_S = 1.0


class WorkerLookups:
    """One worker's lookups and grants; `DuplexWorker` owns one and passes its transfer core
    (None before the KV caches are registered). Only TP rank 0 asks."""

    def __init__(self, config: DuplexConfig, tp_rank: int, stats: DuplexConnectorStats) -> None:
        self._config = config
        self._tp_rank = tp_rank
        self._stats = stats
        self._pending: dict[str, _PendingLookup] = {}
        # Reported lookups whose slowest owners may still answer (their claims go back).
        self._unanswered: list[_PendingLookup] = []
        self._results: dict[str, list[md.LookupMatch]] = {}
        self._next_peer_scan = 0.0
        # Who a lookup asks besides the readers the transfer core knows (`join_fleet`).
        self._fleet = Fleet(config.decode_peers, None)
        self._num_targets = -1
        self._reported_targets = -1
        # Where the scheduler's copy of the decode nodes' announcements stands (`announced`).
        self._announced_cursor: int | None = None
        self._announced_synced: bool | None = None
        self._incomplete_reported = False
        self._next_whole = 0.0

    def start(self, engine: _core.Engine | None, spec: md.LookupSpec) -> None:
        if engine is None or self._tp_rank != 0:
            return
        targets = self._targets(engine, spec.owner)
        if not targets:
            self._results[spec.request_id] = []
            self._stats.add("lookups_missed")
            return
        lookup = _ask(engine, targets, spec)
        if lookup.asked < len(targets):
            # The transfer core's index of what owners announced spared the others.
            self._stats.add("lookups_indexed")
        self._pending[spec.request_id] = _PendingLookup(
            lookup=lookup,
            deadline=spec.deadline,
            started=time.perf_counter(),
            sent_at=time.time(),
            num_blocks=len(spec.fingerprints),
        )

    def renew(self, engine: _core.Engine | None, renewals: list[md.RenewSpec]) -> None:
        """Ask the owners to renew the prompts they hold for the scheduler's queued requests
        (`renewals.py`). An owner not connected yet is connected to (the grant needs it too)
        and not asked: the next renewal comes a quarter of the lease later."""
        if engine is None or self._tp_rank != 0:
            return
        for renewal in renewals:
            peer = renewal.peer
            state, detail = engine.peer_status(
                peer.host,
                peer.ports[0],
                expected_engine_id=peer.rank_engine_id(0),
                timeout_s=self._config.handshake_timeout_s,
            )
            if state != "ready":
                continue
            payload = protocol.encode_renewal(renewal.remote_request_id, renewal.first_fingerprint)
            try:
                engine.notify(detail, payload)
            except _core.KvDuplexError as exc:
                logger.debug("Renewal of %s not delivered: %s", renewal.remote_request_id, exc)

    @property
    def pending(self) -> bool:
        """Whether a lookup waits for its answers (reported in a later step)."""
        return bool(self._pending)

    def connect_ahead(self, engine: _core.Engine | None) -> None:
        """Connect ahead of time to every engine a lookup would ask (those that announced
        themselves by reading from us, and `decode_peers`), so a lookup rarely pays for a first
        handshake within its short deadline. Checked once a second while the engine steps."""
        now = time.monotonic()
        if engine is None or self._tp_rank != 0 or now < self._next_peer_scan:
            return
        self._next_peer_scan = now + _PEER_SCAN_INTERVAL_S
        targets = self._targets(engine, None)
        for host, port in targets:
            engine.peer_status(host, port, timeout_s=self._config.handshake_timeout_s)
        # The scheduler looks nothing up while no engine could answer.
        self._num_targets = len(targets)

    def wait_for_answers(self, engine: _core.Engine | None) -> None:
        """In a step that computes nothing (the engine waits for nothing but its lookups):
        wait until a pending lookup can be reported (`_collect`), at most
        `IDLE_STEP_WAIT_S`, rather than report none and have the engine step again and again
        until the answers are in (each empty step costs about a millisecond here; a lookup on
        an idle engine waited 3.7-4.1 ms for 1.3-1.7 ms of round trip). The worker calls it
        only in such steps: a forward pass covers the round trip. It sleeps on the transfer
        core's answer bell without the GIL and wakes as an answer arrives (or a deadline
        passes); nothing polls."""
        if engine is None or not self._pending:
            return
        give_up = time.monotonic() + IDLE_STEP_WAIT_S
        seen = engine.lookup_answers_seen()
        while self._pending and (now := time.monotonic()) < give_up:
            if any(pending.reportable(now) for pending in self._pending.values()):
                return
            wake = min(give_up, *(pending.deadline for pending in self._pending.values()))
            seen = engine.wait_for_lookup_answers(seen, max(0.0, wake - now))

    def take(self, engine: _core.Engine | None) -> tuple[dict[str, list[md.LookupMatch]], int]:
        """The lookups to report this step, and how many engines a lookup would ask when that
        changed (-1: unchanged)."""
        self._collect(engine)
        results, self._results = self._results, {}
        targets = self._num_targets if self._num_targets != self._reported_targets else -1
        self._reported_targets = self._num_targets
        return results, targets

    def announced(self, engine: _core.Engine | None) -> md.AnnouncedChanges | None:
        """What the decode nodes' announcements changed since the last step's report (None:
        nothing), for the scheduler's copy (`held_mirror.py`). TP rank 0 alone; each step
        (its report, sent every step, tells the scheduler how recent its copy is). The whole
        set goes at most every
        `_WHOLE_INTERVAL_S` and up to `_MAX_WHOLE` fingerprints (owners resetting what they
        announce again and again, or announcing more, leave the copy incomplete, untrusted)."""
        if engine is None or self._tp_rank != 0 or not self._config.looks_up:
            return None
        now = time.monotonic()
        max_whole = _MAX_WHOLE if now >= self._next_whole else 0
        targets = self._targets(engine, None)
        cursor, whole, too_large, added, removed, synced = engine.announced_changes(
            self._announced_cursor, targets, max_whole
        )
        if too_large:
            # Asked for again later; until then the scheduler's copy is incomplete.
            self._announced_cursor = None
            if self._incomplete_reported:
                return None
            self._incomplete_reported = True
            return md.AnnouncedChanges(True, (), (), synced, complete=False)
        self._announced_cursor = cursor
        if whole:
            self._next_whole = now + _WHOLE_INTERVAL_S
            self._incomplete_reported = False
        # With no engine to ask, there is no announcement to trust either.
        synced = synced and bool(targets)
        unchanged = not whole and not added and not removed and synced == self._announced_synced
        if unchanged:
            return None
        self._announced_synced = synced
        return md.AnnouncedChanges(whole, tuple(added), tuple(removed), synced)

    def join_fleet(self, engine: _core.Engine, fingerprint: dict[str, str],
                   secret: bytes | None) -> None:
        """TP rank 0 of a bidirectional engine: list it in this host's fleet directory and
        start reading the fleet (`fleet.py`), so that every P on this host (or behind a name in
        `decode_peers`) asks it from its first lookup, whoever routed what before."""
        if self._tp_rank != 0 or not self._config.bidirectional_kv_xfer:
            return
        secret_path = per_user_secret_path()
        directory = (
            FleetDirectory(secret_path.parent / f"fleet-{fleet_key(secret, fingerprint)}")
            if secret_path is not None
            else None
        )
        address = advertised_address(engine.side_channel_host, engine.side_channel_port)
        self._fleet = Fleet(self._config.decode_peers, directory)
        self._fleet.start(engine.engine_id, address)

    def close(self) -> None:
        """Withdraw from the fleet directory (at shutdown)."""
        self._fleet.close()

    def _targets(self, engine: _core.Engine, owner: str | None) -> list[tuple[str, int]]:
        """Side channels to ask: the owner named in params alone, or (a lookup) the fleet's
        engines (`fleet.py`) and every reader our transfer core knows (same TP rank)."""
        if owner:
            target = parse_address(owner)
            return [] if target is None else [target]
        # In order, each once (a dict: linear in the fleet, not quadratic).
        targets: dict[tuple[str, int], None] = dict.fromkeys(self._fleet.members())
        # An engine's holds live on its TP rank 0 (other ranks of a reader at another TP size
        # announce themselves too).
        for engine_id, address in engine.known_peers():
            target = parse_address(address)
            if target is not None and engine_id.endswith(md.rank_engine_id("", 0)):
                targets[target] = None
        return list(targets)

    def _collect(self, engine: _core.Engine | None) -> None:
        """Report lookups whose every owner answered, one of whose owners holds every block
        asked (none can give more: chained fingerprints), or whose deadline passed; hand back
        the claims of answers that come after their lookup was reported."""
        now = time.monotonic()
        for request_id, pending in list(self._pending.items()):
            answers = pending.lookup.answers()
            if not pending.reportable(now, answers):
                continue
            del self._pending[request_id]
            matches, failures = pending.take(answers)
            if len(pending.taken) < len(answers):
                self._unanswered.append(pending)
            matches.sort(key=lambda m: m.matched_blocks, reverse=True)
            self._results[request_id] = matches
            self._stats.record_lookup(time.perf_counter() - pending.started, bool(matches))
            if failures:
                self._stats.add("lookup_failures", len(failures))
                logger.info(
                    "Request %s: %d of %d owners did not answer its lookup (%s)",
                    request_id, len(failures), len(answers), "; ".join(failures[:3]),
                )
        for pending in list(self._unanswered):
            answers = pending.lookup.answers()
            late, _ = pending.take(answers)
            for match in late:
                _release_quietly(engine, match)
            # The transfer core reports an owner still silent a while past the deadline as
            # failed, so every target is taken in the end.
            if len(pending.taken) == len(answers):
                self._unanswered.remove(pending)


def _ask(engine: _core.Engine, targets: list[tuple[str, int]], spec: md.LookupSpec) -> _core.Lookup:
    """The one call into the transfer core's lookup. It sends the lookup to connected targets
    right here and takes their replies on its own threads: no GIL, no pool to queue behind. It
    counts in time left (on CLOCK_MONOTONIC, as `time.monotonic()`): what is left of the
    lookup's deadline now, none if that passed (connected owners are still asked: what they
    answer by the end of the step is reported)."""
    return engine.start_lookup(
        targets,
        list(spec.fingerprints),
        max(0.0, spec.deadline - time.monotonic()),
        request_id=spec.owner_request_id,
        continues=spec.continues,
    )


def _release_quietly(engine: _core.Engine | None, match: md.LookupMatch) -> None:
    """Hand back the claim of an answer that came too late (the owner's claim expiry frees
    it otherwise)."""
    if engine is None:
        return
    try:
        engine.notify(
            match.owner_engine_id, protocol.encode_release(match.owner_request_id, match.claim_id)
        )
    except _core.KvDuplexError as exc:
        logger.debug("Release of %s not delivered: %s", match.owner_request_id, exc)


@dataclass
class _PendingLookup:
    lookup: _core.Lookup
    deadline: float
    """`time.monotonic()` at which the lookup is reported, answered or not (`LookupSpec`)."""
    started: float
    sent_at: float
    """Wall clock when sent: each claim lasts its `claim_s` from (at the latest) here."""
    num_blocks: int = 0
    """Blocks asked for."""
    taken: set[int] = field(default_factory=set)
    """Targets whose answer was taken already."""

    def reportable(self, now: float, answers: list | None = None) -> bool:
        """Whether the lookup is reported now: every owner answered, one holds every block
        asked (none can give more: chained fingerprints), or its deadline passed."""
        if answers is None:
            answers = self.lookup.answers()
        return (
            now >= self.deadline
            or all(answer is not None for answer in answers)
            or self.has_full_match(answers)
        )

    def has_full_match(self, answers: list) -> bool:
        """Whether an owner holds every block asked for."""
        return any(
            answer is not None and answer[2] is not None and answer[2][1] >= self.num_blocks
            for answer in answers
        )

    def take(self, answers: list) -> tuple[list[md.LookupMatch], list[str]]:
        """Matches and failures among the answers not taken yet; a target still silent is a
        failure when the lookup is reported (its late answer is taken later)."""
        matches: list[md.LookupMatch] = []
        failures: list[str] = []
        for index, answer in enumerate(answers):
            if index in self.taken:
                continue
            if answer is None:
                failures.append("no answer in time")
                continue
            self.taken.add(index)
            address, owner, found, error = answer
            if error is not None:
                failures.append(error)
            elif found is not None:
                owner_request_id, matched_blocks, claim_id, claim_s, offer = found
                matches.append(
                    md.LookupMatch(
                        owner_engine_id=owner,
                        owner_address=address,
                        owner_request_id=owner_request_id,
                        matched_blocks=matched_blocks,
                        claim_id=claim_id,
                        claim_expiry=self.sent_at + claim_s,
                        offer=offer,
                    )
                )
        return matches, failures
