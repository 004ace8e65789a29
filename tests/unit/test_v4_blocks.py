"""DeepSeek-V4's state in 128-token blocks (libs/engine/v4/blocks.py): a request restored from
cached blocks continues exactly as a full recompute, with no token replayed, on random configs
whose windows and compression rates differ (rates that do not divide the block leave open
windows and CSA overlap at the boundary: the carry); blocks are checked bytes."""

from __future__ import annotations

import struct

import pytest
import torch

from libs.engine.v4.blocks import (
    BLOCK_TOKENS,
    MAGIC,
    V4BlockCache,
    V4BlockError,
    decode_block,
    prefill_blocks,
    restore,
)
from libs.engine.v4.load import generate_v4
from libs.engine.v4.model import V4ForCausalLM, V4State
from tests.hf_reference import V4_CONFIGS, build_hf_v4, ours_of


@pytest.fixture(scope="module", params=list(V4_CONFIGS))
def net(request: pytest.FixtureRequest) -> V4ForCausalLM:
    return ours_of(build_hf_v4(request.param))


def _ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_restored_state_continues_as_a_full_recompute(net: V4ForCausalLM) -> None:
    ids = _ids(2 * BLOCK_TOKENS + 45)
    full = net(torch.tensor(ids), V4State.empty(net.cfg))
    _, blocks, _ = prefill_blocks(net, ids[: 2 * BLOCK_TOKENS])
    assert len(blocks) == 2
    state = restore(blocks, net)
    assert state.seen == 2 * BLOCK_TOKENS
    rest = net(torch.tensor(ids[2 * BLOCK_TOKENS :]), state)
    torch.testing.assert_close(rest, full[2 * BLOCK_TOKENS :], rtol=1e-5, atol=1e-5)
    assert torch.equal(rest.argmax(-1), full[2 * BLOCK_TOKENS :].argmax(-1))
    # restoring from the first block alone gives the state at its boundary too
    one = restore(blocks[:1], net)
    tail = net(torch.tensor(ids[BLOCK_TOKENS:]), one)
    torch.testing.assert_close(tail, full[BLOCK_TOKENS:], rtol=1e-5, atol=1e-5)


def test_a_block_holds_only_its_own_entries_and_the_carry(net: V4ForCausalLM) -> None:
    """Entries grow with the sequence, blocks do not: block 1 is no bigger than block 0 by more
    than a rounding of the rates (both carry one window)."""
    _, blocks, _ = prefill_blocks(net, _ids(3 * BLOCK_TOKENS))
    sizes = [len(b) for b in blocks]
    assert max(sizes) - min(sizes) <= 0.2 * min(sizes)
    _, tensors = decode_block(blocks[2], net.cfg.num_hidden_layers)
    w = net.cfg.sliding_window
    assert all(t.shape[0] == w - 1 for n, t in tensors.items() if n.endswith(".window"))


def test_generate_with_the_cache_hits_and_equals_without(net: V4ForCausalLM) -> None:
    cache = V4BlockCache()
    shared = _ids(2 * BLOCK_TOKENS + 10, seed=3)
    first = generate_v4(net, shared, 12, cache=cache)
    assert first.cached_tokens == 0 and len(cache.blocks) == 2
    other = shared[: 2 * BLOCK_TOKENS] + _ids(30, seed=4)
    again = generate_v4(net, other, 12, cache=cache)
    assert again.cached_tokens == 2 * BLOCK_TOKENS
    assert again.token_ids == generate_v4(net, other, 12).token_ids
    # another tenant's salt names other blocks: no hit
    assert generate_v4(net, other, 4, cache=cache, cache_salt=b"t2").cached_tokens == 0


def test_bad_blocks_are_refused_with_a_reason(net: V4ForCausalLM) -> None:
    _, blocks, _ = prefill_blocks(net, _ids(BLOCK_TOKENS))
    good = blocks[0]
    n = net.cfg.num_hidden_layers
    with pytest.raises(V4BlockError, match="magic"):
        decode_block(b"KVFRAME!" + good[8:], n)
    with pytest.raises(V4BlockError, match="bytes do not match"):
        decode_block(good[:-7], n)
    (hlen,) = struct.unpack_from("<I", good, len(MAGIC))
    header = good[12 : 12 + hlen].replace(b'"L0.', b'"L9.')
    with pytest.raises(V4BlockError, match="not a state tensor"):
        decode_block(good[:12] + header + good[12 + hlen :], min(n, 9))
    with pytest.raises(V4BlockError, match="not after block"):
        restore([good, good], net)


def test_frames_carry_blocks_signed_and_for_their_tokens_only(net: V4ForCausalLM) -> None:
    from libs.engine.kv.transfer import KVFormatError, KVIntegrityError
    from libs.engine.v4.blocks import from_frames, to_frames

    ids = _ids(2 * BLOCK_TOKENS, seed=5)
    _, blocks, _ = prefill_blocks(net, ids)
    key = b"secret-key-0123456789abcdef"
    frames = [f for _, _, f in to_frames(blocks, ids, "m", net, key=key)]
    assert from_frames(frames, ids, "m", net, key=key) == blocks
    with pytest.raises(KVIntegrityError):
        from_frames(frames, ids, "m", net, key=b"another key")
    with pytest.raises(KVIntegrityError):
        from_frames(
            frames[:1] + [frames[1][:-1] + bytes([frames[1][-1] ^ 1])], ids, "m", net, key=key
        )
    with pytest.raises(KVFormatError, match="chain digest"):
        from_frames(frames, _ids(2 * BLOCK_TOKENS, seed=6), "m", net, key=key)
    with pytest.raises(KVFormatError, match="chain digest"):
        from_frames(frames, ids, "m", net, salt=b"other tenant", key=key)
    with pytest.raises(KVFormatError, match="model"):
        from_frames(frames, ids, "another-model", net, key=key)
