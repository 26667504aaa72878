"""Plain picklable data crossing process boundaries, and the wire-level protocol constants.

Scheduler -> workers: `DuplexConnectorMetadata` (inside vLLM's SchedulerOutput), once per step.
Workers -> scheduler: `DuplexHandshakeMetadata` (each worker's engine address), once at start.
Engine -> engine: release notifications (`encode_release` / `decode_release`), sent by a reader
when it has read an owner's blocks or decided not to, so the owner frees them at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

# Version of kvduplex's kv_transfer_params extensions and notification payloads. Both sides of
# a transfer must speak the same version; the transfer core's handshake checks its own.
PROTOCOL_VERSION = 1

# kv_transfer_params keys. The first group is vLLM's (what existing P/D proxies forward); the
# second is kvduplex's own.
DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
REMOTE_ENGINE_ID = "remote_engine_id"
REMOTE_BLOCK_IDS = "remote_block_ids"
REMOTE_HOST = "remote_host"
REMOTE_PORT = "remote_port"
REMOTE_REQUEST_ID = "remote_request_id"
TP_SIZE = "tp_size"
REMOTE_NUM_TOKENS = "remote_num_tokens"
PROTOCOL_KEY = "kvduplex_protocol"
REMOTE_PORTS = "remote_ports"
REMOTE_BLOCK_SIZE = "remote_block_size"
REMOTE_BLOCK_FINGERPRINTS = "remote_block_fingerprints"
REMOTE_LEASE_EXPIRY = "remote_lease_expiry"


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


@dataclass(frozen=True)
class ReleaseSpec:
    """Tell the peer it may free the blocks it holds for its request (nothing will be read)."""

    peer: PeerAddress
    remote_request_id: str


@dataclass(frozen=True)
class HoldSpec:
    """Blocks of a finished local request stay allocated until read or `ttl_s` passed."""

    request_id: str
    ttl_s: float


@dataclass
class DuplexConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    releases: list[ReleaseSpec] = field(default_factory=list)
    holds: list[HoldSpec] = field(default_factory=list)


@dataclass
class DuplexHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Where one worker's transfer engine listens; the scheduler announces it in params."""

    tp_rank: int
    host: str
    port: int


def encode_release(owner_request_id: str) -> bytes:
    return json.dumps({"v": PROTOCOL_VERSION, "release": owner_request_id}).encode()


def decode_release(payload: bytes) -> str | None:
    """The owner request id a release notification names, or None if it is not one."""
    try:
        message = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(message, dict) or message.get("v") != PROTOCOL_VERSION:
        return None
    request_id = message.get("release")
    return request_id if isinstance(request_id, str) else None
