"""Conversation stores: take-once, expiry, size bounds; Redis shared by two proxy replicas."""

from __future__ import annotations

import asyncio

import pytest

from kvduplex.protocol import DO_REMOTE_DECODE, REMOTE_BLOCK_IDS, prefill_request_params
from kvduplex.proxy.store import (
    ConversationKey,
    InMemoryConversationStore,
    Lookup,
    RedisConversationStore,
)
from test_proxy_flow import post


def key(conversation: str, tenant: str = "t") -> ConversationKey:
    return ConversationKey(tenant, conversation)


def params(n: int) -> dict:
    return {DO_REMOTE_DECODE: True, REMOTE_BLOCK_IDS: list(range(n))}


async def exercise_store_semantics(store, clock) -> None:
    """Behaviour both stores share; `store` has ttl 10 s and room for 2 entries."""
    assert await store.take(key("a")) == (Lookup.MISS, None)
    await store.put(key("a"), "d0:1", params(1))
    lookup, entry = await store.take(key("a"))
    assert lookup is Lookup.HIT and entry.decode == "d0:1" and entry.params == params(1)
    assert entry.expires_at == clock.now + 10
    assert await store.take(key("a")) == (Lookup.MISS, None)

    # Callers are separate even for the same conversation digest.
    await store.put(key("a", tenant="t1"), "d0:1", params(1))
    assert await store.take(key("a", tenant="t2")) == (Lookup.MISS, None)
    assert (await store.take(key("a", tenant="t1")))[0] is Lookup.HIT

    await store.put(key("old"), "d0:1", params(1))
    clock.advance(9.999)
    await store.put(key("new"), "d0:1", params(2))
    clock.advance(0.001)
    assert await store.take(key("old")) == (Lookup.EXPIRED, None)
    assert (await store.take(key("new")))[0] is Lookup.HIT

    # Writing a conversation again replaces its entry; the size bound evicts the oldest write.
    for name, n in (("x", 1), ("y", 2), ("x", 3)):
        assert (await store.put(key(name), "d0:1", params(n))).evicted == 0
    assert (await store.put(key("z"), "d0:1", params(4))).evicted == 1
    assert await store.take(key("y")) == (Lookup.MISS, None)
    assert (await store.take(key("x")))[1].params == params(3)
    assert (await store.take(key("z")))[1].params == params(4)

    oversized = {REMOTE_BLOCK_IDS: list(range(10_000))}
    assert not (await store.put(key("big"), "d0:1", oversized)).stored
    assert await store.take(key("big")) == (Lookup.MISS, None)


def test_in_memory_store(clock):
    store = InMemoryConversationStore(
        ttl_s=10, max_entries=2, max_entry_bytes=4096, max_total_bytes=1 << 20, clock=clock
    )
    asyncio.run(exercise_store_semantics(store, clock))
    assert len(store) == 0 and store.total_bytes == 0


def test_in_memory_store_is_bounded_by_bytes(clock):
    store = InMemoryConversationStore(
        ttl_s=10, max_entries=100, max_entry_bytes=4096, max_total_bytes=1000, clock=clock
    )

    async def fill() -> list[int]:
        return [(await store.put(key(f"c{i}"), "d0:1", params(50))).evicted for i in range(10)]

    evictions = asyncio.run(fill())
    assert store.total_bytes <= 1000 and sum(evictions) == 10 - len(store)
    assert asyncio.run(store.take(key("c9")))[0] is Lookup.HIT
    assert asyncio.run(store.take(key("c0")))[0] is Lookup.MISS


def test_redis_store(redis_url, clock):
    async def run() -> None:
        store = RedisConversationStore(
            redis_url, ttl_s=10, max_entries=2, max_entry_bytes=4096, clock=clock
        )
        try:
            await exercise_store_semantics(store, clock)
            # Redis itself drops entries nobody takes, after the same TTL.
            await store.put(key("abandoned"), "d0:1", params(1))
            ttl_ms = await store._redis.pttl(store._entry_key(key("abandoned")))
            assert 0 < ttl_ms <= 10_000
        finally:
            await store.close()

    asyncio.run(run())


def test_two_proxy_replicas_share_conversations_through_redis(cluster, redis_url):
    p, d = cluster.engine("p"), cluster.engine("d")
    replica_a = cluster.proxy([p], [d], store=redis_url)
    replica_b = cluster.proxy([p], [d], store=redis_url)

    assert post(replica_a, conversation="c", api_key="k").status_code == 200
    assert post(replica_b, conversation="c", api_key="k", stream=True).status_code == 200
    assert p.bodies()[-1]["kv_transfer_params"] == d.returned_params[0]
    # Used once: the entry is gone from both replicas, replaced by what turn 2 left.
    assert post(replica_a, conversation="c", api_key="k").status_code == 200
    assert p.bodies()[-1]["kv_transfer_params"] == d.returned_params[1]
    # Another caller cannot reach it through either replica.
    post(replica_b, conversation="c", api_key="intruder")
    assert p.bodies()[-1]["kv_transfer_params"] == prefill_request_params()
    post(replica_b, conversation="c", api_key="k")
    assert p.bodies()[-1]["kv_transfer_params"] == d.returned_params[2]


@pytest.fixture
def stopped_redis_url(redis_url):
    import redis

    redis.Redis.from_url(redis_url).shutdown(nosave=True)
    return redis_url


def test_redis_outage_degrades_to_recomputation(cluster, stopped_redis_url):
    p, d = cluster.engine("p"), cluster.engine("d")
    proxy = cluster.proxy([p], [d], store=stopped_redis_url)

    for _ in range(2):
        assert post(proxy, conversation="c").status_code == 200
        assert p.bodies()[-1]["kv_transfer_params"] == prefill_request_params()
    assert proxy.metric("kvduplex_proxy_errors_total", kind="store") == 4
