"""Prefix-cache block hashes: SHA-256 chained on the parent block's hash, seeded per process, salted per tenant, keyed
by the images whose placeholders a block covers."""
from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

import numpy as np

from ipc.multimodal import ImageInput

# A fresh seed per engine process: nobody outside can predict a hash, so no prompt can be crafted to collide
# with another tenant's cached block.
_ROOT_SEED = os.urandom(32)


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], cache_salt: str | None = None,
               image_hashes: Sequence[str] = ()) -> bytes:
    """The hash of one full block: its parent's hash (the seed for the first block, with the salt) + its tokens +
    the content hashes of the images whose placeholders it covers (their placeholder ids are all alike)."""
    digest = hashlib.sha256(parent_hash if parent_hash is not None else _ROOT_SEED)
    if parent_hash is None and cache_salt is not None:
        digest.update(cache_salt.encode())
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    for image_hash in image_hashes:
        digest.update(bytes.fromhex(image_hash))
    return digest.digest()


def extend_block_hashes(block_hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        cache_salt: str | None = None, images: Sequence[ImageInput] = ()) -> None:
    """Append the hashes of the full blocks of token_ids not yet hashed."""
    for start in range(len(block_hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = block_hashes[-1] if block_hashes else None
        end = start + block_size
        covered = [image.hash for image in images if image.offset < end and image.end > start]
        block_hashes.append(hash_block(parent, token_ids[start:end], cache_salt, covered))
