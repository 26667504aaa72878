"""Conversation stores: per (caller, conversation), D's last `kv_transfer_params` and which D holds
the blocks they name. An entry is taken (read and deleted) by the next turn, so it is used at most
once; it expires after a TTL chosen below D's lease; the store is bounded and evicts least recently
written entries first (entries are never read without being deleted, so that is also LRU)."""

from __future__ import annotations

import abc
import collections
import dataclasses
import enum
import json
import logging
import math
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

Clock = Callable[[], float]


@dataclasses.dataclass(frozen=True)
class ConversationKey:
    """Hex digests of the caller and of the conversation id; never the raw values."""

    tenant: str
    conversation: str

    @property
    def storage_key(self) -> str:
        return f"{self.tenant}:{self.conversation}"


@dataclasses.dataclass(frozen=True)
class ConversationEntry:
    decode: str
    params: dict[str, Any]
    expires_at: float

    def encode(self) -> bytes:
        return json.dumps(
            {"decode": self.decode, "params": self.params, "expires_at": self.expires_at},
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode_bytes(cls, raw: bytes) -> ConversationEntry:
        data = json.loads(raw)
        return cls(
            decode=str(data["decode"]),
            params=dict(data["params"]),
            expires_at=float(data["expires_at"]),
        )


class Lookup(enum.Enum):
    HIT = "hit"
    MISS = "miss"
    EXPIRED = "expired"


@dataclasses.dataclass(frozen=True)
class PutResult:
    stored: bool
    evicted: int = 0


class ConversationStore(abc.ABC):
    """Async store shared by the request handlers of one proxy (or, for Redis, of replicas)."""

    def __init__(self, *, ttl_s: float, max_entries: int, max_entry_bytes: int, clock: Clock):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.max_entry_bytes = max_entry_bytes
        self.clock = clock

    def _new_entry(self, decode: str, params: dict[str, Any]) -> tuple[ConversationEntry, bytes]:
        entry = ConversationEntry(decode, params, self.clock() + self.ttl_s)
        return entry, entry.encode()

    async def put(self, key: ConversationKey, decode: str, params: dict[str, Any]) -> PutResult:
        """Remember D's params for the conversation's next turn, replacing an older entry."""
        entry, encoded = self._new_entry(decode, params)
        if len(encoded) > self.max_entry_bytes:
            logger.warning(
                "not remembering conversation params of %d bytes (limit %d); its next turn "
                "recomputes",
                len(encoded),
                self.max_entry_bytes,
            )
            return PutResult(stored=False)
        return await self._put(key, entry, encoded)

    @abc.abstractmethod
    async def _put(
        self, key: ConversationKey, entry: ConversationEntry, encoded: bytes
    ) -> PutResult: ...

    @abc.abstractmethod
    async def take(self, key: ConversationKey) -> tuple[Lookup, ConversationEntry | None]:
        """Remove the conversation's entry and return it unless it expired."""

    async def close(self) -> None:
        return None


class InMemoryConversationStore(ConversationStore):
    """One process's store, bounded by entry count and total encoded bytes."""

    def __init__(
        self,
        *,
        ttl_s: float,
        max_entries: int,
        max_entry_bytes: int,
        max_total_bytes: int,
        clock: Clock = time.time,
    ):
        super().__init__(
            ttl_s=ttl_s, max_entries=max_entries, max_entry_bytes=max_entry_bytes, clock=clock
        )
        self.max_total_bytes = max_total_bytes
        self._entries: collections.OrderedDict[str, tuple[ConversationEntry, int]] = (
            collections.OrderedDict()
        )
        self._total_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def total_bytes(self) -> int:
        return self._total_bytes

    def _pop_oldest(self) -> ConversationEntry:
        _, (entry, size) = self._entries.popitem(last=False)
        self._total_bytes -= size
        return entry

    async def _put(
        self, key: ConversationKey, entry: ConversationEntry, encoded: bytes
    ) -> PutResult:
        old = self._entries.pop(key.storage_key, None)
        if old is not None:
            self._total_bytes -= old[1]
        # Every entry lives ttl_s, so insertion order is expiry order: expired ones are in front.
        now = self.clock()
        while self._entries and next(iter(self._entries.values()))[0].expires_at <= now:
            self._pop_oldest()
        self._entries[key.storage_key] = (entry, len(encoded))
        self._total_bytes += len(encoded)
        evicted = 0
        while len(self._entries) > self.max_entries or self._total_bytes > self.max_total_bytes:
            self._pop_oldest()
            evicted += 1
        return PutResult(stored=True, evicted=evicted)

    async def take(self, key: ConversationKey) -> tuple[Lookup, ConversationEntry | None]:
        item = self._entries.pop(key.storage_key, None)
        if item is None:
            return Lookup.MISS, None
        entry, size = item
        self._total_bytes -= size
        if entry.expires_at <= self.clock():
            return Lookup.EXPIRED, None
        return Lookup.HIT, entry


# Entry keys share one hash tag with the index and the write counter, so a script touches a single
# cluster slot. The index is a sorted set of entry keys scored by write order: the lowest is the
# least recently written. Entries Redis expired leave their index member behind; being the oldest,
# such members are popped first, so the bound still counts live entries correctly.
_REDIS_PUT = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[3]), KEYS[1])
local excess = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[3])
if excess <= 0 then return 0 end
local evicted = 0
local victims = redis.call('ZPOPMIN', KEYS[2], excess)
for i = 1, #victims, 2 do evicted = evicted + redis.call('DEL', victims[i]) end
return evicted
"""

_REDIS_TAKE = """
local value = redis.call('GET', KEYS[1])
if value then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[2], KEYS[1])
end
return value
"""


class RedisConversationStore(ConversationStore):
    """Store in Redis (≥ 6.2) so that several proxy replicas share conversations. Take is one
    atomic script, so two replicas can never both use an entry. Expiry is checked against the
    proxy's clock (replicas need synchronised clocks) and also set as a Redis TTL so abandoned
    entries vanish without a reader."""

    def __init__(
        self,
        url: str,
        *,
        ttl_s: float,
        max_entries: int,
        max_entry_bytes: int,
        clock: Clock = time.time,
        namespace: str = "kvduplex",
        max_connections: int = 64,
    ):
        super().__init__(
            ttl_s=ttl_s, max_entries=max_entries, max_entry_bytes=max_entry_bytes, clock=clock
        )
        try:
            import redis.asyncio as redis_asyncio
        except ImportError as exc:
            raise RuntimeError(
                "--store redis://… needs the `redis` Python package: pip install redis"
            ) from exc
        self._redis = redis_asyncio.Redis.from_url(url, max_connections=max_connections)
        self._prefix = f"{namespace}:{{conversations}}:"
        self._index_key = f"{self._prefix}index"
        self._sequence_key = f"{self._prefix}sequence"
        self._put_script = self._redis.register_script(_REDIS_PUT)
        self._take_script = self._redis.register_script(_REDIS_TAKE)

    def _entry_key(self, key: ConversationKey) -> str:
        return f"{self._prefix}entry:{key.storage_key}"

    async def _put(
        self, key: ConversationKey, entry: ConversationEntry, encoded: bytes
    ) -> PutResult:
        evicted = await self._put_script(
            keys=[self._entry_key(key), self._index_key, self._sequence_key],
            args=[encoded, max(1, math.ceil(self.ttl_s * 1000)), self.max_entries],
        )
        return PutResult(stored=True, evicted=int(evicted))

    async def take(self, key: ConversationKey) -> tuple[Lookup, ConversationEntry | None]:
        raw = await self._take_script(keys=[self._entry_key(key), self._index_key])
        if raw is None:
            return Lookup.MISS, None
        try:
            entry = ConversationEntry.decode_bytes(raw)
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("dropping malformed conversation entry from Redis: %s", exc)
            return Lookup.MISS, None
        if entry.expires_at <= self.clock():
            return Lookup.EXPIRED, None
        return Lookup.HIT, entry

    async def close(self) -> None:
        await self._redis.aclose()


def create_store(
    url: str,
    *,
    ttl_s: float,
    max_entries: int,
    max_entry_bytes: int,
    max_total_bytes: int,
    clock: Clock = time.time,
) -> ConversationStore:
    """`memory` → in-process store; `redis://…`, `rediss://…`, `unix://…` → Redis store."""
    if url == "memory":
        return InMemoryConversationStore(
            ttl_s=ttl_s,
            max_entries=max_entries,
            max_entry_bytes=max_entry_bytes,
            max_total_bytes=max_total_bytes,
            clock=clock,
        )
    return RedisConversationStore(
        url, ttl_s=ttl_s, max_entries=max_entries, max_entry_bytes=max_entry_bytes, clock=clock
    )
