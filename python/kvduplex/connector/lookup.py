"""Scheduler side of lookups and grants: which engine holds a request's blocks.

Whether a request asks, and whom, is decided in `pull_decision.py`: the owner its params name,
for a *grant* of that hold (a hint, never a capability), or, on a bidirectional prefill node,
the decode engines a *lookup* by its prompt asks. Either way `Lookups` sends the
fingerprints of the prompt's blocks to the workers (`md.LookupSpec`; their side:
`worker_lookup.py`), tells vLLM "ask again" meanwhile, and takes the owners' claimed answers
when the workers report them: it checks each exactly like params from a router, keeps the one
that covers most of the prompt (only here can a turn's partial last block be checked against
the prompt's tokens) and hands every other claim back. The request then pulls what was chosen
(`pull_decision.py`) or, with nothing found, prefills.

One deadline per lookup, computed once, here, when it is asked: `time.monotonic()` plus
`lookup_timeout_ms` (a grant, which may need a first handshake with its owner:
`handshake_timeout_s`), carried in the `LookupSpec`. TP rank 0's worker reports the lookup by
that deadline with whatever has answered, and gives the transfer core the time left; answers
after it are handed back. The scheduler waits for that report and needs no clock of its own:
the workers report every lookup past its deadline in the first step built after it, so once
that step has reported without the answer, a worker lost it and the request prefills. (vLLM
hands the scheduler no report of a step that computed nothing and whose workers returned
nothing: TP rank 0 returns one every step, so every step built is reported.)
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.logger import init_logger

from kvduplex import protocol
from kvduplex.connector import held_mirror
from kvduplex.connector import metadata as md
from kvduplex.connector.config import DuplexConfig
from kvduplex.connector.fleet import parse_address
from kvduplex.connector.held_mirror import HeldMirror
from kvduplex.connector.params import (
    ParamsContext,
    Rejected,
    RemoteBlocks,
    claim_release,
    parse_remote_blocks,
    unsupported_reason,
)
from kvduplex.connector.renewals import Renewals
from kvduplex.connector.stats import DuplexConnectorStats
from kvduplex.connector.token_fingerprint import (
    PromptFingerprints,
    matched_prefix_tokens,
    prompt_fingerprints,
    salt_of,
)

if TYPE_CHECKING:
    from vllm.v1.request import Request

# Under vLLM's logger tree, so vLLM's handler, format and level apply.
logger = init_logger(f"vllm.{__name__}")

# `Lookups.answer`'s "not yet": the lookup runs (get_num_new_matched_tokens returns None).
ASK_AGAIN = object()
# `Lookups.answer` before anything was asked or settled for the request.
NOT_ASKED = object()

# How long after its last lookup by content (or hand-off) an idle engine keeps stepping to
# renew its copy of the decode nodes' announcements (`held_mirror.py`): about a user's pause
# between turns. Each such step costs about a millisecond here, five a second.
IDLE_REFRESH_S = 60.0


@dataclass(frozen=True)
class Found:
    """What a lookup or grant chose for the request, and the prompt's fingerprints."""

    remote: RemoteBlocks | Rejected
    prompt: PromptFingerprints


@dataclass
class _LookupState:
    """A request whose prompt was looked up on the known owners, or whose params' owner was
    asked for a grant (`named`)."""

    request: Request
    asked_at: float
    """`time.monotonic()` when asked, for the wait's stats; 0 once they have it."""
    deadline: float = 0.0
    """`time.monotonic()` by which the workers report the answer (`LookupSpec.deadline`)."""
    asked_step: int = 0
    """The scheduler step in which it was asked, for the cost in steps."""
    report_step: int = 0
    """Once past the deadline: the step whose report the answer is in at the latest."""
    named: RemoteBlocks | None = None
    """The params' description of the owner's blocks (a hint)."""
    prompt: PromptFingerprints | None = None
    """The prompt's fingerprints, computed once for the lookup and every answer."""
    arrived: bool = False
    chosen: RemoteBlocks | Rejected | None = None
    """The answer picked when it arrived, until the request takes it."""


class Lookups:
    """The scheduler's lookups and grants; `DuplexScheduler` owns one and calls it."""

    def __init__(
        self,
        config: DuplexConfig,
        context: ParamsContext,
        stats: DuplexConnectorStats,
        *,
        pullable: Callable[[Request, RemoteBlocks, int, int], int],
        release: Callable[[md.ReleaseSpec], None],
    ) -> None:
        """`pullable(request, remote, matched tokens, local tokens)`: what a pull of the
        owner's matched tokens covers; `release`: hands a claim back to its owner."""
        self._config = config
        self._context = context
        self._block_size = context.block_size
        self._groups = context.groups
        self._stats = stats
        self._pullable = pullable
        self._release = release
        self._lookups: dict[str, _LookupState] = {}
        # Params seen on a request, until their owner is asked for a grant.
        # Grants to ask for: the hold params named, and the prompt's fingerprints if computed.
        self._named: dict[str, tuple[RemoteBlocks, PromptFingerprints | None]] = {}
        # Their owners' holds of prompts, renewed meanwhile (`renewals.py`).
        self._renewals = Renewals()
        self._specs: list[md.LookupSpec] = []
        # Whether an engine could ever answer a lookup: `decode_peers`, a decode node we
        # handed a prompt to (it announces itself when it reads), or one TP rank 0 counted.
        # Never unset: a peer that went away is found missing by the workers (no answer).
        self._peers_known = bool(config.decode_peers)
        # Steps built (`take_specs`) and steps whose workers' report arrived (`on_report`):
        # vLLM hands the reports back in the order it built the steps (module doc).
        self._steps_built = 0
        self._steps_reported = 0
        # What the decode nodes announced they hold, for lookups that could not gain enough.
        self._mirror = HeldMirror()
        # `time.monotonic()` of the last lookup by content or hand-off (`refresh_at`), and of
        # the last step built: a step built and not yet reported (the counts above; TP rank 0
        # reports every step) renews the copy when its report comes (with asynchronous
        # scheduling vLLM builds the next step before it takes the last one's report).
        self._looked_up_at = -math.inf
        self._built_at = -math.inf

    def name_owner(
        self, request: Request, remote: RemoteBlocks, prompt: PromptFingerprints | None
    ) -> None:
        """The request's params name this hold: its owner is asked for a grant (`pull_decision.py`),
        with `prompt`'s fingerprints where they were computed already; a prefill node's
        prompt is renewed until then."""
        self._named[request.request_id] = (remote, prompt)
        tokens = request.prompt_token_ids or []
        first = min(remote.num_tokens, self._block_size, len(tokens))
        if remote.from_decode_node or first == 0:
            return
        if prompt is None:  # (one block's tokens hashed)
            prompt = PromptFingerprints(tokens[:first], self._block_size, salt_of(request))
        spec = md.RenewSpec(remote.peer, remote.remote_request_id, prompt.of_prefix(first)[0])
        lease_left_s = remote.lease_expiry - time.time()
        self._renewals.add(request.request_id, spec, lease_left_s, time.monotonic())

    def peers_known(self) -> None:
        """An engine could now answer a lookup (a decode node we handed a prompt to)."""
        self._peers_known = True

    def handed_off(self, request: Request) -> PromptFingerprints | None:
        """The request's prompt goes to a decode node, which may hold the turn it computes
        after it before it announces that: its next turn is asked (`held_mirror.py`). Returns
        the prompt's fingerprints where they were computed, for the hold to reuse."""
        if not self._config.looks_up:
            return None
        prompt = prompt_fingerprints(request, self._block_size)
        self._mirror.handed_off(prompt)
        self._looked_up_at = time.monotonic()
        return prompt

    def refresh_at(self, now: float) -> float | None:
        """When (`time.monotonic()`) an idle engine should step so that the report renews its
        copy of the announcements (`held_mirror.py`); None when nothing would use it: no
        lookups by content, no engine to ask, or none for `IDLE_REFRESH_S`. Called by the
        idle waker's thread too: it only reads."""
        if not (self._config.looks_up and self._peers_known):
            return None
        if now > self._looked_up_at + IDLE_REFRESH_S:
            return None
        due = self._mirror.refresh_at()
        if due is not None and self._steps_built > self._steps_reported:
            due = max(due, self._built_at + held_mirror.FRESH_S)  # its report is on its way
        return due

    def answer(self, request: Request) -> Found | None | object:
        """What the request's grant or lookup found, None when there is nothing to pull,
        ASK_AGAIN while it runs, or NOT_ASKED before `ask` or `settle`."""
        lookup = self._lookups.get(request.request_id)
        if lookup is None:
            return NOT_ASKED
        if not lookup.arrived:
            if time.monotonic() < lookup.deadline:
                return ASK_AGAIN
            if not lookup.report_step:
                # The step being scheduled is built past the deadline: its workers report
                # the lookup, answered or not.
                lookup.report_step = self._steps_built + 1
            if self._steps_reported < lookup.report_step:
                return ASK_AGAIN
            logger.warning(
                "Request %s: the workers reported no answer to its lookup by its deadline "
                "(%.1f s ago); prefilling",
                request.request_id,
                time.monotonic() - lookup.deadline,
            )
            lookup.arrived = True
            self._record_wait(lookup)
            lookup.asked_at = 0.0
            return None
        if lookup.asked_at > 0:
            self._record_wait(lookup)
            lookup.asked_at = 0.0
        chosen, lookup.chosen = lookup.chosen, None
        if chosen is None or lookup.prompt is None:
            return None
        return Found(chosen, lookup.prompt)

    def take_named(self, request: Request) -> tuple[RemoteBlocks, PromptFingerprints | None] | None:
        """The hold the request's params named (`name_owner`) and the prompt's fingerprints
        where computed, once: its owner is asked now, or never; its renewals stop."""
        self._renewals.remove(request.request_id)
        return self._named.pop(request.request_id, None)

    def looked_up(self) -> None:
        """A request was considered for a lookup by content: the copy of the announcements is
        renewed for `IDLE_REFRESH_S` from now (`refresh_at`)."""
        self._looked_up_at = time.monotonic()

    @property
    def has_peers(self) -> bool:
        """Whether an engine could ever answer a lookup."""
        return self._peers_known

    def settle(self, request: Request) -> None:
        """Nothing is asked for the request: it has nothing to pull."""
        self._lookups[request.request_id] = _LookupState(request, 0.0, arrived=True)

    def continued(self, prompt: PromptFingerprints) -> str | None:
        """The end of a prompt handed to a decode node, whose turn is not announced yet, that
        `prompt` continues (`held_mirror.py`)."""
        return self._mirror.continued(prompt)

    def take_specs(self) -> list[md.LookupSpec]:
        """The lookups and grants to send with the step being built."""
        self._steps_built += 1
        self._built_at = time.monotonic()
        specs, self._specs = self._specs, []
        return specs

    def take_renewals(self) -> list[md.RenewSpec]:
        """The owners' holds to renew with the step being built (`renewals.py`)."""
        return self._renewals.take(time.monotonic())

    def on_report(self, meta: md.DuplexWorkerMetadata | None) -> None:
        """The workers' report of a step (None: nothing to report)."""
        self._steps_reported += 1
        if meta is None:
            return
        self._on_answers(meta.lookups)
        if meta.lookup_targets > 0:
            self._peers_known = True

    def announced(self, changes: md.AnnouncedChanges | None) -> None:
        """What the decode nodes' announcements changed, from a step's report (None: nothing;
        called for every step's report)."""
        self._mirror.on_report(changes, time.monotonic())

    def finished(self, request_id: str) -> None:
        """The request is gone: a claim it was granted and did not take goes back."""
        lookup = self._lookups.pop(request_id, None)
        self._named.pop(request_id, None)
        self._renewals.remove(request_id)
        if lookup is not None and lookup.chosen is not None:
            self._hand_back(lookup.chosen)

    def _record_wait(self, lookup: _LookupState) -> None:
        """What the request waited for its grant or lookup answer, in time and in steps."""
        self._stats.data["lookup_wait_s"].append(time.monotonic() - lookup.asked_at)
        self._stats.data["lookup_wait_steps"].append(self._steps_built - lookup.asked_step)

    def ruled_out(self, prompt: PromptFingerprints, num_computed_tokens: int, gain: int) -> bool:
        """Whether what the decode nodes announced says no lookup could gain `gain` tokens
        beyond the `num_computed_tokens` we have: none holds that much of the prompt (a held
        turn's partial last block counted by its tokens). The request then prefills in this
        step."""
        held = num_computed_tokens + max(1, gain)
        if self._mirror.may_hold(prompt, held, time.monotonic()) is not False:
            return False
        self._stats.add("lookups_ruled_out")
        return True

    def gain_to_ask(
        self, request: Request, num_computed_tokens: int, end: int, threshold: Callable[[], int]
    ) -> int | None:
        """The tokens a pull must gain to be worth it, `threshold()` (read once, and only where
        a pull of the prompt's first `end` tokens could gain any), or None when it could not
        gain that many."""
        if unsupported_reason(request) is not None or request.skip_reading_prefix_cache:
            return None
        gain = end - num_computed_tokens
        if gain <= 0:
            return None
        needed = threshold()
        if gain < needed:
            self._stats.add("lookups_skipped")
            return None
        return needed

    def ask(
        self,
        request: Request,
        timeout_s: float,
        prompt: PromptFingerprints | None,
        named: RemoteBlocks | None = None,
        continues: str | None = None,
    ) -> object:
        """Ask the workers: the owner of the `named` hold for a grant, or (a lookup) those whose
        announcements hold the prompt (the decode node `continues`' prompt went to too), else
        every one. Returns ASK_AGAIN.

        A lookup compares full blocks (a held turn's partial last block is checked on the
        answer); a grant, the blocks holding the named hold's tokens as the params count them
        (the owner compares the partial last block too).

        The deadline is CLOCK_MONOTONIC (`time.monotonic()`), not the wall clock that leases
        and claims use across hosts: the scheduler and TP rank 0's worker, which enforces it,
        share one host (vLLM starts TP rank 0 beside its EngineCore), CLOCK_MONOTONIC is
        system-wide on Linux and is what the transfer core's `Instant` reads, and no clock
        step (NTP) stretches or cuts short a lookup of a few hundred milliseconds."""
        if prompt is None:
            prompt = prompt_fingerprints(request, self._block_size)
        asked_at = time.monotonic()
        deadline = asked_at + timeout_s
        self._lookups[request.request_id] = _LookupState(
            request,
            asked_at,
            deadline=deadline,
            asked_step=self._steps_built,
            prompt=prompt,
            named=named,
        )
        self._specs.append(
            md.LookupSpec(
                request_id=request.request_id,
                fingerprints=tuple(
                    prompt.full_blocks if named is None else prompt.of_prefix(named.num_tokens)
                ),
                deadline=deadline,
                owner=None if named is None else f"{named.peer.host}:{named.peer.ports[0]}",
                owner_request_id=None if named is None else named.remote_request_id,
                continues=continues,
            )
        )
        return ASK_AGAIN

    def _on_answers(self, answers: dict[str, list[md.LookupMatch]]) -> None:
        for request_id, matches in answers.items():
            lookup = self._lookups.get(request_id)
            if lookup is None or lookup.arrived or lookup.prompt is None:
                # Too late (given up, or the request is gone): hand every claim back.
                for match in matches:
                    self._release(_owner_release(match))
                continue
            lookup.arrived = True
            named = lookup.named
            if named is not None and not matches:
                self._stats.add("grants_refused")
                self._stats.add("fallbacks")
                logger.warning(
                    "Request %s: engine %s did not grant the blocks of its request %s that the "
                    "params name (held for other tokens, read by another engine already, "
                    "expired, or unreachable: the owner's log says which); computing the prompt",
                    request_id,
                    named.peer.engine_id,
                    named.remote_request_id,
                )
            lookup.chosen = self._choose(lookup.request, lookup.prompt, matches)

    def _choose(
        self, request: Request, prompt: PromptFingerprints, matches: list[md.LookupMatch]
    ) -> RemoteBlocks | Rejected | None:
        """Owners matched the same full blocks at most; the turn whose partial last block also
        holds the prompt's tokens gives more. Keep the most tokens, hand the other claims back
        at once."""
        best: tuple[int, RemoteBlocks | Rejected] | None = None
        for match in matches:
            remote = self._remote_from_match(request, match)
            tokens = -1
            if isinstance(remote, RemoteBlocks):
                matched, _ = matched_prefix_tokens(prompt, remote.fingerprints, remote.num_tokens)
                # What the owner can still give: a sliding-window group's blocks of the match.
                tokens = self._pullable(request, remote, matched, 0)
            if best is None or tokens > best[0]:
                if best is not None:
                    self._hand_back(best[1])
                best = (tokens, remote)
            else:
                self._hand_back(remote)
        return None if best is None else best[1]

    def _remote_from_match(self, request: Request, match: md.LookupMatch) -> RemoteBlocks | Rejected:
        """Check an owner's answer exactly like params from a router, cut to what matched."""
        release = _owner_release(match)
        params = protocol.decode_offer(match.offer)
        if params is None:
            return self._reject_match(request, match, "malformed params", release)
        ids, fingerprints = params.get(protocol.REMOTE_BLOCK_IDS), params.get(protocol.REMOTE_BLOCK_FINGERPRINTS)
        num_tokens = params.get(protocol.REMOTE_NUM_TOKENS)
        if isinstance(ids, list) and isinstance(fingerprints, list) and isinstance(num_tokens, int):
            keep = match.matched_blocks
            if keep + 1 == len(fingerprints) and num_tokens % self._block_size:
                # The turn's partial last block (the answer's tail) was not compared by the
                # lookup, which sends full blocks only; its fingerprint is checked below.
                keep += 1
            params[protocol.REMOTE_BLOCK_IDS] = (
                [table[:keep] if isinstance(table, list) else table for table in ids]
                if self._groups.hybrid
                else ids[:keep]
            )
            params[protocol.REMOTE_BLOCK_FINGERPRINTS] = fingerprints[:keep]
            params[protocol.REMOTE_NUM_TOKENS] = min(num_tokens, keep * self._block_size)
        # The claim, not the hold's own end, is how long the owner keeps the blocks for us.
        params[protocol.REMOTE_LEASE_EXPIRY] = match.claim_expiry
        remote = parse_remote_blocks(params, self._context)
        if not isinstance(remote, RemoteBlocks):
            reason = remote.reason if isinstance(remote, Rejected) else "it asks for no transfer"
            return self._reject_match(request, match, reason, release)
        if md.rank_engine_id(remote.peer.engine_id, 0) != match.owner_engine_id:
            reason = f"it names engine {remote.peer.engine_id}"
            return self._reject_match(request, match, reason, release)
        logger.debug(
            "Request %s: engine %s holds %d of its blocks (request %s, claim %d)",
            request.request_id,
            remote.peer.engine_id,
            match.matched_blocks,
            match.owner_request_id,
            match.claim_id,
        )
        return dataclasses.replace(remote, claim_id=match.claim_id)

    def _hand_back(self, remote: RemoteBlocks | Rejected) -> None:
        release = claim_release(remote)
        if release is not None:
            self._release(release)

    def _reject_match(
        self, request: Request, match: md.LookupMatch, reason: str, release: md.ReleaseSpec
    ) -> Rejected:
        self._stats.add("fallbacks")
        logger.warning(
            "Request %s: the lookup answer of engine %s is unusable (%s); prefilling",
            request.request_id,
            match.owner_engine_id,
            reason,
        )
        return Rejected(f"lookup answer: {reason}", release)


def _owner_release(match: md.LookupMatch) -> md.ReleaseSpec:
    """Where to hand a lookup's claim back: the side channel that answered it (TP rank 0)."""
    address = parse_address(match.owner_address)
    if address is None:
        raise ValueError(f"owner address {match.owner_address!r} is not host:port")
    engine_id = match.owner_engine_id.rsplit("/tp", 1)[0]
    peer = md.PeerAddress(engine_id=engine_id, host=address[0], ports=(address[1],))
    return md.ReleaseSpec(peer, match.owner_request_id, match.claim_id)
