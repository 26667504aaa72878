"""Owner side of the scheduler: what a finished request keeps for readers, and the params
that describe it.

A prefill request (`do_remote_decode`) that finished normally, and with
`bidirectional_kv_xfer` a decode request (`do_remote_prefill`) that finished normally (also on
a stop string, which vLLM finishes as an abort: `held_output_tokens`), keep their blocks under a
hold (with the fingerprints of the tokens they carry, for grants) and return params describing
them. The hold is a reference of our own on the blocks in vLLM's block pool, kept in the one
record of held turns (`holds.py`): vLLM frees the request at once, and the blocks stay allocated
until the hold ends. What is evicted: `retention.py`. The workers' TP rank 0 takes each hold into its
hold book (`worker_holds.py`) from the step's `HoldSpec`s (`Offers.take_holds`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.tokenizers import cached_tokenizer_from_config
from vllm.v1.request import RequestStatus

from kvduplex import protocol
from kvduplex.connector import metadata as md
from kvduplex.connector import vllm_private
from kvduplex.connector.groups import NULL_BLOCK_ID
from kvduplex.connector.params import hands_off, takes_over, unsupported_reason
from kvduplex.connector.token_fingerprint import PromptFingerprints, block_fingerprints, salt_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.tokenizers import TokenizerLike
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from kvduplex.connector.config import DuplexConfig
    from kvduplex.connector.groups import TransferGroups
    from kvduplex.connector.holds import Holds
    from kvduplex.connector.idle_steps import IdleWaker
    from kvduplex.connector.lookup import Lookups
    from kvduplex.connector.retention import Retention
    from kvduplex.connector.stats import DuplexConnectorStats

# Under vLLM's logger tree, so vLLM's handler, format and level apply.
logger = init_logger(f"vllm.{__name__}")

_HOLDABLE_STATUSES = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


class Offers:
    """The scheduler's owner side (`DuplexScheduler` owns one and passes its parts)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        config: DuplexConfig,
        engine_id: str,
        groups: TransferGroups,
        parts: tuple[Retention, Holds, Lookups, IdleWaker],
        stats: DuplexConnectorStats,
    ) -> None:
        self._config = config
        self._engine_id = engine_id
        self._block_size = vllm_config.cache_config.block_size
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._kv_cache_config = kv_cache_config
        self._groups = groups
        self._retention, self._held, self._lookups, self._waker = parts
        self._stats = stats
        # Tells a turn that ended on a stop string from a client's abort (`held_output_tokens`).
        # The EngineCore's structured-output manager loaded this tokenizer already (cached).
        self._tokenizer = cached_tokenizer_from_config(vllm_config.model_config)
        # Side channels of this engine's workers, index = TP rank; None until workers report.
        self._host: str | None = None
        self._ports: tuple[int, ...] | None = None
        self._missing_address_logged = False
        self._missing_pool_logged = False
        self._block_pool: BlockPool | None = None
        self._holds: list[md.HoldSpec] = []

    def set_address(self, host: str, ports: tuple[int, ...]) -> None:
        """Where this engine's workers serve their blocks (every TP rank's port)."""
        self._host, self._ports = host, ports

    def bind(self, block_pool: BlockPool) -> None:
        self._block_pool = block_pool

    def take_holds(self) -> list[md.HoldSpec]:
        """The holds taken since the last step, for the workers."""
        holds, self._holds = self._holds, []
        return holds

    def finished(
        self,
        request: Request,
        block_ids: tuple[list[int], ...],
        pulled_prompt: PromptFingerprints | None,
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's `request_finished` (`block_ids`: the request's block table of every KV-cache
        group, vLLM's order; `pulled_prompt`: the prompt's fingerprints if its pull computed
        them): whether vLLM must delay freeing the blocks (never: our hold keeps them) and the
        params of what is held, if anything."""
        params = request.kv_transfer_params
        if not isinstance(params, dict):
            return False, None
        output_tokens = held_output_tokens(request, self._tokenizer)
        if output_tokens is None:
            return False, None
        prompt: PromptFingerprints | None = None  # its fingerprints, where computed already
        if hands_off(params):
            decode_turn = False
            ttl_s = self._config.kv_lease_ttl_s
            # Whether or not we hold the prompt for it, the decode node may hold its turn.
            prompt = self._lookups.handed_off(request)
        elif takes_over(params) and self._config.bidirectional_kv_xfer:
            decode_turn = True
            ttl_s = self._config.decode_kv_hold_ttl_s
            # The prompt's fingerprints, computed when its pull was matched.
            prompt = pulled_prompt
        else:
            return False, None

        if self._groups.has_state and request.num_in_flight_tokens > 0:
            # A state-space group's state already moves past a token still in flight (async
            # scheduling): it holds no state of the turn's computed tokens alone.
            logger.debug(
                "Request %s: a token is in flight, so its state is not offered", request.request_id
            )
            return False, None
        computed = max(0, request.num_computed_tokens - request.num_in_flight_tokens)
        num_tokens = min(computed, request.num_prompt_tokens + output_tokens)
        if self._groups.has_state and num_tokens < computed:
            # A state-space group's state is that after every computed token, not the turn's.
            logger.debug(
                "Request %s: its state is past the answer its client saw, so it is not offered",
                request.request_id,
            )
            return False, None
        num_blocks = -(-num_tokens // self._block_size)
        # Per transfer group, one entry per block of the turn; vLLM has put its null block
        # where a sliding-window group freed blocks outside its window; of a state-space
        # group's, only the running state is offered.
        tables = [
            self._groups.needed_blocks(index, table[:num_blocks], num_tokens)
            for index, table in enumerate(
                self._kv_cache_config.select_transfer_block_ids(block_ids)
            )
        ]
        if num_blocks == 0 or any(len(table) < num_blocks for table in tables):
            return False, None
        if any(
            group.state_space and tables[index][-1] == NULL_BLOCK_ID
            for index, group in enumerate(self._groups.groups)
        ):
            logger.debug(
                "Request %s: no state after its %d tokens to offer", request.request_id, num_tokens
            )
            return False, None
        self._keep_edge_blocks(request, tables, num_tokens)
        held_ids = [block_id for table in tables for block_id in table if block_id != NULL_BLOCK_ID]
        if unsupported_reason(request) is not None:
            return False, None
        if self._block_pool is None:
            if not self._missing_pool_logged:
                self._missing_pool_logged = True
                logger.warning(
                    "vLLM bound no block pool to DuplexConnector; finished requests free their "
                    "KV blocks instead of offering them to peers"
                )
            return False, None
        if request.request_id in self._held:
            logger.warning("Request %s is held already; not holding it twice", request.request_id)
            return False, None
        if self._host is None or self._ports is None:
            if not self._missing_address_logged:
                self._missing_address_logged = True
                logger.warning(
                    "No transfer-engine address from the workers yet; finished requests "
                    "free their KV blocks instead of offering them to peers"
                )
            return False, None
        if decode_turn and len(held_ids) > self._retention.max_turn_blocks:
            logger.debug(
                "Request %s: not holding %d blocks, more than held turns may use (%d)",
                request.request_id,
                len(held_ids),
                self._retention.max_turn_blocks,
            )
            return False, None

        if prompt is not None and num_tokens <= len(prompt.token_ids):
            fingerprints = prompt.of_prefix(num_tokens)  # hashed once, for the handoff
        elif prompt is not None:  # a turn: its prompt's blocks were hashed for the pull
            fingerprints = prompt.extended(request.all_token_ids[:num_tokens]).of_prefix(
                num_tokens
            )
        else:
            fingerprints = block_fingerprints(
                request.all_token_ids[:num_tokens], self._block_size, salt_of(request)
            )
        lease_expiry = time.time() + ttl_s
        self._held.keep(request.request_id, held_ids, decode_turn, lease_expiry)
        if decode_turn:
            # A turn past the cap orders room: the workers free the least recently used
            # unclaimed turns (every read of a held turn is claimed, so none is freed under a read).
            self._retention.turn_held()
        self._waker.poke()
        if not decode_turn:
            # The decode node it goes to announces itself to our workers when it reads: the
            # next turn's lookup has an engine to ask.
            self._lookups.peers_known()
        params = {
            protocol.DO_REMOTE_PREFILL: not decode_turn,
            protocol.DO_REMOTE_DECODE: decode_turn,
            protocol.REMOTE_ENGINE_ID: self._engine_id,
            protocol.REMOTE_REQUEST_ID: request.request_id,
            protocol.REMOTE_HOST: self._host,
            protocol.REMOTE_PORT: self._ports[0],
            protocol.REMOTE_PORTS: list(self._ports),
            protocol.TP_SIZE: self._tp_size,
            # vLLM's flat list for one group, one list per group for a hybrid model.
            protocol.REMOTE_BLOCK_IDS: tables if self._groups.hybrid else tables[0],
            protocol.REMOTE_NUM_TOKENS: num_tokens,
            protocol.REMOTE_BLOCK_SIZE: self._block_size,
            protocol.REMOTE_BLOCK_FINGERPRINTS: fingerprints,
            protocol.REMOTE_LEASE_EXPIRY: lease_expiry,
            protocol.PROTOCOL_KEY: protocol.PROTOCOL_VERSION,
        }
        self._holds.append(
            md.HoldSpec(
                request_id=request.request_id,
                lease_expiry=lease_expiry,
                num_blocks=len(held_ids),
                fingerprints=tuple(fingerprints),
                turn=decode_turn,
                offer=protocol.encode_offer(params),
                prompt_blocks=request.num_prompt_tokens // self._block_size,
            )
        )
        return False, params

    def _keep_edge_blocks(self, request: Request, tables: list[list[int]], num_tokens: int) -> None:
        """Put back into `tables` the sliding-window blocks a reader of the whole turn as its
        prompt needs (`TransferGroups.pull_limit`) but vLLM has already freed: they are still
        in vLLM's prefix cache, found by the turn's block hash (held like the others). Not
        found: the table keeps the null block, and such a reader computes instead."""
        pool = self._block_pool
        if pool is None or vllm_private.hash_block_size(pool) != self._block_size:
            return
        for index, block in self._groups.edge_blocks(num_tokens):
            if tables[index][block] != NULL_BLOCK_ID or block >= len(request.block_hashes):
                continue
            group_id = self._groups.groups[index].group_id
            cached = vllm_private.cached_block_id(pool, request.block_hashes[block], group_id)
            if cached is not None:
                tables[index][block] = cached


def held_output_tokens(request: Request, tokenizer: TokenizerLike | None) -> int | None:
    """How many of a finished request's output tokens its turn holds: the answer its client
    saw, None when the request is not worth holding. vLLM 0.32 matches stop strings in the
    frontend, which cuts the answer before the first one (past `min_tokens`, where its
    detokenizer looks) and aborts the request in the engine core as it does a client's abort
    (FINISHED_ABORTED, no reason given). The engine may have computed a few tokens past the
    stop string by then, or even reached max_tokens or eos before the abort came, their number
    a matter of timing; held, they would spoil the turn's partial last block for the next
    turn's prompt. So: a request with stop strings holds the tokens before the first one
    (every one when its answer has none, unless it was aborted: then its client aborted it,
    and it is never held); a request without, every token if it finished in the engine
    (length, eos, stop token). The answer's text is decoded from its ids alone, where vLLM's
    frontend decodes them after the prompt's: with a tokenizer whose text depends on that
    (a SentencePiece answer's leading space) a stop string may be placed otherwise, and the
    reader, which checks every held token, reuses the blocks before the difference."""
    output = request.output_token_ids
    params = request.sampling_params
    aborted = request.status == RequestStatus.FINISHED_ABORTED
    if not aborted and request.status not in _HOLDABLE_STATUSES:
        return None
    # Without a tokenizer vLLM's frontend matches no stop strings either.
    if params is None or not params.stop or len(output) <= params.min_tokens or tokenizer is None:
        return None if aborted else len(output)
    output = list(output)
    skip = params.skip_special_tokens

    def decode(count: int) -> str:
        return tokenizer.decode(output[:count], skip_special_tokens=skip)

    text = decode(len(output))
    checked_from = len(decode(params.min_tokens))
    # As vLLM's `check_stop_strings`: the stop string that ends first, the first listed of
    # those that end together.
    found = [
        (at + len(stop), order, at, len(stop))
        for order, stop in enumerate(params.stop)
        if (at := text.find(stop, max(0, checked_from - len(stop) + 1))) >= 0
    ]
    if not found:
        return None if aborted else len(output)
    _, _, at, length = min(found)
    seen = at + length if params.include_stop_str_in_output else at
    # The longest output prefix whose text the client saw whole: binary search on the text's
    # length (it grows with the tokens), then back off while the text is not a prefix (a
    # tokenizer may rewrite earlier characters as tokens join); O(log n) decodes.
    low, high = 0, len(output)
    while low < high:
        middle = (low + high + 1) // 2
        if len(decode(middle)) <= seen:
            low = middle
        else:
            high = middle - 1
    while low > 0 and not text[:seen].startswith(decode(low)):
        low -= 1
    return low
