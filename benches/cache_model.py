"""Where a prefill node's prompt tokens come from under `benches/load.py`'s workload: a model of
the servers' block pools (no servers; seconds to run), to weigh a retention design before it is
built and measured.

It replays load.py's conversations (the same seeds: start times, think times, turn lengths)
through block-granular prefix caches and counts the prompt tokens the prefill side computes,
the figure load.py reports as `prefill_computed_tokens`:
- `ideal`: one pool of the pair's blocks (load.py's ideal server). As in vLLM's prefix cache,
  a request's blocks are freed last block first, the least recently freed is reused first,
  and only a prompt's leading cached blocks are hits; one block of each pool is vLLM's null
  block. A turn's KV is that of its prompt and answer but the last sampled token.
- `kvduplex`: as built. P's pool (a node's blocks) caches every prompt's full blocks. D takes
  each turn's blocks, less its own prefix-cache hit, for the decode; then holds the finished turn
  (its partial last block included) while held turns fit `decode_kv_hold_max_fraction` of its
  blocks, giving up the least recently used first (a pull uses it) to that cap and to a turn
  whose blocks would not fit (a hold lasts until then: its lease outlives a point). A later
  turn's history comes from P's cache, else from D's held turn where that gains at least the
  recompute threshold.
- `p-cache-2x`: the same with P's pool doubled (measured once: `benches/RESULTS.md`, Load).
- `exclusive`: once D holds a turn, P reuses first the cached blocks of its prompt (D has them
  too), so its cache keeps other histories longer; they stay first after D gives the turn up.
- `supersede`: D gives up a chat's held turn once it holds the chat's next one (whose blocks
  hold the same tokens and more).
- `d-cache`: P may also pull what D's prefix cache still has of a history D no longer holds
  (free blocks keep their content until reused; today only held turns are offered).
- `p-overflow`: `d-cache`, and every cached block P reuses is first copied into D's free
  blocks (D's spare memory as a second tier of P's cache).
A prefill is instantaneous and a decode takes `--decode-s`; turns whose blocks D cannot find
even with every hold given up wait, first come first served, for running ones to end. Every
point starts with empty pools (load.py's servers carry what the point before left). Batching
and compute time are not modelled: compare the counts, not times, with load.py's.

    PYTHONPATH=python .venv/bin/python benches/cache_model.py [--seeds 20] [--cap 0.5]
"""

from __future__ import annotations

import argparse
import heapq
from collections import Counter, OrderedDict, deque

from load import (
    BLOCK_TOKENS,
    FULL,
    RECOMPUTE_THRESHOLD,
    PointPlan,
    history_tokens,
    kv_plan,
    point_plan,
)

MODES = ("ideal", "kvduplex", "p-cache-2x", "exclusive", "supersede", "d-cache", "p-overflow")


class Pool:
    """A block pool: blocks referenced by requests or holds, and free blocks that keep their
    content (a chat's block index) until reused, least recently freed first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.refs: Counter[tuple[int, int]] = Counter()
        self.anonymous = 0  # referenced blocks no later prompt can hit (partial last blocks)
        self.free: OrderedDict[tuple[int, int], None] = OrderedDict()

    def prefix(self, chat: int, full_blocks: int) -> int:
        """Blocks of the chat's history, from its first, that this pool has."""
        n = 0
        while n < full_blocks and ((chat, n) in self.refs or (chat, n) in self.free):
            n += 1
        return n

    def take(self, chat: int, blocks: int, partial: bool) -> list[tuple[int, int]] | None:
        """References the chat's first `blocks` blocks (its leading cached ones reused, the
        others new; a cached copy past the first miss is given up) and a partial block. Returns
        the cached blocks it reused for them, in order (`p-overflow` moves them to D); None,
        taking nothing, if they do not fit."""
        keys = [(chat, i) for i in range(blocks)]
        hit = self.prefix(chat, blocks)
        reused = [key for key in keys[:hit] if key in self.free]
        stale = [key for key in keys[hit:] if key in self.free]
        new = blocks - hit + partial
        unused = self.size - len(self.refs) - self.anonymous - len(self.free) + len(stale)
        if new > unused + len(self.free) - len(reused) - len(stale):
            return None
        for key in reused + stale:
            del self.free[key]
        evicted = [self.free.popitem(last=False)[0] for _ in range(max(0, new - unused))]
        self.refs.update(keys)
        self.anonymous += partial
        return evicted

    def release(self, chat: int, blocks: int, partial: bool) -> None:
        """Drops a reference to the chat's first `blocks` blocks and a partial block; freed
        ones join the free queue last block first (so it is reused first), as vLLM frees."""
        for i in reversed(range(blocks)):
            key = (chat, i)
            self.refs[key] -= 1
            if not self.refs[key]:
                del self.refs[key]
                self.free[key] = None
        self.anonymous -= partial

    def offer(self, keys: list[tuple[int, int]]) -> None:
        """Cached blocks copied in from elsewhere, into free blocks (reusing the least
        recently freed cached ones when no block is unused)."""
        for key in keys:
            if key in self.refs or key in self.free:
                continue
            if self.size - len(self.refs) - self.anonymous - len(self.free) <= 0:
                if not self.free:
                    return
                self.free.popitem(last=False)
            self.free[key] = None

    def demote(self, chat: int, blocks: int) -> None:
        """The chat's free cached blocks are reused before any other (last block first)."""
        for i in range(blocks):
            if (chat, i) in self.free:
                self.free.move_to_end((chat, i), last=False)


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_TOKENS)


def _shape(tokens: int) -> tuple[int, bool]:
    return tokens // BLOCK_TOKENS, tokens % BLOCK_TOKENS > 0


def run(mode: str, plan: PointPlan, cap: float, decode_s: float) -> tuple[int, int]:
    """Prompt tokens the prefill side computes at one load.py point, and those pulled from D."""
    workload = FULL
    node = kv_plan(workload)["node_blocks"] - 1  # less vLLM's null block
    cap_blocks = int(cap * (node + 1))  # as the scheduler computes it
    # (time, order, event, chat, turn): a turn reaches the prefill side, its decode asks D for
    # blocks, its answer is done.
    events = [(start, 0, "turn", chat, 0) for chat, start in enumerate(plan.starts_s)]
    heapq.heapify(events)
    computed = pulled = 0
    ideal = Pool(2 * (node + 1) - 1)
    p = Pool(2 * (node + 1) - 1 if mode == "p-cache-2x" else node)
    d = Pool(node)
    # (chat, turn) -> tokens of KV D holds of it, least recently used first.
    held: OrderedDict[tuple[int, int], int] = OrderedDict()
    waiting: deque[tuple[int, int]] = deque()  # decodes waiting for D's blocks, in order

    def kv_tokens(turn: int) -> int:
        """A finished turn's KV: its prompt and answer but the last sampled token."""
        return history_tokens(workload, turn) - 1

    def give_up(key: tuple[int, int]) -> None:
        d.release(key[0], *_shape(held.pop(key)))

    def admit(now: float) -> None:
        while waiting:
            chat, turn = waiting[0]
            while (taken := d.take(chat, *_shape(kv_tokens(turn)))) is None and held:
                give_up(next(iter(held)))
            if taken is None:
                return
            waiting.popleft()
            heapq.heappush(events, (now + decode_s, 2, "answer", chat, turn))

    while events:
        now, _, event, chat, turn = heapq.heappop(events)
        prompt = history_tokens(workload, turn) - workload.answer_tokens
        kv = kv_tokens(turn)
        full = prompt // BLOCK_TOKENS
        if event == "turn" and mode == "ideal":
            computed += prompt - ideal.prefix(chat, full) * BLOCK_TOKENS
            if ideal.take(chat, *_shape(kv)) is None:
                raise SystemExit("the ideal's pool is too small for its running turns")
            heapq.heappush(events, (now + decode_s, 2, "answer", chat, turn))
        elif event == "turn":
            have = p.prefix(chat, full) * BLOCK_TOKENS
            mine = [(tokens, key) for key, tokens in held.items() if key[0] == chat]
            source, source_key = max(mine, default=(0, None))
            if mode in ("d-cache", "p-overflow"):
                source = max(source, d.prefix(chat, full) * BLOCK_TOKENS)
            gain = min(source, prompt) - have
            if gain >= RECOMPUTE_THRESHOLD:
                pulled += gain
                have += gain
                if source_key is not None:
                    held.move_to_end(source_key)  # its claim uses it
            computed += prompt - have
            # P prefills, D reads the prompt, P's blocks go back to its cache.
            evicted = p.take(chat, *_shape(prompt))
            if evicted is None:
                raise SystemExit("P's pool is too small for a prompt")
            p.release(chat, *_shape(prompt))
            if mode == "p-overflow":
                d.offer(evicted)
            waiting.append((chat, turn))
            admit(now)
        elif mode == "ideal":
            ideal.release(chat, *_shape(kv))
        else:
            if _blocks(kv) <= cap_blocks:
                if mode == "supersede" and (chat, turn - 1) in held:
                    give_up((chat, turn - 1))
                while held and sum(map(_blocks, held.values())) + _blocks(kv) > cap_blocks:
                    give_up(next(iter(held)))
                held[(chat, turn)] = kv
                if mode == "exclusive":
                    p.demote(chat, kv // BLOCK_TOKENS)
            else:
                d.release(chat, *_shape(kv))
            admit(now)
        if event == "answer" and turn + 1 < workload.turns:
            think = plan.thinks_s[chat][turn]
            heapq.heappush(events, (now + think, 0, "turn", chat, turn + 1))
    return computed, pulled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10, help="points per rate (load.py seeds)")
    parser.add_argument("--cap", type=float, default=0.5, help="decode_kv_hold_max_fraction")
    parser.add_argument("--decode-s", type=float, default=0.4, help="one turn's decode time")
    args = parser.parse_args()
    print(
        f"Prompt tokens the prefill side computes / pulls from D, mean of {args.seeds} points "
        f"(load.py's workload and seeds, cap {args.cap}, decode {args.decode_s} s)"
    )
    print("chats/s " + "".join(f"{mode:>16}" for mode in MODES))
    for rate in FULL.rates:
        plans = [point_plan(FULL, rate, index) for index in range(args.seeds)]
        cells = []
        for mode in MODES:
            runs = [run(mode, plan, args.cap, args.decode_s) for plan in plans]
            computed = sum(c for c, _ in runs) / len(runs) / 1000
            pulled = sum(p for _, p in runs) / len(runs) / 1000
            cells.append(f"{computed:.1f}k / {pulled:.1f}k")
        print(f"{rate:7} " + "".join(f"{cell:>16}" for cell in cells))


if __name__ == "__main__":
    main()
