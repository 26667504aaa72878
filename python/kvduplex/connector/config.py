"""`kv_connector_extra_config` of DuplexConnector, parsed and validated once.

Besides these options, DuplexConnector needs `"kv_load_failure_policy": "recompute"` in
`--kv-transfer-config` and refuses to start without it: every fallback of the connector (a peer
gone, a lease expired, a handshake refused, a read that fails) reaches vLLM as a failed load,
which vLLM's default policy, "fail", turns into an error for the client instead of a
recomputation.

Every option, its default and why:

| key | default | meaning |
|---|---|---|
| `bidirectional_kv_xfer` | `false` | A decode node keeps a finished turn's KV blocks under a lease and returns them in `kv_transfer_params`, so the prefill node can pull them on the next turn. |
| `kv_recompute_threshold` | `64` | Pull only when at least this many tokens are gained beyond the local prefix-cache hit (both directions). `0` pulls any gain. `"auto"` derives it from measured transfer and prefill speed (see `threshold.py`), starting at 64 until enough is measured. |
| `kv_lease_ttl_s` | `30` | How long a prefill node holds a request's blocks for its decode node's read (the hold ends sooner, once the decode node it granted them to is done; renewed by that length while the decode node has the request queued, up to 10 times this from the hold's start), and how long a claim that an owner grants a reader lasts at most. |
| `decode_kv_hold_ttl_s` | `120` | How long a decode node holds a finished turn's blocks for the next turn (bidirectional only). |
| `decode_kv_hold_max_fraction` | `0.5` | Largest fraction of the KV cache that held finished turns may occupy on a decode node; a new turn past it evicts the least recently used unclaimed held turns (a turn larger than the whole fraction is freed at once). Besides this cap, any unclaimed hold (either side) is given up when the engine runs short of free blocks (`retention.py`). |
| `read_deadline_margin_s` | `1.0` | A reader gives up a read this long before the owner's lease expires (covers clock skew between hosts), and declines to start one with less time left. |
| `side_channel_host` | `$VLLM_HOST_IP`, else `127.0.0.1` | Address each worker's transfer engine listens on and announces to peers. |
| `side_channel_port` | `0` | Port of the transfer engine's side channel; `0` picks a free port for each worker. Otherwise each worker of an engine on this host listens on its own port: port + data-parallel rank on this host × TP size + TP rank (so TP rank r of a single engine listens on port+r, and data-parallel ranks on one host never collide). The real port is always announced. |
| `handshake_timeout_s` | `10` | How long a worker retries connecting to a peer engine before the transfer falls back to recomputation. |
| `peer_heartbeat_s` | `1` | How often a worker's transfer core pings each connected peer engine; a peer that sends nothing for 3 of its heartbeats is taken for dead (its in-flight reads fail and recompute, its grants and lookups end). Raise it on oversubscribed hosts, where a live engine can be starved of CPU for seconds (seen with 8 vLLM processes on 2 cores). |
| `auth_secret_env` | `"KVDUPLEX_SECRET"` | Name of the environment variable holding a shared secret for the side-channel handshake. Unset, engines on a loopback `side_channel_host` authenticate with a per-user secret, created once (mode 0600) at `$XDG_RUNTIME_DIR/kvduplex/side-channel-secret` or else `~/.cache/kvduplex/side-channel-secret`: every engine a user starts on one host shares it, and other users' processes cannot connect (engines of other users or other filesystems, such as containers, need the variable). Where that file cannot be created, loopback peers do not authenticate (logged). On any other address the variable is required, unless `allow_unauthenticated_peers`. What a peer can do: the transfer core's "Who may be a peer". |
| `allow_unauthenticated_peers` | `false` | Serve the side channel without a shared secret on a non-loopback address. Any host that reaches it can then read the registered KV cache: only for trusted networks; logged as a warning at start. |
| `lookup_timeout_ms` | `250` | Bidirectional only: how long a prefill node waits for its decode peers to say whether they hold a prompt's history. A live, connected peer answers in one side-channel round trip (measured here: ~1 ms on loopback, tens of ms when 4 vLLM servers share 2 cores); prefill nodes connect to announced decode nodes ahead of time, so no lookup pays for a handshake. The wait only matters when a peer is hung (a dead one is dropped by its heartbeats within 3 s), and 250 ms stays below the prefill time of a history long enough to be worth pulling. Past it, or when no peer answers, the request prefills normally. The request waits in vLLM's queue meanwhile, never blocking the scheduler. `0` turns lookups off (a grant of the blocks that params name is not a lookup: it always runs, within `handshake_timeout_s`). |
| `decode_peers` | `[]` | Bidirectional only: side channels (`"host:port"` of TP rank 0) of decode engines on other hosts to look up held turns on; a name is dialed at every address it resolves to, resolved again every 30 s (a headless service of the decode pods names them all). Engines on this host are found without it (the fleet directory), as is every decode engine that pulls from the prefill node. |
| `layerwise_load` | `false` | Bidirectional only, prefill side: pull a decode node's held turn layer by layer *inside* the forward pass that computes the new tokens: one read per layer posted before the pass, each layer waiting for its own blocks before it starts (vLLM's `save_kv_layer` of the layer before; a layer writes its new tokens' KV into the turn's last block), instead of the request waiting for the whole pull and one more engine step. A failed read is reported as vLLM's load error and those tokens are recomputed. Pulls of a prefill node's blocks, hybrid models and models with a state-space (Mamba) group keep the asynchronous path. Caveat: the pass waits for the reads, so an owner that freezes (without `ucx_peer_error_handling`) stalls the prefill node until the read completes or fails. A full CUDA graph's replay skips those layer hooks: with it on, vLLM captures piecewise graphs (`requires_piecewise_for_cudagraph`). Measured no faster on a CPU-only machine (`benches/RESULTS.md`, History sweep). |
| `same_host_reads` | `true` | Read a peer that runs on the same host with `process_vm_readv`, up to 1,024 block runs per system call, instead of through UCX (which makes one call per run). Host memory only, and a read is reported good only if that process was still alive after it. Turned off by itself when `UCX_TLS` rules out UCX's own cma transport (for example `tcp`). Needs the kernel to let one process read a sibling's memory (same user; Yama `ptrace_scope` 0 or no Yama): otherwise the peer is read through UCX, and the log says why. Measured 1.87× raw UCX on 16 scattered 4 KiB blocks (`benches/RESULTS.md`, Raw transfers). Only regions the peer's process vouches for on that connection (see the transfer core's same-host reads); a peer naming the reader's own process is refused. Each peer's batches are copied by a thread of its own, so a peer whose reads never return (memory backed by userfaultfd or FUSE) stalls only its own batches. |
| `ucx_peer_error_handling` | `true` | UCX peer error handling on transfer endpoints. Either way a failed read is reported only when none of its bytes can still land. On, a read to a frozen or vanished peer is cancelled at its deadline (a force close, which needs no reply from the peer), and a remote failure is an error of the endpoint, not of the process. Off, such a read keeps its request waiting until the peer serves it or dies (a dead peer is detected through the side channel's heartbeats), and the connector's `close` waits for it. Peers on the same host are read without UCX (`same_host_reads`), so it does not slow them; with `same_host_reads` off, UCX 1.22 reads host memory on one host over tcp with it instead of cma (several times slower). Set it the same on every engine: UCX refuses a pair of endpoints whose error handling differs. |
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvduplex.connector import validate
from kvduplex.connector.fleet import parse_address

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig

DEFAULT_RECOMPUTE_THRESHOLD = 64
# vLLM's `kv_load_failure_policy` under which a failed pull is recomputed, not an error.
REQUIRED_LOAD_FAILURE_POLICY = "recompute"
DEFAULT_LOOKUP_TIMEOUT_MS = 250
# The per-user secret's file name, under $XDG_RUNTIME_DIR/kvduplex or ~/.cache/kvduplex.
SECRET_FILE_NAME = "side-channel-secret"
_SECRET_BYTES = 32

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DuplexConfig:
    bidirectional_kv_xfer: bool = False
    recompute_threshold: int = DEFAULT_RECOMPUTE_THRESHOLD
    auto_recompute_threshold: bool = False
    kv_lease_ttl_s: float = 30.0
    decode_kv_hold_ttl_s: float = 120.0
    decode_kv_hold_max_fraction: float = 0.5
    read_deadline_margin_s: float = 1.0
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    handshake_timeout_s: float = 10.0
    peer_heartbeat_s: float = 1.0
    auth_secret_env: str = "KVDUPLEX_SECRET"
    ucx_peer_error_handling: bool = True
    allow_unauthenticated_peers: bool = False
    lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_MS / 1000
    decode_peers: tuple[str, ...] = ()
    layerwise_load: bool = False
    same_host_reads: bool = True

    @classmethod
    def from_transfer_config(cls, transfer_config: KVTransferConfig) -> DuplexConfig:
        """The configuration of a DuplexConnector (either role) from vLLM's
        `--kv-transfer-config`; raises ValueError naming the bad setting."""
        policy = transfer_config.kv_load_failure_policy
        if policy != REQUIRED_LOAD_FAILURE_POLICY:
            raise ValueError(
                f"DuplexConnector: kv_load_failure_policy is {policy!r}, under which vLLM fails "
                "a request whose KV pull fails instead of recomputing it; every fallback of the "
                "connector (peer gone, lease expired, handshake refused, read failed) would "
                "reach the client as an error. Add "
                f'"kv_load_failure_policy": "{REQUIRED_LOAD_FAILURE_POLICY}" to '
                "--kv-transfer-config (vLLM's default is \"fail\"). Inside MultiConnector, "
                "set it on both the MultiConnector config (the policy vLLM applies) and the "
                "DuplexConnector entry of its \"connectors\" (the config this connector sees)."
            )
        return cls.from_extra_config(transfer_config.kv_connector_extra_config)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> DuplexConfig:
        """Parse `kv_connector_extra_config`; raises ValueError naming the bad key."""
        extra = _from_nixl_names(dict(extra or {}))
        unknown = sorted(set(extra) - _KNOWN_KEYS)
        if unknown:
            raise ValueError(
                f"DuplexConnector: unknown kv_connector_extra_config key(s) {unknown}; "
                f"known keys: {sorted(_KNOWN_KEYS)}"
            )
        threshold_raw = extra.get("kv_recompute_threshold", DEFAULT_RECOMPUTE_THRESHOLD)
        auto = threshold_raw == "auto"
        threshold = (
            DEFAULT_RECOMPUTE_THRESHOLD
            if auto
            else _int(threshold_raw, "kv_recompute_threshold", minimum=0)
        )
        margin = _seconds(
            extra, "read_deadline_margin_s", cls.read_deadline_margin_s, allow_zero=True
        )
        lease = _seconds(extra, "kv_lease_ttl_s", cls.kv_lease_ttl_s)
        hold = _seconds(extra, "decode_kv_hold_ttl_s", cls.decode_kv_hold_ttl_s)
        for key, ttl in (("kv_lease_ttl_s", lease), ("decode_kv_hold_ttl_s", hold)):
            if ttl <= margin:
                raise ValueError(
                    f"DuplexConnector: {key}={ttl} must exceed read_deadline_margin_s={margin}"
                )
        fraction = _number(extra, "decode_kv_hold_max_fraction", cls.decode_kv_hold_max_fraction)
        if not 0.0 < fraction <= 1.0:
            raise ValueError(
                f"DuplexConnector: decode_kv_hold_max_fraction must be in (0, 1], got {fraction}"
            )
        default_host = os.environ.get("VLLM_HOST_IP") or cls.side_channel_host
        host = _text(extra, "side_channel_host", default_host)
        secret_env = _text(extra, "auth_secret_env", cls.auth_secret_env)
        return cls(
            bidirectional_kv_xfer=_bool(extra, "bidirectional_kv_xfer", cls.bidirectional_kv_xfer),
            recompute_threshold=threshold,
            auto_recompute_threshold=auto,
            kv_lease_ttl_s=lease,
            decode_kv_hold_ttl_s=hold,
            decode_kv_hold_max_fraction=fraction,
            read_deadline_margin_s=margin,
            side_channel_host=host,
            side_channel_port=_int(
                extra.get("side_channel_port", cls.side_channel_port),
                "side_channel_port",
                minimum=0,
                maximum=65535,
            ),
            handshake_timeout_s=_seconds(extra, "handshake_timeout_s", cls.handshake_timeout_s),
            peer_heartbeat_s=_seconds(extra, "peer_heartbeat_s", cls.peer_heartbeat_s),
            auth_secret_env=secret_env,
            ucx_peer_error_handling=_bool(
                extra, "ucx_peer_error_handling", cls.ucx_peer_error_handling
            ),
            allow_unauthenticated_peers=_bool(
                extra, "allow_unauthenticated_peers", cls.allow_unauthenticated_peers
            ),
            lookup_timeout_s=_int(
                extra.get("lookup_timeout_ms", DEFAULT_LOOKUP_TIMEOUT_MS),
                "lookup_timeout_ms",
                minimum=0,
                maximum=60_000,
            )
            / 1000,
            decode_peers=_addresses(extra, "decode_peers"),
            layerwise_load=_bool(extra, "layerwise_load", cls.layerwise_load),
            same_host_reads=_bool(extra, "same_host_reads", cls.same_host_reads),
        )

    @property
    def looks_up(self) -> bool:
        """Whether this engine looks prompts up on the decode nodes (a bidirectional prefill
        node with lookups on)."""
        return self.bidirectional_kv_xfer and self.lookup_timeout_s > 0

    def auth_secret(self) -> bytes | None:
        """The environment variable's secret; unset, the per-user secret on a loopback side
        channel (None where that file cannot be made: loopback peers then do not
        authenticate), and None on any other address (the transfer core then refuses to
        serve unless `allow_unauthenticated_peers`)."""
        value = os.environ.get(self.auth_secret_env)
        if value:
            return value.encode("utf-8")
        if not _is_loopback(self.side_channel_host):
            return None
        path = per_user_secret_path()
        try:
            if path is None:
                raise OSError("no home directory and no $XDG_RUNTIME_DIR")
            secret = per_user_secret(path)
        except OSError as error:
            logger.warning(
                "No per-user side-channel secret at %s (%s) and $%s is unset: peers on this "
                "host connect without authenticating",
                path,
                error,
                self.auth_secret_env,
            )
            return None
        logger.info(
            "Side-channel peers authenticate with this user's secret in %s ($%s unset)",
            path,
            self.auth_secret_env,
        )
        return secret


def per_user_secret_path() -> Path | None:
    """Where this user's secret lives; None when the user has no home directory."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "kvduplex" / SECRET_FILE_NAME
    home = os.path.expanduser("~")
    return None if home == "~" else Path(home) / ".cache" / "kvduplex" / SECRET_FILE_NAME


def per_user_secret(path: Path) -> bytes:
    """The secret in `path`, created first if absent: random, written to a private temporary
    file and linked into place, so engines starting together all read the one that won. A
    file another user owns or others may read is refused (ValueError): it cannot be secret."""
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(descriptor, secrets.token_hex(_SECRET_BYTES).encode("ascii"))
        finally:
            os.close(descriptor)
        try:
            os.link(temporary, path)
        except FileExistsError:
            pass  # another engine's came first: use it
        finally:
            os.unlink(temporary)
    status = path.lstat()
    if not path.is_file() or path.is_symlink():
        raise ValueError(f"DuplexConnector: side-channel secret {path} is not a regular file")
    if status.st_uid != os.getuid() or status.st_mode & 0o077:
        raise ValueError(
            f"DuplexConnector: side-channel secret {path} must belong to this user and be "
            f"readable by it alone (mode 0600); it is uid {status.st_uid}, mode "
            f"{status.st_mode & 0o777:o}"
        )
    secret = path.read_bytes().strip()
    if len(secret) < _SECRET_BYTES:
        raise ValueError(f"DuplexConnector: side-channel secret {path} is too short")
    return secret


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


_KNOWN_KEYS = frozenset(
    {
        "bidirectional_kv_xfer",
        "kv_recompute_threshold",
        "kv_lease_ttl_s",
        "decode_kv_hold_ttl_s",
        "decode_kv_hold_max_fraction",
        "read_deadline_margin_s",
        "side_channel_host",
        "side_channel_port",
        "handshake_timeout_s",
        "peer_heartbeat_s",
        "auth_secret_env",
        "ucx_peer_error_handling",
        "lookup_timeout_ms",
        "decode_peers",
        "allow_unauthenticated_peers",
        "layerwise_load",
        "same_host_reads",
    }
)


# NixlConnector's options (vLLM 0.32/0.33) with a DuplexConnector equivalent: taken under its
# name, and logged with ours.
_NIXL_ALIASES = {
    "kv_lease_duration": "kv_lease_ttl_s",
    "decoder_kv_blocks_ttl": "decode_kv_hold_ttl_s",
}
# Those without one, refused with what DuplexConnector does instead.
_NIXL_ONLY = {
    "backends": "it always reads through UCX, or with process_vm_readv on the same host "
    "(same_host_reads)",
    "num_threads": "each peer's same-host reads run on a thread of their own; UCX reads are "
    "posted from the worker's own thread",
    "engine_ttl": "a peer is dropped when it misses 3 heartbeats (peer_heartbeat_s)",
    "enforce_handshake_compat": "it always refuses a peer whose KV cache or model differs",
}


def _from_nixl_names(extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` with NixlConnector's option names (a config carried over from it) renamed to
    ours, each logged; raises ValueError for a NixlConnector option with no equivalent, or one
    given under both names with different values."""
    for key, why in _NIXL_ONLY.items():
        if key in extra:
            raise ValueError(
                f"DuplexConnector: {key!r} is a NixlConnector option with no DuplexConnector "
                f"equivalent ({why}); remove it"
            )
    for nixl_key, ours in _NIXL_ALIASES.items():
        if nixl_key not in extra:
            continue
        value = extra.pop(nixl_key)
        if ours in extra and extra[ours] != value:
            raise ValueError(
                f"DuplexConnector: {nixl_key}={value!r} (NixlConnector's name) and "
                f"{ours}={extra[ours]!r} disagree; keep {ours}"
            )
        extra[ours] = value
        logger.warning(
            "DuplexConnector: kv_connector_extra_config key %r is NixlConnector's name; "
            "taken as %r=%r (rename it)",
            nixl_key,
            ours,
            value,
        )
    return extra


def _addresses(extra: dict[str, Any], key: str) -> tuple[str, ...]:
    value = extra.get(key, [])
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, list):
        raise ValueError(f"DuplexConnector: {key} must be a list of \"host:port\", got {value!r}")
    for address in value:
        if not isinstance(address, str) or parse_address(address) is None:
            raise ValueError(f"DuplexConnector: {key} holds {address!r}, not \"host:port\"")
    return tuple(value)


# The options' checks are `validate.py`'s (shared with params'), taking text as well as JSON
# values (a command line), each error named "DuplexConnector: <key> ...".


def _bool(extra: dict[str, Any], key: str, default: bool) -> bool:
    return _checked(validate.boolean, extra.get(key, default), key, from_text=True)


def _text(extra: dict[str, Any], key: str, default: str) -> str:
    return _checked(validate.text, extra.get(key, default), key)


def _int(value: Any, key: str, minimum: int, maximum: int | None = None) -> int:
    return _checked(
        validate.integer, value, key, minimum=minimum, maximum=maximum, from_text=True
    )


def _number(extra: dict[str, Any], key: str, default: float) -> float:
    return _checked(validate.number, extra.get(key, default), key, from_text=True)


def _seconds(extra: dict[str, Any], key: str, default: float, allow_zero: bool = False) -> float:
    value = _number(extra, key, default)
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"DuplexConnector: {key} must be {bound} seconds, got {value}")
    return value


def _checked(check: Any, value: Any, key: str, **bounds: Any) -> Any:
    try:
        return check(value, key, **bounds)
    except validate.Invalid as exc:
        raise ValueError(f"DuplexConnector: {exc}") from None
