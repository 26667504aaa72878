"""Plain picklable data crossing process boundaries inside one vLLM engine.

Scheduler -> workers: `DuplexConnectorMetadata` (inside vLLM's SchedulerOutput), once per step.
Workers -> scheduler: `DuplexHandshakeMetadata` (each worker's engine address), once at start,
and `DuplexWorkerMetadata` (finished lookups, ended holds and loads), every step.
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
    """Wall-clock time (time.time()) at which the owner's claim for us ends."""
    blocks_per_group: tuple[int, ...]
    """How many of the blocks belong to each transfer group (in order), for the stats."""
    layerwise: bool = False
    """Read layer by layer within this step's forward pass (`layerwise_load`); vLLM counts
    the tokens computed already, so the read must finish before each layer runs."""
    failure: str | None = None
    """Set when the scheduler found the pull impossible after vLLM allocated for it: the
    worker reports the blocks as failed (vLLM recomputes) and reads nothing."""


@dataclass(frozen=True)
class ReleaseSpec:
    """Tell the owner (its TP rank 0) that our claim on its request's blocks ends: read, or
    nothing will be."""

    peer: PeerAddress
    remote_request_id: str
    claim_id: int


@dataclass(frozen=True)
class RenewSpec:
    """Ask the owner (its TP rank 0) to renew the lease of its hold `remote_request_id`, which
    this engine's queued request will ask a grant of (`renewals.py`); `first_fingerprint`: the
    request's own first block's."""

    peer: PeerAddress
    remote_request_id: str
    first_fingerprint: str


@dataclass(frozen=True)
class HoldSpec:
    """Blocks of a finished local request stay allocated for readers the owner grants them
    to (against `fingerprints`, the tokens the blocks carry), until `lease_expiry` (wall
    clock, the same moment the scheduler counts and the params announce); a prefill
    node's prompt (`turn` False) also ends once its reader is done. A grant hands the reader
    `offer`, the hold's kv_transfer_params (JSON). A decode node's finished turn (`turn`) is
    also found by lookups and may be evicted."""

    request_id: str
    lease_expiry: float
    num_blocks: int
    fingerprints: tuple[str, ...]
    turn: bool
    offer: bytes
    prompt_blocks: int = 0
    """Of a turn: its prompt's full blocks (the last of them is announced to readers)."""


@dataclass(frozen=True)
class ExpectedTurn:
    """A decode request this engine may hold as a turn when it finishes, from its first step
    until it is settled (`expected_turns.py`); `end`: the fingerprint of its whole prompt."""

    request_id: str
    end: str


@dataclass(frozen=True)
class LookupSpec:
    """Ask the known owners which of them holds the longest prefix of these blocks or, with
    `owner_request_id`, ask `owner` for a grant of that hold's blocks that carry them."""

    request_id: str
    fingerprints: tuple[str, ...]
    deadline: float
    """`time.monotonic()` by which TP rank 0 reports the lookup with what has answered: its one
    deadline, set once by the scheduler when it asked (`lookup.py`)."""
    owner: str | None = None
    """The "host:port" (TP rank 0) that params named."""
    owner_request_id: str | None = None
    continues: str | None = None
    """A lookup's prompt continues this prompt (its end's fingerprint), which this engine handed
    to a decode node whose turn is not announced yet: an owner computing that turn answers "not
    yet"; the engines granted that prompt are asked whatever they announced, every engine when
    the transfer core knows none (`held_mirror.py`)."""


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


@dataclass(frozen=True)
class EvictOrder:
    """Free unclaimed holds, least recently used first, at least: `cap_blocks` blocks of
    held turns (their cap), `turn_blocks` of held turns and of prompts no reader claimed for
    `retention.UNREAD_PROMPT_S` (waiting requests need blocks), then `any_blocks` of any
    holds, prompts too (running requests need blocks). TP rank 0 carries it out as the step
    begins; the step's report (`freed_holds`) settles it (`retention.py`)."""

    cap_blocks: int = 0
    turn_blocks: int = 0
    any_blocks: int = 0

    @property
    def total(self) -> int:
        return self.cap_blocks + self.turn_blocks + self.any_blocks


@dataclass(frozen=True)
class AnnouncedChanges:
    """What the block fingerprints that the decode nodes announced they hold (TP rank 0's
    index of their announcements) gained and lost since the last report: `whole` says `added`
    is the whole set, unless it was too large to send (`complete` false: the copy is incomplete
    until a whole set comes). `synced`: every engine a lookup would ask has announced all it
    holds."""

    whole: bool
    added: tuple[str, ...]
    removed: tuple[str, ...]
    synced: bool
    complete: bool = True


@dataclass
class DuplexConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    releases: list[ReleaseSpec] = field(default_factory=list)
    renewals: list[RenewSpec] = field(default_factory=list)
    holds: list[HoldSpec] = field(default_factory=list)
    expected: list[ExpectedTurn] = field(default_factory=list)
    settled: list[str] = field(default_factory=list)
    """Expected turns that finished: held (in `holds`) or not."""
    lookups: list[LookupSpec] = field(default_factory=list)
    evict: EvictOrder | None = None
    idle: bool = False
    """The step computes no tokens: TP rank 0 may wait in it for its lookups' answers."""
    end_holds: bool = False
    """vLLM reset its caches (the weights changed): TP rank 0 ends every hold, those in
    `holds` too."""


@dataclass
class DuplexWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler at the end of a step.

    `lookups`: lookups finished this step, request id -> every owner's match, longest first
    (empty: nobody holds any of the prompt). The scheduler picks, since only it can check the
    partial last block of each turn against the prompt's tokens. Only TP rank 0 looks up.

    `freed_holds`: requests whose hold ended this step (read, expired, evicted or never taken);
    only TP rank 0 holds, so once each: the scheduler gives the blocks back.

    `loads_done`: requests whose load ended on a rank this step (read or failed), once per
    rank: the scheduler releases the owner's claim when every rank has.

    `lookup_targets`: how many engines a lookup would ask, when that
    changed (TP rank 0; -1: unchanged). `announced`: what the decode nodes' announcements
    changed, when they did (TP rank 0; None: unchanged)."""

    lookups: dict[str, list[LookupMatch]] = field(default_factory=dict)
    freed_holds: list[str] = field(default_factory=list)
    loads_done: list[str] = field(default_factory=list)
    lookup_targets: int = -1
    announced: AnnouncedChanges | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> DuplexWorkerMetadata:
        if not isinstance(other, DuplexWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into DuplexWorkerMetadata")
        return DuplexWorkerMetadata(
            lookups={**self.lookups, **other.lookups},
            freed_holds=[*self.freed_holds, *other.freed_holds],
            loads_done=[*self.loads_done, *other.loads_done],
            lookup_targets=max(self.lookup_targets, other.lookup_targets),
            announced=self.announced if self.announced is not None else other.announced,
        )


@dataclass
class DuplexHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Where one worker's transfer engine listens; the scheduler announces it in params."""

    tp_rank: int
    host: str
    port: int
