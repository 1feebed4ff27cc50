"""Stable, chained hashes of full KV blocks: the keys of the prefix cache.

    block 0 tokens --+                block 1 tokens --+
    salt ------------+--> h0 ---------salt ------------+--> h1 --> ...
                          (parent)

A block's hash covers its own token ids, the tenant salt and its parent's hash, so equal hashes
mean equal whole prefixes (not just equal blocks) for the same tenant. The digest is blake2b over
an explicit byte encoding, so it is the same in every process and on every host.
`prefix_block_hashes` gives a prompt's chain, which the cache manager looks up block by block.
(The router does not use these hashes: it keeps its own in-process chain of the prompts' leading
raw token ids, serving/router/prefix_index.py.)
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

DIGEST_SIZE = 16  # bytes; 128-bit hashes make an accidental collision negligible

_NO_PARENT = b"\x00"    # tag byte: the first block of a sequence
_HAS_PARENT = b"\x01"   # tag byte, followed by the parent's DIGEST_SIZE bytes


def block_hash(parent: bytes | None, tokens: Sequence[int], salt: str) -> bytes:
    """The hash of one block of `tokens` following the block hashed `parent` (None: first block).

    `salt` separates tenants: the same tokens under different salts hash differently.
    """
    if parent is not None and len(parent) != DIGEST_SIZE:
        raise ValueError(f"parent hash has {len(parent)} bytes, expected {DIGEST_SIZE}")
    if any(t < 0 for t in tokens):
        raise ValueError(f"cannot hash negative (placeholder) token ids: {list(tokens)}")
    salt_bytes = salt.encode("utf-8")
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    h.update(_NO_PARENT if parent is None else _HAS_PARENT + parent)
    h.update(struct.pack("<Q", len(salt_bytes)))
    h.update(salt_bytes)
    h.update(struct.pack(f"<Q{len(tokens)}q", len(tokens), *tokens))
    return h.digest()


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, salt: str) -> list[bytes]:
    """The chained hashes of every full block of `token_ids`; a partial last block has none."""
    if block_size < 1:
        raise ValueError(f"block_size={block_size}: must be >= 1")
    hashes: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start:start + block_size], salt)
        hashes.append(parent)
    return hashes
