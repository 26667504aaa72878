"""Per-block fingerprints of the tokens a KV block holds.

vLLM's own prefix-cache block hashes may be seeded per process, so two engines cannot compare
them. kvduplex computes its own: block i's fingerprint is an 8-byte BLAKE2b digest of block
i-1's fingerprint followed by block i's token ids (int64, little endian). The chain starts from a
root digest over the protocol tag, the block size and a request salt (vLLM's `cache_salt`, the
LoRA adapter's name and path), so equal fingerprints at block i mean equal tokens at every
position up to the end of block i. The last block may be partial: its fingerprint covers only
the tokens it holds.

Fingerprints travel in `kv_transfer_params` as 16-character lowercase hex strings.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.request import Request

FINGERPRINT_BYTES = 8
FINGERPRINT_HEX_CHARS = 2 * FINGERPRINT_BYTES
_TAG = b"kvduplex.token-fingerprint.v1"


def _root(block_size: int, salt: str) -> bytes:
    material = _TAG + block_size.to_bytes(4, "little") + salt.encode("utf-8")
    return hashlib.blake2b(material, digest_size=FINGERPRINT_BYTES).digest()


def block_fingerprints(
    token_ids: Sequence[int], block_size: int, salt: str = ""
) -> list[str]:
    """Fingerprints of the blocks holding `token_ids`: one per full block, plus one for a
    trailing partial block when len(token_ids) is not a multiple of `block_size`."""
    return PromptFingerprints(token_ids, block_size, salt).of_prefix(len(token_ids))


class PromptFingerprints:
    """One prompt's block fingerprints, each block hashed once: the full blocks' up front, a
    partial last block's for whichever prefix length asks (it chains from the full blocks)."""

    def __init__(
        self,
        token_ids: Sequence[int],
        block_size: int,
        salt: str = "",
        *,
        _prefix: PromptFingerprints | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.token_ids = list(token_ids)
        self.block_size = block_size
        self._data = array("q", self.token_ids).tobytes()
        stride = block_size * 8
        if _prefix is None:
            self._digests = [_root(block_size, salt)]
        else:  # its full blocks are ours: hashed once
            self._digests = list(_prefix._digests)
        for start in range(
            (len(self._digests) - 1) * stride, len(self.token_ids) // block_size * stride, stride
        ):
            self._digests.append(_digest(self._digests[-1], self._data[start : start + stride]))

    def extended(self, token_ids: Sequence[int]) -> PromptFingerprints:
        """The fingerprints of `token_ids`, which continue this prompt's tokens (a turn's
        prompt and answer): only the blocks past this prompt's full blocks are hashed."""
        token_ids = list(token_ids)
        full = (len(self._digests) - 1) * self.block_size
        if token_ids[:full] != self.token_ids[:full]:
            raise ValueError("the tokens do not continue the prompt's full blocks")
        return PromptFingerprints(token_ids, self.block_size, _prefix=self)

    @cached_property
    def full_blocks(self) -> tuple[str, ...]:
        """The fingerprints of the prompt's full blocks (made once: lookups, their copy of
        the announcements and handoffs each read them)."""
        return tuple(digest.hex() for digest in self._digests[1:])

    @property
    def end(self) -> str:
        """The fingerprint of the whole prompt (its last block's, partial or full)."""
        full = len(self._digests) - 1
        if full * self.block_size == len(self.token_ids):
            return self._digests[-1].hex()
        return _digest(self._digests[-1], self._data[full * self.block_size * 8 :]).hex()

    def of_prefix(self, num_tokens: int) -> list[str]:
        """The fingerprints of the blocks holding the prompt's first `num_tokens` tokens."""
        num_tokens = max(0, min(num_tokens, len(self.token_ids)))
        full, tail = divmod(num_tokens, self.block_size)
        out = [digest.hex() for digest in self._digests[1 : full + 1]]
        if tail:
            start = full * self.block_size * 8
            out.append(_digest(self._digests[full], self._data[start : start + tail * 8]).hex())
        return out

    def tails(self, full: int, shortest: int = 1) -> Iterator[tuple[int, str]]:
        """(n, fingerprint) of a partial block after the prompt's first `full` full blocks
        holding its next n tokens, for n from `shortest` to a block less one (or the prompt's
        end): each token is hashed once."""
        start = full * self.block_size
        count = max(0, min(self.block_size - 1, len(self.token_ids) - start))
        shortest = max(1, shortest)
        if shortest > count:
            return
        running = hashlib.blake2b(self._digests[full], digest_size=FINGERPRINT_BYTES)
        running.update(self._data[start * 8 : (start + shortest - 1) * 8])
        for n in range(shortest, count + 1):
            running.update(self._data[(start + n - 1) * 8 : (start + n) * 8])
            yield n, running.copy().hexdigest()


def _digest(parent: bytes, block: bytes) -> bytes:
    return hashlib.blake2b(parent + block, digest_size=FINGERPRINT_BYTES).digest()


def request_salt(cache_salt: str | None, lora_name: str | None, lora_path: str | None) -> str:
    """Salt separating KV computed under a different cache salt or LoRA adapter: the adapter's
    name and path, as vLLM's own block hashes take them (one name may be loaded from another
    path on another engine)."""
    lora = "" if lora_name is None else f"{lora_name}\x00{lora_path or ''}"
    return f"{cache_salt or ''}\x00{lora}"


def salt_of(request: Request) -> str:
    """The salt of a vLLM request's fingerprints (`request_salt`)."""
    lora = request.lora_request
    if lora is None:
        return request_salt(request.cache_salt, None, None)
    return request_salt(request.cache_salt, lora.lora_name, lora.lora_path)


def prompt_fingerprints(request: Request, block_size: int) -> PromptFingerprints:
    """The fingerprints of a vLLM request's prompt."""
    return PromptFingerprints(request.prompt_token_ids or [], block_size, salt_of(request))


def matched_prefix_tokens(
    local: PromptFingerprints,
    remote_fingerprints: Sequence[str],
    remote_num_tokens: int,
) -> tuple[int, int]:
    """How many leading tokens of the `local` prompt the remote blocks hold with equal token ids.

    The remote holds `remote_num_tokens` tokens in `len(remote_fingerprints)` blocks (of the
    local prompt's block size and salt). Returns (matched tokens, index of the first block
    whose tokens differ, or -1 when no compared block differs). A remote block counts only when
    the local tokens cover all the tokens it holds.
    """
    usable = min(remote_num_tokens, len(local.token_ids))
    block_size = local.block_size
    matched = 0
    for index, (mine, theirs) in enumerate(zip(local.of_prefix(usable), remote_fingerprints)):
        block_end = min((index + 1) * block_size, remote_num_tokens)
        if block_end > usable:
            break
        if mine != theirs:
            return matched, index
        matched = block_end
    return matched, -1
