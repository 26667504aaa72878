"""The one place where `kv_transfer_params` from clients and proxies are checked.

Params come from outside the engine (any HTTP client can send them), so nothing in them is
trusted: wrong types, negative or out-of-range ids, huge lists, unknown engines and missing keys
are rejected with a reason, and the request then runs without a transfer. Params that pass are
still only a hint of where to ask: the reader asks the owner they name for a grant of the hold
they name, against the fingerprints of its own prompt, and reads only what the owner's grant
describes (parsed here too). Block ids are bounds-checked by the transfer core against the
owner's registered layout before anything is read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvduplex import protocol
from kvduplex.connector import metadata as md
from kvduplex.connector import tp, validate
from kvduplex.connector.groups import NULL_BLOCK_ID, SLIDING_WINDOW, STATE_SPACE, TransferGroups
from kvduplex.connector.token_fingerprint import FINGERPRINT_HEX_CHARS

if TYPE_CHECKING:
    from vllm.v1.request import Request

_MAX_ID_CHARS = 512
_MAX_HOST_CHARS = 253
_MAX_BLOCK_ID = 2**31 - 1
_MAX_TP_SIZE = 1024
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class ParamsContext:
    """What params are checked against: this engine's own shape."""

    engine_id: str
    tp_size: int
    total_kv_heads: int
    """The model's KV heads, over all TP ranks (to pair engines at other TP sizes)."""
    block_size: int
    max_model_len: int
    bidirectional: bool
    read_deadline_margin_s: float
    groups: TransferGroups


@dataclass(frozen=True)
class RemoteBlocks:
    """Validated description of KV blocks a peer holds for this request."""

    peer: md.PeerAddress
    remote_request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    """The owner's block table per transfer group (`NULL_BLOCK_ID` where a sliding-window
    group freed the block), each one entry per block of `num_tokens`."""
    num_tokens: int
    fingerprints: tuple[str, ...]
    lease_expiry: float
    claim_id: int | None = None
    """The owner's claim for this reader, once granted (None: params, a hint)."""
    from_decode_node: bool = False
    """A decode node's finished turn (bidirectional), not a prefill node's prompt."""

    def release(self) -> md.ReleaseSpec | None:
        """How to end our claim on the blocks; None when nothing was granted."""
        if self.claim_id is None:
            return None
        return md.ReleaseSpec(
            peer=self.peer, remote_request_id=self.remote_request_id, claim_id=self.claim_id
        )


@dataclass(frozen=True)
class Rejected:
    """Params asked for a transfer that will not happen, and why."""

    reason: str
    release: md.ReleaseSpec | None = None
    """The claim to hand back, when the owner had granted one."""


def claim_release(remote: RemoteBlocks | Rejected) -> md.ReleaseSpec | None:
    """How to hand back the claim an owner granted for these blocks; None when it granted none."""
    return remote.release() if isinstance(remote, RemoteBlocks) else remote.release


def unsupported_reason(request: Request) -> str | None:
    """Why no KV moves for this vLLM request in either direction; None when it may."""
    if request.prompt_token_ids is None or request.prompt_embeds is not None:
        return "requests with prompt embeddings are not supported"
    if request.mm_features:
        return "multimodal requests are not supported"
    return None


def hands_off(params: Any) -> bool:
    """Whether a request's params make it a prefill for another engine (`do_remote_decode`
    alone), whose prompt this engine holds for its decode node."""
    return (
        isinstance(params, dict)
        and params.get(protocol.DO_REMOTE_DECODE) is True
        and params.get(protocol.DO_REMOTE_PREFILL) is not True
    )


def takes_over(params: Any) -> bool:
    """Whether a request's params make it a decode request (`do_remote_prefill` without
    `do_remote_decode`), whose finished turn a bidirectional decode node holds."""
    return (
        isinstance(params, dict)
        and params.get(protocol.DO_REMOTE_PREFILL) is True
        and params.get(protocol.DO_REMOTE_DECODE) is not True
    )


def parse_remote_blocks(params: Any, ctx: ParamsContext) -> RemoteBlocks | Rejected | None:
    """Validate the pull a request's params ask for; None when they ask for none."""
    if params is None:
        return None
    if not isinstance(params, dict):
        return Rejected(f"kv_transfer_params must be an object, got {type(params).__name__}")
    try:
        prefill = _optional_bool(params, protocol.DO_REMOTE_PREFILL)
        decode = _optional_bool(params, protocol.DO_REMOTE_DECODE)
    except validate.Invalid as exc:
        return Rejected(str(exc))
    if prefill and decode:
        return Rejected(f"{protocol.DO_REMOTE_PREFILL} and {protocol.DO_REMOTE_DECODE} are both true")
    if prefill:
        from_decode_node = False
    elif decode and params.get(protocol.REMOTE_BLOCK_IDS) not in (None, []):
        from_decode_node = True
    else:
        return None

    try:
        peer, remote_request_id = _parse_address(params, ctx)
        if from_decode_node and not ctx.bidirectional:
            raise validate.Invalid("bidirectional_kv_xfer is off on this engine")
        blocks = _parse_blocks(params, ctx, time.time())
    except validate.Invalid as exc:
        return Rejected(str(exc))
    block_ids, num_tokens, fingerprints, lease_expiry = blocks
    return RemoteBlocks(
        peer=peer,
        remote_request_id=remote_request_id,
        block_ids=block_ids,
        num_tokens=num_tokens,
        fingerprints=fingerprints,
        lease_expiry=lease_expiry,
        from_decode_node=from_decode_node,
    )


def _parse_address(params: dict[str, Any], ctx: ParamsContext) -> tuple[md.PeerAddress, str]:
    version = _required(params, protocol.PROTOCOL_KEY)
    if isinstance(version, bool) or version != protocol.PROTOCOL_VERSION:
        raise validate.Invalid(
            f"{protocol.PROTOCOL_KEY}={version!r} is not this kvduplex's protocol "
            f"{protocol.PROTOCOL_VERSION}"
        )
    engine_id = _text(params, protocol.REMOTE_ENGINE_ID, _MAX_ID_CHARS)
    if engine_id == ctx.engine_id:
        raise validate.Invalid(f"{protocol.REMOTE_ENGINE_ID} names this engine itself")
    remote_request_id = _text(params, protocol.REMOTE_REQUEST_ID, _MAX_ID_CHARS)
    host = _text(params, protocol.REMOTE_HOST, _MAX_HOST_CHARS)
    port = validate.port(_required(params, protocol.REMOTE_PORT), protocol.REMOTE_PORT)
    tp_size = _int(params, protocol.TP_SIZE, 1, _MAX_TP_SIZE)
    if tp_size != ctx.tp_size:
        reason = tp.mappable(ctx.total_kv_heads, tp_size, ctx.tp_size)
        if reason is None and (ctx.groups.hybrid or ctx.groups.has_state):
            reason = "heterogeneous TP is supported for one full-attention KV-cache group only"
        if reason is not None:
            raise validate.Invalid(
                f"remote tensor-parallel size {tp_size} differs from this engine's "
                f"{ctx.tp_size} and cannot be mapped: {reason}"
            )
    ports_raw = _required(params, protocol.REMOTE_PORTS)
    if not isinstance(ports_raw, list) or len(ports_raw) != tp_size:
        raise validate.Invalid(f"{protocol.REMOTE_PORTS} must be a list of {tp_size} port(s)")
    ports = tuple(validate.port(p, protocol.REMOTE_PORTS) for p in ports_raw)
    if ports[0] != port:
        raise validate.Invalid(f"{protocol.REMOTE_PORT} differs from {protocol.REMOTE_PORTS}[0]")
    return md.PeerAddress(engine_id=engine_id, host=host, ports=ports), remote_request_id


def _parse_blocks(
    params: dict[str, Any], ctx: ParamsContext, now: float
) -> tuple[tuple[tuple[int, ...], ...], int, tuple[str, ...], float]:
    block_size = _int(params, protocol.REMOTE_BLOCK_SIZE)
    if block_size != ctx.block_size:
        raise validate.Invalid(
            f"remote block size {block_size} differs from this engine's {ctx.block_size}"
        )
    num_tokens = _int(params, protocol.REMOTE_NUM_TOKENS, 1, ctx.max_model_len)
    expected_blocks = -(-num_tokens // block_size)
    block_ids = _block_tables(params, ctx.groups, expected_blocks)
    fingerprints = _fingerprints(params, expected_blocks)
    lease_expiry = validate.number(
        _required(params, protocol.REMOTE_LEASE_EXPIRY), protocol.REMOTE_LEASE_EXPIRY
    )
    if lease_expiry - ctx.read_deadline_margin_s <= now:
        raise validate.Invalid(
            f"the owner's lease ends in {lease_expiry - now:.1f} s, within the "
            f"{ctx.read_deadline_margin_s} s read margin"
        )
    return block_ids, num_tokens, fingerprints, float(lease_expiry)


def _required(params: dict[str, Any], key: str) -> Any:
    if key not in params or params[key] is None:
        raise validate.Invalid(f"missing {key}")
    return params[key]


def _optional_bool(params: dict[str, Any], key: str) -> bool:
    value = params.get(key)
    return False if value is None else validate.boolean(value, key)


def _text(params: dict[str, Any], key: str, max_chars: int) -> str:
    return validate.text(_required(params, key), key, max_chars=max_chars)


def _int(
    params: dict[str, Any], key: str, minimum: int | None = None, maximum: int | None = None
) -> int:
    return validate.integer(_required(params, key), key, minimum=minimum, maximum=maximum)


def _block_tables(
    params: dict[str, Any], groups: TransferGroups, expected: int
) -> tuple[tuple[int, ...], ...]:
    """`remote_block_ids`: a flat list for an engine with one KV-cache group (vLLM's shape),
    one list per transfer group for a hybrid model. Full-attention tables hold real blocks
    only; a sliding-window table may start with null blocks (freed outside the window); a
    state-space table is null but for its last entry (the state), or all null when a lookup
    cut the turn short of it."""
    key = protocol.REMOTE_BLOCK_IDS
    raw = _required(params, key)
    if not isinstance(raw, list):
        raise validate.Invalid(f"{key} must be a list of integers")
    if groups.hybrid:
        if len(raw) != len(groups) or not all(isinstance(table, list) for table in raw):
            raise validate.Invalid(f"{key} must hold one list per KV-cache group ({len(groups)})")
        tables = raw
    else:
        tables = [raw]
    seen: set[int] = set()
    out: list[tuple[int, ...]] = []
    for index, (group, table) in enumerate(zip(groups.groups, tables)):
        where = f"{key}[{index}]" if groups.hybrid else key
        if len(table) != expected:
            raise validate.Invalid(
                f"{where} has {len(table)} ids but {params[protocol.REMOTE_NUM_TOKENS]} tokens "
                f"need {expected} block(s)"
            )
        for value in table:
            if isinstance(value, bool) or not isinstance(value, int):
                raise validate.Invalid(f"{where} must hold integers only")
            if not 0 <= value <= _MAX_BLOCK_ID:
                raise validate.Invalid(f"{where} holds out-of-range id {value}")
        real = [value for value in table if value != NULL_BLOCK_ID]
        nulls = len(table) - len(real)
        if group.kind == STATE_SPACE:
            if len(real) > 1 or (real and table[-1] == NULL_BLOCK_ID):
                raise validate.Invalid(f"{where} must hold one state, in its last block, or none")
        elif nulls and (group.kind != SLIDING_WINDOW or any(table[:nulls])):
            raise validate.Invalid(
                f"{where} holds out-of-range id {NULL_BLOCK_ID}"
                if group.kind != SLIDING_WINDOW
                else f"{where} may hold null blocks only before its window"
            )
        if seen.intersection(real) or len(set(real)) != len(real):
            raise validate.Invalid(f"{key} holds duplicate ids")
        seen.update(real)
        out.append(tuple(table))
    return tuple(out)


def _fingerprints(params: dict[str, Any], expected: int) -> tuple[str, ...]:
    raw = _required(params, protocol.REMOTE_BLOCK_FINGERPRINTS)
    if not isinstance(raw, list) or len(raw) != expected:
        raise validate.Invalid(f"{protocol.REMOTE_BLOCK_FINGERPRINTS} must be a list of {expected} strings")
    for value in raw:
        if (
            not isinstance(value, str)
            or len(value) != FINGERPRINT_HEX_CHARS
            or not _HEX.issuperset(value)
        ):
            raise validate.Invalid(
                f"{protocol.REMOTE_BLOCK_FINGERPRINTS} must hold {FINGERPRINT_HEX_CHARS}-character "
                "lowercase hex strings"
            )
    return tuple(raw)
