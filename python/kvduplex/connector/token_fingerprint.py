"""Per-block fingerprints of the tokens a KV block holds.

vLLM's own prefix-cache block hashes may be seeded per process, so two engines cannot compare
them. kvduplex computes its own: block i's fingerprint is an 8-byte BLAKE2b digest of block
i-1's fingerprint followed by block i's token ids (int64, little endian). The chain starts from a
root digest over the protocol tag, the block size and a request salt (vLLM's `cache_salt`, LoRA
name), so equal fingerprints at block i mean equal tokens at every position up to the end of
block i. The last block may be partial: its fingerprint covers only the tokens it holds.

Fingerprints travel in `kv_transfer_params` as 16-character lowercase hex strings.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

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
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    data = array("q", token_ids).tobytes()
    stride = block_size * 8
    parent = _root(block_size, salt)
    out: list[str] = []
    for start in range(0, len(data), stride):
        digest = hashlib.blake2b(
            parent + data[start : start + stride], digest_size=FINGERPRINT_BYTES
        ).digest()
        out.append(digest.hex())
        parent = digest
    return out


def request_salt(cache_salt: str | None, lora_name: str | None) -> str:
    """Salt separating KV computed under a different cache salt or LoRA adapter."""
    return f"{cache_salt or ''}\x00{lora_name or ''}"


def matched_prefix_tokens(
    local_token_ids: Sequence[int],
    remote_fingerprints: Sequence[str],
    remote_num_tokens: int,
    block_size: int,
    salt: str = "",
) -> tuple[int, int]:
    """How many leading tokens of `local_token_ids` the remote blocks hold with equal token ids.

    The remote holds `remote_num_tokens` tokens in `len(remote_fingerprints)` blocks. Returns
    (matched tokens, index of the first block whose tokens differ, or -1 when no compared block
    differs). A remote block counts only when the local tokens cover all the tokens it holds.
    """
    usable = min(remote_num_tokens, len(local_token_ids))
    local = block_fingerprints(local_token_ids[:usable], block_size, salt)
    matched = 0
    for index, (mine, theirs) in enumerate(zip(local, remote_fingerprints)):
        block_end = min((index + 1) * block_size, remote_num_tokens)
        if block_end > usable:
            break
        if mine != theirs:
            return matched, index
        matched = block_end
    return matched, -1
