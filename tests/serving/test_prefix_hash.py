import pytest

from grpo_lab.serving.routing.prefix_hash import block_hashes, namespace_seed


def test_full_blocks_only_and_last_token_excluded():
    assert block_hashes(list(range(16))) == []  # 15 cacheable tokens: no full block
    assert len(block_hashes(list(range(17)))) == 1
    assert len(block_hashes(list(range(32)))) == 1  # exactly 2 blocks, but the last token is always recomputed
    assert len(block_hashes(list(range(33)))) == 2
    assert len(block_hashes(list(range(32)), cacheable_only=False)) == 2


def test_chain_shares_prefix_and_diverges_after():
    a = block_hashes(list(range(100)), "m")
    b = block_hashes(list(range(48)) + [7] * 52, "m")
    assert a[:3] == b[:3] and a[3] != b[3]
    # the same block content at another depth (different parent) hashes differently
    c = block_hashes(list(range(16, 32)) + [0], "m")
    assert c[0] != a[1]


def test_namespace_seeds_the_chain():
    tokens = list(range(64))
    assert block_hashes(tokens, "trl-policy-v1") != block_hashes(tokens, "trl-policy-v2")
    assert set(block_hashes(tokens, "a")).isdisjoint(block_hashes(tokens, "b"))
    assert block_hashes(tokens, "a") == block_hashes(tokens, "a")
    assert namespace_seed("a") == namespace_seed("a") != namespace_seed("b")


def test_block_size_and_bad_input():
    assert len(block_hashes(list(range(65)), block_size=32)) == 2
    with pytest.raises(ValueError):
        block_hashes([1, 2, 3], block_size=0)
    with pytest.raises(ValueError):
        block_hashes([2**70] * 40)
