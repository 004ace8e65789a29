from __future__ import annotations

import os
import subprocess
import sys

import pytest

from libs.common.hashchain import DIGEST_SIZE, block_hash, chain_hashes, chain_root

TOKENS = list(range(1000, 1000 + 700))


def test_one_digest_per_full_block_and_prefix_property() -> None:
    h = chain_hashes(TOKENS, 128)
    assert len(h) == 5 and all(len(d) == DIGEST_SIZE for d in h)
    assert chain_hashes(TOKENS[:300], 128) == h[:2]
    assert len(chain_hashes(TOKENS, 128, include_partial=True)) == 6


def test_a_block_name_commits_to_everything_before_it() -> None:
    h = chain_hashes(TOKENS, 128)
    changed = TOKENS.copy()
    changed[5] += 1  # inside the first block
    h2 = chain_hashes(changed, 128)
    assert all(a != b for a, b in zip(h, h2))


def test_salt_and_block_size_change_every_name() -> None:
    plain = chain_hashes(TOKENS, 128)
    salted = chain_hashes(TOKENS, 128, b"tenant-a")
    assert not set(plain) & set(salted)
    assert chain_hashes(TOKENS, 128, b"tenant-b") != salted
    assert chain_root(64) != chain_root(128)


def test_continuing_a_chain_matches_hashing_from_scratch() -> None:
    h = chain_hashes(TOKENS, 128, b"s")
    assert chain_hashes(TOKENS, 128, b"s", start=2, parent=h[1]) == h[2:]
    assert block_hash(h[0], TOKENS[128:256]) == h[1]
    with pytest.raises(ValueError):
        chain_hashes(TOKENS, 128, start=2)


def test_same_digests_in_another_process_with_another_hash_seed() -> None:
    code = (
        "from libs.common.hashchain import chain_hashes; "
        "print(chain_hashes(list(range(1000, 1700)), 128, b'x')[-1].hex())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.strip() == chain_hashes(TOKENS, 128, b"x")[-1].hex()


def test_bad_tokens_are_refused() -> None:
    with pytest.raises(ValueError, match="token ids"):
        chain_hashes([1, -2] + [0] * 126, 128)
    with pytest.raises(ValueError):
        chain_root(0)
