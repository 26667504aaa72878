"""The fleet a prefill node looks prompts up in: the one place that says which engines a lookup
asks (`Fleet.members`), whatever routed the traffic so far.

Three sources, all read here:
- **This host's fleet directory**, with no configuration: every engine's TP rank 0 writes its
  side channel (`host:port`, engine id, pid) into `fleet-<key>/` beside the per-user
  side-channel secret (`$XDG_RUNTIME_DIR/kvduplex`, else `~/.cache/kvduplex`, mode 0700), and
  removes it at shutdown. `<key>` is a keyed hash of the secret and the model, so only engines
  that could pair (one user or one `$KVDUPLEX_SECRET`, one model) share a directory. Entries
  of processes gone (pid no longer alive) are dropped, and their files removed.
- **`decode_peers`**: `"host:port"` entries; a name resolves to every address it has (a
  Kubernetes headless service of the decode pods, with one fixed `side_channel_port`, names
  them all), again every `RESOLVE_INTERVAL_S`. This is how engines on other hosts are found.
- **Readers that connected to us**: a D that pulled from this P announced its side channel in
  the handshake (the transfer core's `known_peers`, TP rank 0's only).

Before this module, a P knew only the last and `decode_peers` as literal addresses, so behind a
router that pairs P's and D's in fixed pairs (vllm-router's round_robin at 2 x 2) a P never met
the D that held a conversation's turn. The directory and resolution run on a thread of their own
(file and DNS I/O never in an engine step); the step reads the last result.

The directory is written by this user's processes only (mode 0700, each entry checked to be a
regular file of this user): still, each entry is bounded by size (`MAX_ENTRY_BYTES`) and the
directory by count (`MAX_ENTRIES`), and an address in it is only dialed: the handshake
authenticates the engine there and refuses an incompatible one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

# Imported by `config.py`, which must import without vLLM (the proxy's and the demo's settings):
# a plain logger, under vLLM's tree when vLLM configured it.
logger = logging.getLogger(f"vllm.{__name__}")

# How often the directory is read, and names in `decode_peers` resolved again.
SCAN_INTERVAL_S = 1.0
RESOLVE_INTERVAL_S = 30.0
# Bounds on what is read from the directory (by size, whatever the entries say).
MAX_ENTRIES = 4096
MAX_ENTRY_BYTES = 1024
# The most addresses one name in `decode_peers` gives.
_MAX_ADDRESSES_PER_NAME = 1024
_WILDCARDS = frozenset({"0.0.0.0", "::", "[::]", ""})


def fleet_key(secret: bytes | None, fingerprint: dict[str, str]) -> str:
    """The directory's name part: engines that authenticate each other (one secret) and serve
    one model (the fingerprint's model and protocol entries) share it, others never do."""
    key = hashlib.sha256(secret).digest() if secret else b""
    digest = hashlib.blake2b(key=key, digest_size=8)
    for field in ("kvduplex_protocol", "model", "revision", "block_size"):
        digest.update(f"{field}={fingerprint.get(field, '')}\n".encode())
    return digest.hexdigest()


def parse_address(address: str) -> tuple[str, int] | None:
    """`host:port` (an IPv6 host in brackets) as (host, port); None if it is not one."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


class FleetDirectory:
    """This host's fleet directory: one file per engine (TP rank 0), `<hash of id>.json`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._own: Path | None = None

    def publish(self, engine_id: str, address: str) -> None:
        """Write this engine's entry (a temporary file renamed into place: readers never see
        half of it)."""
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        name = hashlib.blake2b(engine_id.encode(), digest_size=8).hexdigest()
        entry = self.path / f"{name}.json"
        temporary = self.path / f".{name}.{os.getpid()}.tmp"
        body = json.dumps({"engine_id": engine_id, "address": address, "pid": os.getpid()})
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(descriptor, body.encode())
        finally:
            os.close(descriptor)
        os.replace(temporary, entry)
        self._own = entry

    def withdraw(self) -> None:
        if self._own is not None:
            self._own.unlink(missing_ok=True)
            self._own = None

    def read(self) -> list[tuple[str, str]]:
        """(engine id, address) of every live engine listed, this one's included; entries of
        dead processes are removed. At most `MAX_ENTRIES` files are looked at."""
        members: list[tuple[str, str]] = []
        try:
            scan = os.scandir(self.path)
        except FileNotFoundError:
            return members
        uid = os.getuid()
        with scan:
            for count, item in enumerate(scan):
                if count >= MAX_ENTRIES:
                    logger.warning("Fleet directory %s: more than %d entries; the rest ignored",
                                   self.path, MAX_ENTRIES)
                    break
                if not item.name.endswith(".json") or item.name.startswith("."):
                    continue
                member = _read_entry(Path(item.path), uid)
                if member is not None:
                    members.append(member)
        return members


def _read_entry(path: Path, uid: int) -> tuple[str, str] | None:
    try:
        status = path.lstat()
        if not path.is_file() or path.is_symlink() or status.st_uid != uid:
            return None
        with path.open("rb") as handle:
            raw = handle.read(MAX_ENTRY_BYTES + 1)
        if len(raw) > MAX_ENTRY_BYTES:
            return None
        entry = json.loads(raw)
        engine_id, address, pid = entry["engine_id"], entry["address"], entry["pid"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (isinstance(engine_id, str) and isinstance(address, str) and isinstance(pid, int)):
        return None
    if parse_address(address) is None or pid <= 0:
        return None
    if not _alive(pid):
        path.unlink(missing_ok=True)
        return None
    return engine_id, address


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid > 0
    return True


def advertised_address(host: str, port: int) -> str:
    """The address other engines on this host dial: a wildcard listen address is reached on
    loopback."""
    if host in _WILDCARDS:
        host = "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Fleet:
    """TP rank 0's view of the fleet: `members()` is what lookups ask (besides the readers the
    transfer core knows). `start` publishes this engine and starts the thread that reads the
    directory and resolves `decode_peers`; `close` withdraws and stops it."""

    def __init__(self, decode_peers: tuple[str, ...], directory: FleetDirectory | None) -> None:
        self._configured = [a for a in (parse_address(p) for p in decode_peers) if a is not None]
        self._directory = directory
        self._own_id: str | None = None
        self._members: tuple[tuple[str, int], ...] = tuple(self._configured)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._resolved: dict[tuple[str, int], list[tuple[str, int]]] = {}

    def start(self, engine_id: str, address: str) -> None:
        self._own_id = engine_id
        if self._directory is not None:
            try:
                self._directory.publish(engine_id, address)
                logger.info("Fleet: %s at %s listed in %s", engine_id, address,
                            self._directory.path)
            except OSError as error:
                logger.warning("Fleet directory %s not written (%s): engines on this host "
                               "find this one only by its traffic", self._directory.path, error)
                self._directory = None
        if self._directory is None and not self._configured:
            return
        self.refresh(resolve=True)
        self._thread = threading.Thread(target=self._run, name="kvduplex-fleet", daemon=True)
        self._thread.start()

    def members(self) -> tuple[tuple[str, int], ...]:
        """Side channels of the other engines found (in order, each once)."""
        return self._members

    def refresh(self, resolve: bool) -> None:
        """Read the directory and (with `resolve`) resolve `decode_peers` again; the thread
        calls it, as does `start` (so the first step already knows this host's engines)."""
        addresses: list[tuple[str, int]] = []
        if resolve:
            self._resolved = {entry: _resolve(*entry) for entry in self._configured}
        for entry in self._configured:
            addresses.extend(self._resolved.get(entry) or [entry])
        if self._directory is not None:
            for engine_id, address in self._directory.read():
                parsed = parse_address(address)
                if engine_id != self._own_id and parsed is not None:
                    addresses.append(parsed)
        self._members = tuple(dict.fromkeys(addresses))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        if self._directory is not None:
            self._directory.withdraw()

    def _run(self) -> None:
        next_resolve = time.monotonic() + RESOLVE_INTERVAL_S
        while not self._stop.wait(SCAN_INTERVAL_S):
            now = time.monotonic()
            resolve = now >= next_resolve
            if resolve:
                next_resolve = now + RESOLVE_INTERVAL_S
            try:
                self.refresh(resolve)
            except Exception:  # noqa: BLE001 - the thread must outlive any one bad read
                logger.exception("Fleet: reading the directory or resolving decode_peers failed")


def _resolve(host: str, port: int) -> list[tuple[str, int]]:
    """Every address `host` has (a literal address is itself); on a failure, none (logged),
    so the configured entry is dialed as written."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as error:
        logger.warning("Fleet: decode_peers entry %s:%d does not resolve (%s)", host, port, error)
        return []
    return list(dict.fromkeys((info[4][0], port) for info in infos))[:_MAX_ADDRESSES_PER_NAME]
