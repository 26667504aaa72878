"""Plain picklable data crossing process boundaries inside one vLLM engine.

Scheduler -> workers: `DuplexConnectorMetadata` (inside vLLM's SchedulerOutput), once per step.
Workers -> scheduler: `DuplexHandshakeMetadata` (each worker's engine address), once at start,
and `DuplexWorkerMetadata` (finished lookups), every step.
Between engines, see `kvduplex.protocol`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass(frozen=True)
class PeerAddress:
    """A remote vLLM engine: its kv-transfer engine id and each TP rank's side channel."""

    engine_id: str
    host: str
    ports: tuple[int, ...]

    def rank_engine_id(self, tp_rank: int) -> str:
        return rank_engine_id(self.engine_id, tp_rank)


def rank_engine_id(engine_id: str, tp_rank: int) -> str:
    """The transfer-core engine id of one TP rank of a vLLM engine."""
    return f"{engine_id}/tp{tp_rank}"


@dataclass(frozen=True)
class LoadSpec:
    """Read `remote_block_ids[i]` of the peer into `local_block_ids[i]` for a local request."""

    request_id: str
    peer: PeerAddress
    remote_request_id: str
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]
    num_tokens: int
    lease_expiry: float
    """Wall-clock time (time.time()) at which the owner frees the blocks."""
    blocks_per_group: tuple[int, ...]
    """How many of the blocks belong to each transfer group (in order), for the stats."""
    claim_id: int | None = None
    """The owner's claim when the blocks were found by a lookup."""
    layerwise: bool = False
    """Read layer by layer within this step's forward pass (`layerwise_load`); vLLM counts
    the tokens computed already, so the read must finish before each layer runs."""
    failure: str | None = None
    """Set when the scheduler found the pull impossible after vLLM allocated for it: the
    worker reports the blocks as failed (vLLM recomputes) and reads nothing."""


@dataclass(frozen=True)
class ReleaseSpec:
    """Tell the peer it may free the blocks it holds for its request (nothing will be read)."""

    peer: PeerAddress
    remote_request_id: str
    claim_id: int | None = None


@dataclass(frozen=True)
class HoldSpec:
    """Blocks of a finished local request stay allocated until read or `ttl_s` passed.

    With fingerprints (a decode node's finished turn) the hold is also offered to other
    engines' lookups, which get `offer` (the turn's kv_transfer_params, JSON) when they match.
    """

    request_id: str
    ttl_s: float
    num_blocks: int
    fingerprints: tuple[str, ...] = ()
    offer: bytes = b""


@dataclass(frozen=True)
class LookupSpec:
    """Ask the known owners which of them holds the longest prefix of these blocks."""

    request_id: str
    fingerprints: tuple[str, ...]
    timeout_s: float
    hint: str | None = None
    """A router's "host:port" of the owner that served the conversation's last turn."""


@dataclass(frozen=True)
class LookupMatch:
    """An owner's answer: it holds `matched_blocks` leading blocks, claimed for us."""

    owner_engine_id: str
    owner_address: str
    """The side channel ("host:port") that answered; claims are released there."""
    owner_request_id: str
    matched_blocks: int
    claim_id: int
    claim_expiry: float
    """Wall-clock time (time.time()) the claim ends, counted from when the lookup was sent."""
    offer: bytes


@dataclass
class DuplexConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    releases: list[ReleaseSpec] = field(default_factory=list)
    holds: list[HoldSpec] = field(default_factory=list)
    lookups: list[LookupSpec] = field(default_factory=list)
    evict_blocks: int = 0
    """Free at least this many blocks of unclaimed held turns, least recently used first."""


@dataclass
class DuplexWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler at the end of a step.

    `lookups`: lookups finished this step, request id -> every owner's match, longest first
    (empty: nobody holds any of the prompt). The scheduler picks, since only it can check the
    partial last block of each turn against the prompt's tokens. Only TP rank 0 looks up.

    `freed_holds`: requests whose hold ended on a rank this step (released, expired, evicted or
    never taken), once per rank: the scheduler gives the blocks back when every rank has."""

    lookups: dict[str, list[LookupMatch]] = field(default_factory=dict)
    freed_holds: list[str] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> DuplexWorkerMetadata:
        if not isinstance(other, DuplexWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into DuplexWorkerMetadata")
        return DuplexWorkerMetadata(
            lookups={**self.lookups, **other.lookups},
            freed_holds=[*self.freed_holds, *other.freed_holds],
        )


@dataclass
class DuplexHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Where one worker's transfer engine listens; the scheduler announces it in params."""

    tp_rank: int
    host: str
    port: int
