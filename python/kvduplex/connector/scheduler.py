"""Scheduler side of DuplexConnector: what to pull, what to hold, for how long.

Runs in vLLM's EngineCore process and never touches the transfer core; it tells the workers
what to do through `DuplexConnectorMetadata` once per step.

Reader (the node that pulls): nothing is read without the owner's grant. Whether a request
pulls, asks a peer first, or computes is decided in one place, `pull_decision.py` (params, the
announced holder, fan-out, compute); grants and lookups, asked and answered, are `lookup.py`'s
(`Lookups`). Once vLLM has allocated the request's blocks, the scheduler plans the load
(`update_state_after_alloc`): every TP rank reads, and the claim is released once every rank's
load is done, or at once when it does not pull (also when vLLM cannot admit it for a while:
`pull_decision.py`). Refused (other tokens, a hold already read by another decode node,
expired): the request computes its prompt, and the log says why. Each request pulls at most
once.

Owner (the node that holds): what a finished request keeps for readers and the params that
describe it are `offers.py`'s (`Offers`); its references in vLLM's block pool are
`holds.py`'s (`Holds`: one record per hold, the truth for what it pins; TP rank 0's hold book
the truth for who reads it and when it ends), and what is evicted `retention.py`'s. (Had vLLM
delayed freeing the request instead, as `request_finished` allows, its engine would step non-stop
for as long as any hold lasts, i.e. for the whole pause between a conversation's turns: measured
1.3 CPU cores per idle server holding one turn.) TP rank 0's transfer core ends a hold (read by the
decode node it was handed to, expired, or evicted; never while a reader's claim lasts) and reports
it in `DuplexWorkerMetadata.freed_holds`; the scheduler then drops its reference.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from kvduplex import protocol
from kvduplex.connector import metadata as md
from kvduplex.connector import vllm_private
from kvduplex.connector.config import DuplexConfig
from kvduplex.connector.expected_turns import ExpectedTurns
from kvduplex.connector.groups import NULL_BLOCK_ID, TransferGroups
from kvduplex.connector.holds import Holds
from kvduplex.connector.idle_steps import IdleWaker
from kvduplex.connector.offers import Offers
from kvduplex.connector.params import ParamsContext, Rejected
from kvduplex.connector.pull_decision import PullDecision
from kvduplex.connector.retention import LiveRequests, Retention
from kvduplex.connector.stats import DuplexConnectorStats
from kvduplex.connector.threshold import RecomputeThresholdEstimator

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under vLLM's logger tree, so vLLM's handler, format and level apply.
logger = init_logger(f"vllm.{__name__}")


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
        self._block_size = vllm_config.cache_config.block_size
        self._kv_cache_config = kv_cache_config
        self._groups = TransferGroups.from_kv_cache_config(kv_cache_config)
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
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

        # Loads given to the workers: the claim to release and the TP ranks not done yet.
        self._reading: dict[str, tuple[md.ReleaseSpec | None, int]] = {}
        self._block_pool: BlockPool | None = None
        self._loads: list[md.LoadSpec] = []
        self._releases: list[md.ReleaseSpec] = []
        self._expected = ExpectedTurns(config.bidirectional_kv_xfer, self._block_size)
        self._stats = DuplexConnectorStats()
        # The held turns (`holds.py`) and their eviction orders (`retention.py`).
        self._held = Holds(self._stats)
        self._retention = Retention(
            self._held, int(config.decode_kv_hold_max_fraction * kv_cache_config.num_blocks)
        )
        # What to pull, and the grants and lookups asked for it (`pull_decision.py`).
        self._decision = PullDecision(
            config,
            self._params_context,
            self._live,
            self._estimator,
            self._stats,
            release=lambda release: self._releases.append(release),
            claims_block_room=self._retention.fruitless_since,
        )
        self._lookups = self._decision.lookups
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
            (self._retention, self._held, self._lookups, self._waker),
            self._stats,
        )

    # ---------------------------------------------------------------- reader

    def on_new_request(self, request: Request) -> None:
        self._live.add(request)
        self._stop_prefill_short(request)
        # Hashed once, for the turn it may hold and the grant of its params' blocks.
        prompt = self._expected.started(request)
        self._decision.arrived(request, prompt)

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
        """Pull, ask a peer first, or compute (`pull_decision.py`, the order in one place)."""
        return self._decision.matched(request, num_computed_tokens, time.time())

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._decision.take(request.request_id)
        if state is None:
            return
        remote = state.remote
        if isinstance(remote, Rejected):
            self._decision.hand_back(remote)
            return
        if num_external_tokens <= 0:
            self._decision.declined(request, state)
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
                layerwise=self._decision.layerwise(remote),
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

    # ----------------------------------------------------------------- owner

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """`block_ids`: the request's block table of every KV-cache group (vLLM's order)."""
        self._live.remove(request.request_id)
        self._expected.finished(request.request_id)
        prompt = self._decision.finished(request.request_id)
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
        if not self._retention.frees_pending() and self._block_pool is not None:
            free = vllm_private.num_free_blocks(self._block_pool)
            need = max(self._live.running_need(free), free + 1)
            self._retention.pressure(free, need, 0, time.time())
        return self._retention.frees_pending()

    def reset_cache(self) -> bool:
        """vLLM resets its caches where the weights change in place (its pause and sleep for
        weight updates, `reset_prefix_cache(reset_connector=True)`; after `reload_weights`,
        `update_weights` or a `collective_rpc` that loads weights, its callers must): KV held
        for readers was computed with the old weights. vLLM has no weight version a connector
        could see: this reset is its only sign of new weights. Every hold was dropped already
        if vLLM's own reset could succeed then (`holds.py`), else now; succeeds."""
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
        """Keeps an idle engine stepping while a hold is due to end (`holds.py`, or every
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
        wake_at = self._held.wake_at()
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
            evict=self._retention.take_order(),
            idle=scheduler_output.total_num_scheduled_tokens == 0,
            end_holds=self._end_holds,
        )
        self._end_holds = False
        self._held.stepped(now)
        self._poke_if_renewing()
        if meta.holds:
            self._held.shipped([hold.request_id for hold in meta.holds], now)
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
        # The step's report: the holds TP rank 0 ended in it, and so its eviction order done.
        freed_blocks = self._held.end(worker_meta.freed_holds) if worker_meta is not None else 0
        self._retention.reported(freed_blocks, time.time())
        if worker_meta is not None:
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
