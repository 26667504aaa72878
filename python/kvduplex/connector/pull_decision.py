"""The pull decision: for a request vLLM is about to schedule, pull its history's KV from a peer
(and how many tokens), ask a peer first, or compute. vLLM asks it through
`get_num_new_matched_tokens`, every step the request waits, until the answer is a number.

The order (`PullDecision.matched`; each step's helper is below it in this file, or named):
1. **Params.** A request whose `kv_transfer_params` describe a peer's blocks (P->D: the decode
   node pulls the prefill's prompt; D->P with `bidirectional_kv_xfer`: the prefill node pulls a
   decode node's finished turn back) is checked on arrival (`params.py`); rejected params
   compute, with the reason logged. Params are a hint, never a capability: the owner they name
   is asked for a grant of that hold against the fingerprints of the request's own prompt
   (`Lookups.ask` with `named`), if the pull could gain the recompute threshold.
2. **The announced holder.** A request with no params describing blocks (a router sent only
   `do_remote_decode`, or nothing) is looked up by its prompt's content on a bidirectional
   prefill node (`lookup_timeout_ms` > 0), if a decode engine is known, the prompt has a full
   block, and the gain could pass the lookup threshold (`threshold.py`). The copy of what the
   decode nodes announced they hold (`held_mirror.py`) rules the lookup out in this very step
   when no decode node holds enough of the prompt; otherwise TP rank 0's transfer core asks the
   decode nodes whose announcements hold the prompt, and the one this node handed the prompt's
   previous turn to (`continues`: it answers "ask again" while it computes that turn,
   `expected_turns.py`).
3. **Fan-out.** When the announcements cannot tell (not synced, stale), the transfer core asks
   every decode engine of the fleet (`fleet.py`) and every reader it knows, at once.
4. **Compute.** No grant, no match, or a gain below the threshold: the request prefills.

Grants and lookups run on the workers' transfer cores; the answer comes in a later step's
report, and `matched` says "ask again" (None) meanwhile, so vLLM's scheduler loop never blocks
(`lookup.py`: the asking, the waiting, the choice among answers). What the owner grants is
what is read: the longest prefix whose token fingerprints equal the prompt's, beyond the local
prefix-cache hit, within what every KV-cache group can pull (`groups.py`), if at least the
recompute threshold is gained. Each request decides once: `consumed` after vLLM allocates.

A granted pull vLLM cannot admit gives its claim back (`_yields`): a reader that keeps an
owner's claim while its own request waits for blocks can close a circular wait. Seen with
bidirectional P/D: X on P was granted D's held turn but P's blocks were held for D's read of a
prompt, which Y on D was granted, while D lacked the blocks to admit Y, held by the very turn X
had claimed. Neither engine evicts a claimed hold (`retention.py`), so both waited until the
claims ran out (`kv_lease_ttl_s`, 30 s) and then computed anyway. So once a granted request has
waited `ALLOCATION_WAIT_S` for vLLM to allocate it while this engine's eviction orders freed
less than they asked because readers had claimed its holds, the claim goes back to its
owner and the request computes: the owner may then evict that hold for its own waiting request,
whose read of our held prompt frees our blocks. Correctness is kept: a released claim's blocks
are never read (no load is planned; the request decided to compute for good, never asks again,
so no new claim can close the cycle again). The cost: the request computes its history instead
of pulling it. A request waiting for anything else (a seat, running requests' blocks, holds
nobody claimed, which retention evicts for it) keeps its claim: those waits end by themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.logger import init_logger

from kvduplex.connector import metadata as md
from kvduplex.connector.lookup import ASK_AGAIN, NOT_ASKED, Lookups
from kvduplex.connector.params import (
    Rejected,
    RemoteBlocks,
    claim_release,
    parse_remote_blocks,
    unsupported_reason,
)
from kvduplex.connector.token_fingerprint import (
    PromptFingerprints,
    matched_prefix_tokens,
    prompt_fingerprints,
)

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvduplex.connector.config import DuplexConfig
    from kvduplex.connector.params import ParamsContext
    from kvduplex.connector.retention import LiveRequests
    from kvduplex.connector.stats import DuplexConnectorStats
    from kvduplex.connector.threshold import RecomputeThresholdEstimator

# Under vLLM's logger tree, so vLLM's handler, format and level apply.
logger = init_logger(f"vllm.{__name__}")


@dataclass
class PullState:
    """A request with a peer's blocks to pull (granted or found) or rejected params; lives
    until the request finishes."""

    remote: RemoteBlocks | Rejected
    prompt: PromptFingerprints | None = None
    """The prompt's fingerprints, when its lookup computed them already."""
    matched_tokens: int = -1
    consumed: bool = False
    """The pull was decided (started, declined or impossible): never pull again."""
    last_num_computed: int = 0
    granted_at: float = 0.0
    """`time.time()` when the grant or lookup answer was taken (`matched`)."""


# How long a granted request may wait for vLLM to allocate it while claims block this engine's
# room, before its claim goes back to the owner and it computes (module doc).
ALLOCATION_WAIT_S = 1.0


class PullDecision:
    """The reader's decision (`DuplexScheduler` owns one); owns the requests' pull states and
    their grants and lookups (`lookups`)."""

    def __init__(
        self,
        config: DuplexConfig,
        context: ParamsContext,
        live: LiveRequests,
        estimator: RecomputeThresholdEstimator | None,
        stats: DuplexConnectorStats,
        release: Callable[[md.ReleaseSpec], None],
        claims_block_room: Callable[[float], bool],
    ) -> None:
        """`release`: hands a claim back to its owner (with the next step's metadata);
        `claims_block_room(since)`: whether, at or after `since` (here: the grant), an eviction
        order freed less than it asked because readers had claimed this engine's holds
        (`Retention.fruitless_since`)."""
        self._config = config
        self._context = context
        self._groups = context.groups
        self._block_size = context.block_size
        self._live = live
        self._estimator = estimator
        self._stats = stats
        self._release = release
        self._claims_block_room = claims_block_room
        self._pulls: dict[str, PullState] = {}
        self.lookups = Lookups(
            config, context, stats, pullable=self._pullable, release=release
        )

    def matched(
        self, request: Request, num_computed_tokens: int, now: float
    ) -> tuple[int | None, bool]:
        """vLLM's `get_num_new_matched_tokens`: (tokens to pull, asynchronously), or None
        while a grant or lookup runs (vLLM asks again next step); `now`: `time.time()`, the clock
        `Retention` keeps.
        The order: module doc."""
        state = self._pulls.get(request.request_id)
        if state is None:
            found = self.lookups.answer(request)
            if found is NOT_ASKED:
                found = self._ask(request, num_computed_tokens)  # 1.-3., or 4.
            if found is ASK_AGAIN:
                return self._live.matched(request, None, False)
            if found is not None:
                state = PullState(remote=found.remote, prompt=found.prompt, granted_at=now)
                self._pulls[request.request_id] = state
        if state is None or state.consumed or isinstance(state.remote, Rejected):
            return self._live.matched(request, 0, False)  # 4. compute
        state.last_num_computed = num_computed_tokens
        gain = self._pullable_tokens(request, state, num_computed_tokens) - num_computed_tokens
        if gain <= 0 or gain < self.recompute_threshold():
            return self._live.matched(request, 0, False)  # 4. compute: too little gained
        if self._yields(request, state, gain, now):
            return self._live.matched(request, 0, False)  # 4. compute: not admitted
        return self._live.matched(request, gain, not self.layerwise(state.remote))

    def _ask(self, request: Request, num_computed_tokens: int) -> object | None:
        """Steps 1-3: ask a grant of the hold the params named, or look the prompt up by
        content; ASK_AGAIN once asked, None when nothing is asked (step 4)."""
        lookups = self.lookups
        named = lookups.take_named(request)
        if named is not None:  # 1. params
            remote, prompt = named
            end = min(remote.num_tokens, request.num_prompt_tokens)
            gain = lookups.gain_to_ask(request, num_computed_tokens, end, self.recompute_threshold)
            if gain is not None:
                # The grant may need a first handshake with the owner.
                timeout_s = self._config.handshake_timeout_s
                return lookups.ask(request, timeout_s, prompt, named=remote)
            return lookups.settle(request)
        if not self._config.looks_up:
            return lookups.settle(request)
        lookups.looked_up()
        # A lookup matches whole blocks from the prompt's first (a held turn's partial last
        # block is checked on the answer, after its full ones matched): a prompt without one,
        # or no engine to ask, and nothing could be found. A prompt whose full blocks are all
        # local still looks up: the held turn's partial last block (the previous answer's
        # tail) is gained beyond them.
        gain = None
        if request.num_prompt_tokens >= self._block_size and lookups.has_peers:
            gain = lookups.gain_to_ask(
                request,
                num_computed_tokens,
                request.num_prompt_tokens,
                lambda: self._lookup_threshold(request),
            )
        if gain is None:
            return lookups.settle(request)
        prompt = prompt_fingerprints(request, self._block_size)
        timeout_s = self._config.lookup_timeout_s
        continues = lookups.continued(prompt)
        if lookups.ruled_out(prompt, num_computed_tokens, gain):  # 2. no decode node holds it
            return lookups.settle(request)
        # 2.-3. those whose announcements hold it, else every engine (the transfer core picks).
        return lookups.ask(request, timeout_s, prompt, continues=continues)

    # ------------------------------------------------------------------ helpers

    def _yields(self, request: Request, state: PullState, gain: int, now: float) -> bool:
        """vLLM has not allocated the granted request for `ALLOCATION_WAIT_S` while claims
        blocked this engine's eviction orders: the claim goes back to the owner and the request
        computes, for good (module doc: the circular wait this breaks)."""
        remote = state.remote
        assert isinstance(remote, RemoteBlocks)
        if (
            now - state.granted_at < ALLOCATION_WAIT_S
            or remote.claim_id is None
            or not self._claims_block_room(state.granted_at)  # since the grant
        ):
            return False
        state.consumed = True  # never pulls, never asks again: no new claim
        self.hand_back(remote)
        self._stats.add("claims_yielded")
        self._stats.add("tokens_recomputed", gain)
        logger.info(
            "Request %s waited %.1f s for blocks with a pull granted: its claim goes back to "
            "engine %s and it computes %d tokens instead",
            request.request_id,
            now - state.granted_at,
            remote.peer.engine_id,
            gain,
        )
        return True

    def arrived(self, request: Request, prompt: PromptFingerprints | None) -> None:
        """A new request: its params checked once (`prompt`: its fingerprints, if computed
        already). Rejected params compute; params naming a peer's hold make it asked for a
        grant (`matched`); a prefill node's prompt is renewed meanwhile (`renewals.py`)."""
        remote = parse_remote_blocks(request.kv_transfer_params, self._context)
        if remote is None:
            return
        if isinstance(remote, RemoteBlocks):
            unsupported = unsupported_reason(request)
            if unsupported is None:
                self.lookups.name_owner(request, remote, prompt)
                return
            remote = Rejected(unsupported)
        self._stats.add("fallbacks")
        logger.warning("Request %s runs without KV transfer: %s", request.request_id, remote.reason)
        self._pulls[request.request_id] = PullState(remote=remote)

    def take(self, request_id: str) -> PullState | None:
        """vLLM allocated the request's blocks: its pull state, the decision now final (None:
        nothing to pull, or decided already)."""
        state = self._pulls.get(request_id)
        if state is None or state.consumed:
            return None
        state.consumed = True
        return state

    def finished(self, request_id: str) -> PromptFingerprints | None:
        """The request is gone: a claim it never used goes back. Returns the prompt's
        fingerprints, if its pull computed them (a turn held after it extends them)."""
        state = self._pulls.pop(request_id, None)
        self.lookups.finished(request_id)
        if state is not None and not state.consumed:
            # Finished (e.g. aborted) before it was ever scheduled: end the owner's claim.
            self.hand_back(state.remote)
        return state.prompt if state is not None else None

    def declined(self, request: Request, state: PullState) -> None:
        """vLLM allocated no tokens to load: tell the owner to free its blocks now."""
        remote = state.remote
        assert isinstance(remote, RemoteBlocks)
        self.hand_back(remote)
        gain = (
            self._pullable_tokens(request, state, state.last_num_computed)
            - state.last_num_computed
        )
        if gain > 0:
            self._stats.add("pulls_declined")
            self._stats.add("tokens_recomputed", gain)
            logger.debug(
                "Request %s recomputes %d tokens instead of pulling them (threshold %d)",
                request.request_id,
                gain,
                self.recompute_threshold(),
            )

    def hand_back(self, remote: RemoteBlocks | Rejected) -> None:
        """End the owner's claim, if it granted one."""
        release = claim_release(remote)
        if release is not None:
            self._release(release)

    def recompute_threshold(self) -> int:
        if self._estimator is not None:
            return self._estimator.threshold()
        return self._config.recompute_threshold

    def _lookup_threshold(self, request: Request) -> int:
        """The fewest tokens a lookup by content of `request` must be able to gain: with
        "auto", a step more while other requests run (`threshold.py`)."""
        if self._estimator is not None:
            return self._estimator.lookup_threshold(self._live.others_running(request.request_id))
        return self._config.recompute_threshold

    def layerwise(self, remote: RemoteBlocks) -> bool:
        """A decode node's held turn is pulled layer by layer within the forward pass with
        `layerwise_load` (the prefill node is connected to it ahead of time, and its new
        tokens' forward pass is what the pull overlaps with). A hybrid model keeps the
        asynchronous path: vLLM maps a synchronous load's failure back only by block id,
        which it supports with one KV-cache group only."""
        return (
            self._config.layerwise_load
            and remote.from_decode_node
            and not self._groups.hybrid
            and not self._groups.has_state
            and len(remote.peer.ports) == self._context.tp_size
        )

    def _pullable_tokens(self, request: Request, state: PullState, num_computed_tokens: int) -> int:
        """Prompt tokens, from the first, whose KV the peer holds for the same token ids, in
        every block each KV-cache group needs beyond the local hit (else the local hit)."""
        remote = state.remote
        assert isinstance(remote, RemoteBlocks)
        if state.matched_tokens < 0:
            prompt = request.prompt_token_ids or []
            if state.prompt is None:  # kept: a turn held after it extends them
                state.prompt = prompt_fingerprints(request, self._block_size)
            matched, mismatch_block = matched_prefix_tokens(
                state.prompt, remote.fingerprints, remote.num_tokens
            )
            state.matched_tokens = matched
            if mismatch_block >= 0:
                usable = min(remote.num_tokens, len(prompt))
                self._stats.add("tokens_mismatched", usable - matched)
                self._stats.add("fallbacks")
                logger.warning(
                    "Request %s: the tokens of block %d held by engine %s differ from the "
                    "prompt's; only the first %d of %d tokens are reusable",
                    request.request_id,
                    mismatch_block,
                    remote.peer.engine_id,
                    matched,
                    usable,
                )
        return self._pullable(request, remote, state.matched_tokens, num_computed_tokens)

    def _pullable(
        self, request: Request, remote: RemoteBlocks, matched_tokens: int, num_local_tokens: int
    ) -> int:
        """What a pull of the owner's `matched_tokens` matching tokens can cover for this
        request, within the prompt's pull limit (`TransferGroups`)."""
        return self._groups.pullable_tokens(
            remote.block_ids,
            min(matched_tokens, self._groups.pull_limit(request.num_prompt_tokens)),
            num_local_tokens,
            remote.num_tokens,
        )
