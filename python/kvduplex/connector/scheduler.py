"""Scheduler side of DuplexConnector: what to pull, what to hold, for how long.

Runs in vLLM's EngineCore process and never touches the transfer core; it tells the workers
what to do through `DuplexConnectorMetadata` once per step.

Reader (the node that pulls): nothing is read without the owner's grant. A request whose
params describe a peer's blocks (P->D: the decode node pulls the prefill's blocks; D->P with
`bidirectional_kv_xfer`: the prefill node pulls a finished turn's blocks back) asks that owner
for a grant of the hold the params name, presenting the fingerprints of its own prompt's
tokens (`LookupSpec` with `owner_request_id`): params are a hint, never a capability. The
owner checks them against the tokens its held blocks carry and answers with a claim for this
reader and its own description of the blocks, which is what gets read: the longest prefix whose
token fingerprints equal the prompt's, beyond the local prefix-cache hit, if at least
`kv_recompute_threshold` tokens are gained. Refused (other tokens, a hold already read by
another decode node, expired): the request computes its prompt, and the log says why. Each
request pulls at most once; the scheduler releases the claim once every TP rank's load is
done, or at once when it does not pull.

Lookup (bidirectional, the prefill node): a request whose params describe no peer's blocks
(a router sent only vLLM's standard `do_remote_decode`, or nothing) is looked up by its prompt
on the decode engines the workers know; the longest match arrives claimed, like a grant. No
answer by the lookup's deadline (`lookup_timeout_ms`; `0`: no lookups): the request prefills
normally. Grants and lookups, asked and answered, are `lookup.py`'s (`Lookups`); they run on
the workers' transfer cores, and `get_num_new_matched_tokens` returns None ("ask again")
meanwhile, so vLLM's scheduler loop never blocks.

Owner (the node that holds): what a finished request keeps for readers and the params that
describe it are `offers.py`'s (`Offers`); its references in vLLM's block pool are
`held_blocks.py`'s, and how long holds last and what is evicted `retention.py`'s. (Had vLLM
delayed freeing the request instead, as `request_finished` allows, its engine would step non-stop
for as long as any hold lasts, i.e. for the whole pause between a conversation's turns: measured
1.3 CPU cores per idle server holding one turn.) TP rank 0's transfer core ends a hold (read by the
decode node it was handed to, expired, or evicted; never while a reader's claim lasts) and reports
it in `DuplexWorkerMetadata.freed_holds`; the scheduler then drops its reference.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from kvduplex import protocol
from kvduplex.connector import metadata as md
from kvduplex.connector import vllm_private
from kvduplex.connector.config import DuplexConfig
from kvduplex.connector.events import HeldTurnEvents
from kvduplex.connector.expected_turns import ExpectedTurns
from kvduplex.connector.groups import NULL_BLOCK_ID, TransferGroups
from kvduplex.connector.held_blocks import HeldBlocks
from kvduplex.connector.idle_steps import IdleWaker
from kvduplex.connector.lookup import ASK_AGAIN, Lookups
from kvduplex.connector.offers import Offers
from kvduplex.connector.params import (
    ParamsContext,
    Rejected,
    RemoteBlocks,
    claim_release,
    parse_remote_blocks,
    unsupported_reason,
)
from kvduplex.connector.retention import LiveRequests, Retention
from kvduplex.connector.stats import DuplexConnectorStats
from kvduplex.connector.threshold import RecomputeThresholdEstimator
from kvduplex.connector.token_fingerprint import (
    PromptFingerprints,
    matched_prefix_tokens,
    prompt_fingerprints,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under vLLM's logger tree, so vLLM's handler, format and level apply.
logger = init_logger(f"vllm.{__name__}")



@dataclass
class _PullState:
    """A request whose params describe a peer's blocks; lives until the request finishes."""

    remote: RemoteBlocks | Rejected
    prompt: PromptFingerprints | None = None
    """The prompt's fingerprints, when its lookup computed them already."""
    matched_tokens: int = -1
    consumed: bool = False
    """The pull was decided (started, declined or impossible): never pull again."""
    last_num_computed: int = 0


class DuplexScheduler:
    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        config: DuplexConfig,
        engine_id: str,
    ) -> None:
        self._config = config
        self._engine_id = engine_id
        self._events = HeldTurnEvents(vllm_config)
        self._block_size = vllm_config.cache_config.block_size
        self._kv_cache_config = kv_cache_config
        self._groups = TransferGroups.from_kv_cache_config(kv_cache_config)
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._retention = Retention(
            int(config.decode_kv_hold_max_fraction * kv_cache_config.num_blocks)
        )
        self._live = LiveRequests(vllm_config)
        max_model_len = vllm_config.model_config.max_model_len
        self._params_context = ParamsContext(
            engine_id=engine_id,
            tp_size=self._tp_size,
            total_kv_heads=vllm_config.model_config.get_total_num_kv_heads(),
            block_size=self._block_size,
            max_model_len=max_model_len,
            bidirectional=config.bidirectional_kv_xfer,
            read_deadline_margin_s=config.read_deadline_margin_s,
            groups=self._groups,
        )
        self._estimator = (
            RecomputeThresholdEstimator(config.recompute_threshold, max_model_len)
            if config.auto_recompute_threshold
            else None
        )
        if self._groups.has_state:
            vllm_private.check_prompt_edit()

        self._pulls: dict[str, _PullState] = {}
        # Loads given to the workers: the claim to release and the TP ranks not done yet.
        self._reading: dict[str, tuple[md.ReleaseSpec | None, int]] = {}
        self._block_pool: BlockPool | None = None
        self._loads: list[md.LoadSpec] = []
        self._releases: list[md.ReleaseSpec] = []
        self._expected = ExpectedTurns(config.bidirectional_kv_xfer, self._block_size)
        self._stats = DuplexConnectorStats()
        # Our references in vLLM's block pool of each hold (`held_blocks.py`).
        self._held = HeldBlocks(self._retention, self._events, self._stats)
        # Grants for params and lookups by prompt (`lookup.py`).
        self._lookups = Lookups(
            config,
            self._params_context,
            self._stats,
            threshold=self.recompute_threshold,
            lookup_threshold=self._lookup_threshold,
            pullable=self._pullable,
            release=lambda release: self._releases.append(release),
        )
        # vLLM reset its caches: the next step ends every hold (`_holds_dropped`).
        self._end_holds = False
        self._waker = IdleWaker(self._next_idle_step_in)
        # What finished requests keep for readers (`offers.py`).
        self._offers = Offers(
            vllm_config,
            kv_cache_config,
            config,
            engine_id,
            self._groups,
            (self._retention, self._held, self._events, self._lookups, self._waker),
            self._stats,
        )

    # ---------------------------------------------------------------- reader

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

    def on_new_request(self, request: Request) -> None:
        self._live.add(request)
        self._stop_prefill_short(request)
        # Hashed once, for the turn it may hold and the grant of its params' blocks.
        prompt = self._expected.started(request)
        self._pull_state(request, prompt)

    def _stop_prefill_short(self, request: Request) -> None:
        """A prefill for another engine (`do_remote_decode`) of a model with a state-space
        group computes all but the prompt's last token: the reader pulls the state after
        those and computes the last token itself, as it would after a pull of the whole
        prompt (`TransferGroups.pull_limit`). Its one sampled token is the router's to drop."""
        params = request.kv_transfer_params
        if (
            not self._groups.has_state
            or not isinstance(params, dict)
            or params.get(protocol.DO_REMOTE_DECODE) is not True
            or request.num_prompt_tokens < 2
            or request.prompt_token_ids is None
            or request.skip_reading_prefix_cache
        ):
            return
        pool = self._block_pool
        vllm_private.drop_last_prompt_token(
            request, vllm_private.hash_block_size(pool) if pool is not None else None
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        state = self._pull_state(request)
        if state is None and not _computes_alone(request):
            found = self._lookups.look_up(request, num_computed_tokens)
            if found is ASK_AGAIN:
                return self._live.matched(request, None, False)
            if found is not None:
                state = _PullState(remote=found.remote, prompt=found.prompt)
                self._pulls[request.request_id] = state
        if state is None or state.consumed or isinstance(state.remote, Rejected):
            return self._live.matched(request, 0, False)
        state.last_num_computed = num_computed_tokens
        gain = self._pullable_tokens(request, state, num_computed_tokens) - num_computed_tokens
        if gain <= 0 or gain < self.recompute_threshold():
            return self._live.matched(request, 0, False)
        return self._live.matched(request, gain, not self._layerwise(state.remote))

    def _layerwise(self, remote: RemoteBlocks) -> bool:
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
            and len(remote.peer.ports) == self._tp_size
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._pulls.get(request.request_id)
        if state is None or state.consumed:
            return
        state.consumed = True
        remote = state.remote
        if isinstance(remote, Rejected):
            self._hand_back(remote)
            return
        if num_external_tokens <= 0:
            self._decline(request, state)
            return
        # The local prefix-cache hit is block-aligned: the load starts at a block boundary.
        first_block = state.last_num_computed // self._block_size
        end_block = -(-(state.last_num_computed + num_external_tokens) // self._block_size)
        local_ids: list[int] = []
        remote_ids: list[int] = []
        blocks_per_group: list[int] = []
        missing: list[str] = []
        num_tokens = state.last_num_computed + num_external_tokens
        local_tables = self._kv_cache_config.select_transfer_block_ids(blocks.get_block_ids())
        for index, (local_table, remote_table) in enumerate(zip(local_tables, remote.block_ids)):
            needed = self._groups.needed_blocks(index, local_table, num_tokens)
            if needed[first_block:end_block] != local_table[first_block:end_block]:
                # vLLM would take a state-space block other than the running state's as
                # computed (a checkpoint at a block boundary); kvduplex pulls no such state.
                missing.append(
                    f"KV-cache group {self._groups.groups[index].group_id}: a state checkpoint"
                )
            pairs = [
                (local_id, remote_id)
                for local_id, remote_id in zip(
                    needed[first_block:end_block], remote_table[first_block:end_block]
                )
                # vLLM's null block: outside this group's window (or not the running state
                # of a state-space group), nothing to load.
                if local_id != NULL_BLOCK_ID
            ]
            if any(remote_id == NULL_BLOCK_ID for _, remote_id in pairs):
                missing.append(
                    f"KV-cache group {self._groups.groups[index].group_id}: freed by the owner"
                )
            local_ids.extend(local_id for local_id, _ in pairs)
            remote_ids.extend(remote_id for _, remote_id in pairs)
            blocks_per_group.append(len(pairs))
        self._loads.append(
            md.LoadSpec(
                request_id=request.request_id,
                peer=remote.peer,
                remote_request_id=remote.remote_request_id,
                local_block_ids=tuple(local_ids),
                remote_block_ids=tuple(remote_ids),
                num_tokens=num_external_tokens,
                lease_expiry=remote.lease_expiry,
                blocks_per_group=tuple(blocks_per_group),
                layerwise=self._layerwise(remote),
                # Never happens when vLLM frees sliding-window blocks by the rule
                # `TransferGroups.pullable_tokens` checked; if it does, recompute, never read
                # a freed block.
                failure=(
                    f"blocks this request needs cannot be pulled ({'; '.join(missing)})"
                    if missing
                    else None
                ),
            )
        )
        # Every rank reports the load done (read or failed); then the claim goes back.
        self._reading[request.request_id] = (remote.release(), self._tp_size)
        logger.debug(
            "Request %s pulls %d tokens (%s blocks per KV-cache group) from engine %s",
            request.request_id,
            num_external_tokens,
            blocks_per_group,
            remote.peer.engine_id,
        )

    def _decline(self, request: Request, state: _PullState) -> None:
        """No pull for this request: tell the owner to free its blocks now."""
        remote = state.remote
        assert isinstance(remote, RemoteBlocks)
        self._hand_back(remote)
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

    def _hand_back(self, remote: RemoteBlocks | Rejected) -> None:
        """End the owner's claim, if it granted one."""
        release = claim_release(remote)
        if release is not None:
            self._releases.append(release)

    def _pull_state(
        self, request: Request, prompt: PromptFingerprints | None = None
    ) -> _PullState | None:
        state = self._pulls.get(request.request_id)
        if state is not None or request.request_id in self._lookups:
            return state
        remote = parse_remote_blocks(request.kv_transfer_params, self._params_context)
        if remote is None:
            return None
        if isinstance(remote, RemoteBlocks):
            unsupported = unsupported_reason(request)
            if unsupported is not None:
                remote = Rejected(unsupported)
            else:
                # A hint: its owner is asked for a grant first (`Lookups.look_up`).
                self._lookups.name_owner(request, remote, prompt)
                return None
        if isinstance(remote, Rejected):
            self._stats.add("fallbacks")
            logger.warning(
                "Request %s runs without KV transfer: %s", request.request_id, remote.reason
            )
        state = _PullState(remote=remote)
        self._pulls[request.request_id] = state
        return state

    def _pullable_tokens(self, request: Request, state: _PullState, num_computed_tokens: int) -> int:
        """Prompt tokens, from the first, whose KV the peer holds for the same token ids, in
        every block each KV-cache group needs beyond the local hit (else the local hit)."""
        remote = state.remote
        assert isinstance(remote, RemoteBlocks)
        if state.matched_tokens < 0:
            prompt = request.prompt_token_ids or []
            if state.prompt is None:  # kept: a turn held after it extends them
                state.prompt = prompt_fingerprints(request, self._block_size)
            fingerprints = state.prompt
            matched, mismatch_block = matched_prefix_tokens(
                fingerprints, remote.fingerprints, remote.num_tokens
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

    # ----------------------------------------------------------------- owner

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """`block_ids`: the request's block table of every KV-cache group (vLLM's order)."""
        self._live.remove(request.request_id)
        self._expected.finished(request.request_id)
        state = self._pulls.pop(request.request_id, None)
        self._lookups.finished(request.request_id)
        if state is not None and not state.consumed:
            # Finished (e.g. aborted) before it was ever scheduled: end the owner's claim.
            self._hand_back(state.remote)

        prompt = state.prompt if state is not None else None
        return self._offers.finished(request, block_ids, prompt)

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self._live.bind(manager)
        vllm_private.check_block_pool(manager.block_pool)
        self._block_pool = manager.block_pool
        self._offers.bind(manager.block_pool)
        self._held.bind(manager.block_pool, self._holds_dropped)

    # ------------------------------------------------------------- retention

    def has_pending_block_frees(self) -> bool:
        """vLLM asks when a running request cannot get blocks, before it preempts one:
        holds are given up first (an order now, if none is under way), and the request
        waits for their blocks. False once nothing held can go (claimed: vLLM preempts)."""
        now = time.time()
        if not self._retention.frees_pending(now) and self._block_pool is not None:
            free = vllm_private.num_free_blocks(self._block_pool)
            self._retention.pressure(free, max(self._live.running_need(free), free + 1), 0, now)
        return self._retention.frees_pending(now)

    def reset_cache(self) -> bool:
        """vLLM resets its caches where the weights change in place (its pause and sleep for
        weight updates, `reset_prefix_cache(reset_connector=True)`; after `reload_weights`,
        `update_weights` or a `collective_rpc` that loads weights, its callers must): KV held
        for readers was computed with the old weights. vLLM has no weight version a connector
        could see: this reset is its only sign of new weights. Every hold was dropped already
        if vLLM's own reset could succeed then (`held_blocks.py`), else now; succeeds."""
        if self._held.drop_all():
            self._holds_dropped()
        return True

    def _holds_dropped(self) -> None:
        """The next step (at once, if idle) orders TP rank 0 to end every hold taken before
        (`WorkerHolds.end_all`). With nothing held no step is asked for (vLLM's sleep
        resets its caches just before it puts the workers to sleep, whose connector ends the
        holds itself: `DuplexWorker.unregister_kv_caches`)."""
        self._end_holds = True
        self._waker.poke()

    def has_pending_push_work(self) -> bool:
        """Keeps an idle engine stepping while a hold is due to end (`retention.py`, or every
        hold: `reset_cache`) or the copy of the announcements to be renewed
        (`held_mirror.py`)."""
        delay = self._next_idle_step_in()
        return delay is not None and delay <= 0

    def _poke_if_renewing(self) -> None:
        """The idle waker waits without a timeout while no step is due: tell it while the copy
        of the announcements is renewed (it may have just become trusted, a lookup may have
        opened the renewal window again, a D may have become known); per step built and per
        report."""
        if self._lookups.refresh_at(time.monotonic()) is not None:
            self._waker.nudge()

    def _next_idle_step_in(self) -> float | None:
        """Seconds until an idle engine should step (<= 0: now; None: no step is due).
        Called by the idle waker's thread too."""
        if self._end_holds:
            return 0.0
        delays = []
        wake_at = self._retention.wake_at()
        if wake_at is not None:
            delays.append(wake_at - time.time())
        now = time.monotonic()
        refresh_at = self._lookups.refresh_at(now)
        if refresh_at is not None:
            delays.append(refresh_at - now)
        return min(delays, default=None)

    def shutdown(self) -> None:
        self._waker.close()

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        by_rank: dict[int, md.DuplexHandshakeMetadata] = {}
        for tp_rank, rank_metadata in metadata.items():
            if not isinstance(rank_metadata, md.DuplexHandshakeMetadata):
                raise TypeError(
                    f"DuplexConnector expected DuplexHandshakeMetadata from TP rank {tp_rank}, "
                    f"got {type(rank_metadata).__name__}"
                )
            by_rank[tp_rank] = rank_metadata
        if sorted(by_rank) != list(range(self._tp_size)):
            raise ValueError(
                f"DuplexConnector expected transfer-engine addresses from TP ranks "
                f"0..{self._tp_size - 1}, got ranks {sorted(by_rank)}"
            )
        hosts = {m.host for m in by_rank.values()}
        if len(hosts) != 1:
            raise ValueError(
                f"DuplexConnector: TP workers announce different hosts {sorted(hosts)}; "
                "all ranks of one engine must share side_channel_host"
            )
        host, ports = hosts.pop(), tuple(by_rank[rank].port for rank in range(self._tp_size))
        self._offers.set_address(host, ports)
        logger.info(
            "DuplexConnector engine %s offers KV blocks at %s ports %s",
            self._engine_id,
            host,
            list(ports),
        )

    # ------------------------------------------------------------------ steps

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> md.DuplexConnectorMetadata:
        now = time.time()
        self._live.preempted(scheduler_output.preempted_req_ids)
        if self._block_pool is not None and self._held:
            # Before vLLM would preempt or a waiting request wait: free the held blocks needed.
            free = vllm_private.num_free_blocks(self._block_pool)
            self._retention.pressure(free, *self._live.blocks_needed(free, scheduler_output), now)
        expected, settled = self._expected.take()
        meta = md.DuplexConnectorMetadata(
            loads=self._loads,
            releases=self._releases,
            holds=self._offers.take_holds(),
            expected=expected,
            settled=settled,
            lookups=self._lookups.take_specs(),
            renewals=self._lookups.take_renewals(),
            evict=self._retention.take_order(now),
            idle=scheduler_output.total_num_scheduled_tokens == 0,
            end_holds=self._end_holds,
        )
        self._end_holds = False
        self._retention.stepped(now)
        self._poke_if_renewing()
        if meta.holds:
            self._retention.shipped([hold.request_id for hold in meta.holds], now)
        self._loads, self._releases = [], []
        if self._estimator is not None:
            self._estimator.step_built(
                time.perf_counter(), scheduler_output.total_num_scheduled_tokens
            )
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        worker_meta = connector_output.kv_connector_worker_meta
        if not isinstance(worker_meta, md.DuplexWorkerMetadata):
            worker_meta = None
        # The copy first: the idle waker's thread reads the report count with it (`refresh_at`).
        self._lookups.announced(worker_meta.announced if worker_meta is not None else None)
        self._lookups.on_report(worker_meta)
        self._poke_if_renewing()
        if worker_meta is not None:
            freed_blocks = self._held.end(worker_meta.freed_holds)
            self._retention.acknowledged(worker_meta.evictions_done, freed_blocks, time.time())
            self._on_loads_done(worker_meta.loads_done)
        if self._estimator is None:
            return
        # One call per step built, in the order built: vLLM's executors attach a connector
        # output to every step's output, and EngineCore takes them in order.
        self._estimator.step_done(time.perf_counter())
        worker_stats = connector_output.kv_connector_stats
        if worker_stats is not None:
            for seconds, tokens in zip(
                worker_stats.data.get("transfer_s", ()),
                worker_stats.data.get("transfer_tokens", ()),
            ):
                self._estimator.observe_read(seconds, tokens)

    def _on_loads_done(self, request_ids: list[str]) -> None:
        """Each TP rank reports a load done once; after the last, the owner's claim ends."""
        for request_id in request_ids:
            reading = self._reading.pop(request_id, None)
            if reading is None:
                logger.warning("A worker finished a load for request %s, which loads none", request_id)
                continue
            release, ranks_left = reading
            if ranks_left > 1:
                self._reading[request_id] = (release, ranks_left - 1)
            elif release is not None:
                self._releases.append(release)

    def get_kv_connector_stats(self) -> DuplexConnectorStats | None:
        return self._stats.take()

    def take_events(self) -> list[KVCacheEvent]:
        """KV events of the turns held and ended since the last call (`events.py`)."""
        return self._events.take()


def _computes_alone(request: Request) -> bool:
    """A router sent the request here to compute alone (`protocol.KEEP_TURN`): it holds the
    history itself, so it looks nothing up and pulls nothing."""
    params = request.kv_transfer_params
    return isinstance(params, dict) and params.get(protocol.KEEP_TURN) is True
