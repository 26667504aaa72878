"""kvduplex's wire protocol between engines, routers and clients, in one place.

Imports nothing from vLLM, so the proxy, the demo, benchmarks and tests use the same names
as the connector. What lives here:

- the `kv_transfer_params` keys: vLLM's own (what every P/D router forwards) and kvduplex's
  extensions, with the protocol version that both sides of a transfer must share;
- the notifications a reader sends an owner over the transfer core's side channel (`release`,
  `renew`);
- grants and lookups: the token fingerprints a reader asks about and the owner's answer
  (carried by the transfer core's Lookup/LookupReply frames, see `rust/src/holds.rs`), whose
  offer is the hold's kv_transfer_params as JSON (`encode_offer`, `decode_offer`);
- the prefix of DuplexConnector's Prometheus metrics, which the demo and benchmarks read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# Version of kvduplex's kv_transfer_params extensions and notification payloads. Both sides of
# a transfer must speak the same version; the transfer core's handshake checks its own.
PROTOCOL_VERSION = 5

# --- kv_transfer_params: vLLM's keys (what existing P/D proxies forward) ---
DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
REMOTE_ENGINE_ID = "remote_engine_id"
REMOTE_BLOCK_IDS = "remote_block_ids"
REMOTE_HOST = "remote_host"
REMOTE_PORT = "remote_port"
REMOTE_REQUEST_ID = "remote_request_id"
TP_SIZE = "tp_size"
REMOTE_NUM_TOKENS = "remote_num_tokens"

# --- kv_transfer_params: kvduplex's own keys ---
PROTOCOL_KEY = "kvduplex_protocol"
REMOTE_PORTS = "remote_ports"
REMOTE_BLOCK_SIZE = "remote_block_size"
REMOTE_BLOCK_FINGERPRINTS = "remote_block_fingerprints"
REMOTE_LEASE_EXPIRY = "remote_lease_expiry"

# --- DuplexConnector's Prometheus metrics: `vllm:kvduplex_<name>_total` counters, the
# `vllm:kvduplex_{transfer,lookup,lookup_wait}_seconds` histograms and the `held_blocks` and
# `claims` gauges (`kvduplex.connector.stats`) ---
METRIC_PREFIX = "vllm:kvduplex_"


def prefill_request_params() -> dict[str, object]:
    """The params a router puts on the prefill node's request (vLLM's standard P/D shape)."""
    return {
        DO_REMOTE_DECODE: True,
        DO_REMOTE_PREFILL: False,
        REMOTE_ENGINE_ID: None,
        REMOTE_BLOCK_IDS: None,
        REMOTE_HOST: None,
        REMOTE_PORT: None,
    }


# --- side-channel notifications, reader -> owner ---


def encode_release(owner_request_id: str, claim_id: int) -> bytes:
    """'I have read the blocks you granted me for `owner_request_id`, or will not': the claim
    ends. Only the claim's own reader can end it, and it never ends the hold itself (see
    `rust/src/holds.rs`)."""
    return json.dumps({"v": PROTOCOL_VERSION, "release": owner_request_id, "claim": claim_id}).encode()


def encode_renewal(owner_request_id: str, first_fingerprint: str) -> bytes:
    """'I have the request whose params name your hold `owner_request_id` queued and will ask
    for its grant': the owner renews the lease of a prompt it holds for a decode node that no
    reader has claimed yet, if `first_fingerprint` (of the reader's own first block) is its
    first block's, up to a cap (see `rust/src/holds/renew.rs`)."""
    return json.dumps(
        {"v": PROTOCOL_VERSION, "renew": owner_request_id, "first": first_fingerprint}
    ).encode()


@dataclass(frozen=True)
class Release:
    owner_request_id: str
    claim_id: int


@dataclass(frozen=True)
class Renewal:
    owner_request_id: str
    first_fingerprint: str


def decode_notification(payload: bytes) -> Release | Renewal | None:
    """The release or renewal a notification carries, or None if it is neither."""
    try:
        message = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(message, dict) or message.get("v") != PROTOCOL_VERSION:
        return None
    if isinstance(renewed := message.get("renew"), str):
        first = message.get("first")
        return Renewal(renewed, first) if isinstance(first, str) else None
    request_id = message.get("release")
    claim = message.get("claim")
    if not isinstance(request_id, str):
        return None
    if isinstance(claim, bool) or not isinstance(claim, int) or not 0 <= claim < 2**64:
        return None
    return Release(request_id, claim)


# --- grants and lookups: the offer an owner hands a reader with a claim ---


def encode_offer(params: dict[str, object]) -> bytes:
    """A hold's kv_transfer_params as the offer the owner's transfer core hands out with each
    claim on it (the transfer core stores it opaquely, up to 512 KiB)."""
    return json.dumps(params).encode()


def decode_offer(offer: bytes) -> dict[str, object] | None:
    """The kv_transfer_params an owner's offer carries, or None when it is not a JSON object
    (the reader then checks them exactly like params from a router)."""
    try:
        params = json.loads(offer)
    except (ValueError, UnicodeDecodeError):
        return None
    return params if isinstance(params, dict) else None
