"""Block hashes are stable, chained, salted, and cover only full blocks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from xlaserve.serving.kv_cache import block_hash, prefix_block_hashes

REPO = str(Path(__file__).resolve().parents[3])


def test_hash_is_stable_across_processes() -> None:
    code = ("from xlaserve.serving.kv_cache import block_hash;"
            "print(block_hash(None, [1, 2, 3], 'acme').hex())")
    env = {**os.environ, "PYTHONHASHSEED": "123", "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env)
    assert out.stdout.strip() == block_hash(None, [1, 2, 3], "acme").hex()
    assert len(block_hash(None, [1, 2, 3], "")) == 16


def test_chain_salt_and_content_all_matter() -> None:
    h0 = block_hash(None, [1, 2], "")
    assert block_hash(h0, [3, 4], "") != block_hash(None, [3, 4], "")
    assert block_hash(None, [1, 2], "a") != h0
    assert block_hash(None, [2, 1], "") != h0
    # the token count is encoded: [1] + [2] is not [1, 2]
    assert block_hash(block_hash(None, [1], ""), [2], "") != h0


def test_prefix_hashes_cover_full_blocks_only() -> None:
    tokens = list(range(10))
    hashes = prefix_block_hashes(tokens, 4, "t")
    assert len(hashes) == 2
    assert hashes[0] == block_hash(None, [0, 1, 2, 3], "t")
    assert hashes[1] == block_hash(hashes[0], [4, 5, 6, 7], "t")
    assert prefix_block_hashes(tokens[:3], 4, "t") == []
    assert prefix_block_hashes(tokens[:8], 4, "t") == hashes


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="placeholder"):
        block_hash(None, [1, -1], "")
    with pytest.raises(ValueError, match="parent hash has 3 bytes"):
        block_hash(b"abc", [1], "")
    with pytest.raises(ValueError, match="block_size=0"):
        prefix_block_hashes([1], 0, "")
