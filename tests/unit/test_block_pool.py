"""BlockPool: allocation, reference counts, chained block hashes, the cached-free LRU and the state invariant.
A randomized run checks every hit against a shadow copy of the tokens each block holds."""

import random

import pytest

from netra_jax.engine.block_pool import BlockPool, OutOfBlocksError, chain_hashes, hash_block, root_hash

BS = 4


def fill(pool, tokens, extra_key=None):
    """Allocate blocks for `tokens`, pretend their KV was computed, register the full ones."""
    hits = pool.get_computed_blocks(tokens, extra_key)
    pool.take(hits)
    blocks = hits + pool.allocate(pool.blocks_needed(len(tokens)) - len(hits))
    pool.cache_full_blocks(tokens, blocks, len(tokens), extra_key)
    return hits, blocks


def test_allocate_and_free_counts():
    pool = BlockPool(8, BS)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_in_use == 3 and pool.num_free == 5 and pool.usage == 3 / 8
    b = pool.allocate(5)
    assert pool.num_free_blocks == 0 and not set(a) & set(b)
    with pytest.raises(OutOfBlocksError, match="need 1 KV blocks, only 0 of 8 free"):
        pool.allocate(1)
    pool.free(a + b)
    assert pool.num_free == 8 and pool.num_in_use == 0
    pool.check_invariant()


def test_bad_arguments_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, BS)
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(4, 0)
    pool = BlockPool(4, BS)
    with pytest.raises(ValueError, match="cannot allocate -1"):
        pool.allocate(-1)
    [b] = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError, match=f"block {b} freed 1 time"):
        pool.free([b])
    with pytest.raises(ValueError, match="outside the pool"):
        pool.free([4])
    with pytest.raises(ValueError, match="holds no cached prefix"):
        pool.take([b])
    pool.check_invariant()


def test_double_free_in_one_call_changes_nothing():
    pool = BlockPool(4, BS)
    [b] = pool.allocate(1)
    with pytest.raises(ValueError, match="freed 2 time"):
        pool.free([b, b])
    assert pool.ref_count(b) == 1
    pool.check_invariant()


def test_hash_chain_commits_to_prefix_and_key():
    r = root_hash()
    assert hash_block(r, [1, 2]) == hash_block(r, [1, 2])
    assert hash_block(r, [1, 2]) != hash_block(r, [2, 1])
    assert hash_block(hash_block(r, [9]), [1, 2]) != hash_block(hash_block(r, [8]), [1, 2])
    assert root_hash("lora-a") != root_hash("lora-b") != root_hash(None)
    assert root_hash("") != root_hash(None)
    toks = list(range(10))
    h = chain_hashes(toks, BS, 2)
    assert h == [hash_block(r, toks[:4]), hash_block(h[0], toks[4:8])]
    memo = h[:1]
    assert chain_hashes(toks, BS, 2, memo=memo) is memo and memo == h
    with pytest.raises(ValueError, match="need more than"):
        chain_hashes(toks, BS, 3)


def test_prefix_hit_reuses_blocks_and_leaves_last_token():
    pool = BlockPool(16, BS)
    prompt = list(range(100, 112))  # 3 full blocks
    _, blocks = fill(pool, prompt)
    pool.free(blocks)
    assert pool.num_cached == 3 and pool.num_free == 13
    # same 12 tokens: only 2 blocks may hit, the last token has to be computed
    q0, h0 = pool.prefix_queries_tokens, pool.prefix_hits_tokens
    assert pool.get_computed_blocks(prompt) == blocks[:2]
    assert (pool.prefix_queries_tokens - q0, pool.prefix_hits_tokens - h0) == (12, 8)
    assert pool.get_computed_blocks(prompt, record=False) == blocks[:2]
    assert pool.prefix_queries_tokens - q0 == 12
    assert pool.get_computed_blocks(prompt + [7]) == blocks
    # divergence inside block 1 stops the chain there
    assert pool.get_computed_blocks(prompt[:5] + [0] + prompt[6:] + [1]) == blocks[:1]
    # same block contents after a different first block never hit (chained hash)
    assert pool.get_computed_blocks([0, 0, 0, 0] + prompt[4:] + [1]) == []
    # a different cache key does not see the blocks
    assert pool.get_computed_blocks(prompt + [7], extra_key="adapter") == []
    pool.check_invariant()


def test_take_revives_cached_blocks_and_shares_refs():
    pool = BlockPool(8, BS)
    prompt = list(range(9))
    _, blocks = fill(pool, prompt)  # blocks 0,1 full + 1 partial
    assert pool.num_in_use == 3
    hits = pool.get_computed_blocks(prompt)
    assert hits == blocks[:2]
    pool.take(hits)  # shared while the first owner still runs
    assert [pool.ref_count(b) for b in blocks] == [2, 2, 1]
    pool.free(blocks)
    assert pool.num_cached == 0 and pool.num_free == 6  # partial block is plain free, full ones still in use
    pool.free(hits)
    assert pool.num_cached == 2
    assert pool.num_revived(hits) == 2
    pool.take(hits)
    assert pool.num_cached == 0 and pool.num_free_blocks == 6
    pool.check_invariant()


def test_eviction_is_lru_and_tail_first():
    pool = BlockPool(6, BS)
    _, a = fill(pool, list(range(12)))  # 3 full blocks
    _, b = fill(pool, list(range(50, 62)))
    pool.free(a)
    pool.free(b)
    assert pool.num_free == 0 and pool.num_cached == 6
    # a's tail is evicted first, then its head, then b's tail ...
    got = pool.allocate(4)
    assert got == [a[2], a[1], a[0], b[2]]
    assert pool.num_evictions == 4 and pool.get_computed_blocks(list(range(13))) == []
    assert pool.get_computed_blocks(list(range(50, 63))) == b[:2]
    pool.check_invariant()


def test_plain_free_blocks_are_used_before_evicting():
    pool = BlockPool(4, BS)
    _, a = fill(pool, list(range(8)))
    pool.free(a)
    got = pool.allocate(2)
    assert not set(got) & set(a) and pool.num_cached == 2 and pool.num_evictions == 0
    pool.check_invariant()


def test_duplicate_block_is_not_registered_twice():
    pool = BlockPool(8, BS)
    prompt = list(range(5))
    blocks1 = pool.allocate(2)
    blocks2 = pool.allocate(2)  # computed side by side, before either was registered
    assert pool.cache_full_blocks(prompt, blocks1, 5) == 1
    assert pool.cache_full_blocks(prompt, blocks2, 5) == 0
    assert pool.get_computed_blocks(prompt) == blocks1[:1]
    pool.free(blocks2)
    assert pool.num_cached == 0 and pool.num_free == 6  # the duplicate holds nothing reusable
    pool.free(blocks1)
    assert pool.num_cached == 1
    pool.check_invariant()


def test_cache_full_blocks_is_incremental():
    pool = BlockPool(8, BS)
    toks = list(range(3))
    blocks = pool.allocate(1)
    assert pool.cache_full_blocks(toks, blocks, 3) == 0
    toks.append(3)
    assert pool.cache_full_blocks(toks, blocks, 4) == 1
    blocks += pool.allocate(1)
    toks += [4, 5, 6, 7]
    memo = []
    assert pool.cache_full_blocks(toks, blocks, 8, hashes=memo) == 1
    assert pool.block_hash(blocks[1]) == chain_hashes(toks, BS, 2)[1]
    assert pool.cache_full_blocks(toks, blocks, 8) == 0
    with pytest.raises(ValueError, match="need 2 blocks, got 1"):
        pool.cache_full_blocks(toks, blocks[:1], 8)


def test_reset_prefix_cache():
    pool = BlockPool(8, BS)
    _, a = fill(pool, list(range(8)))
    _, b = fill(pool, list(range(20, 28)))
    pool.free(a)
    assert pool.reset_prefix_cache() == 2
    assert pool.num_free == 6 and pool.num_cached == 0
    assert pool.get_computed_blocks(list(range(20, 29))) == []
    pool.free(b)  # in-use blocks lost their registration: they go to the plain free list
    assert pool.num_free == 8
    pool.check_invariant()


def test_prefix_caching_disabled():
    pool = BlockPool(8, BS, enable_prefix_caching=False)
    _, a = fill(pool, list(range(8)))
    pool.free(a)
    assert pool.num_cached == 0 and pool.num_free == 8
    assert pool.get_computed_blocks(list(range(9))) == []
    pool.check_invariant()


def test_invariant_detects_corruption():
    pool = BlockPool(4, BS)
    pool.allocate(1)
    pool._free.append(pool._free[0])
    with pytest.raises(AssertionError, match="twice"):
        pool.check_invariant()
    pool = BlockPool(4, BS)
    [b] = pool.allocate(1)
    pool._free.append(b)
    with pytest.raises(AssertionError, match="two states"):
        pool.check_invariant()


def test_randomized_against_shadow():
    """Random sequences share prefixes; every hit must hold exactly the tokens the query expects."""
    rng = random.Random(0)
    pool = BlockPool(24, BS)
    shadow: dict[int, tuple[int, ...]] = {}  # block -> the tokens written into it
    live: list[list[int]] = []
    bases = [[rng.randrange(5) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    hits_seen = 0
    for _ in range(2000):
        if live and (rng.random() < 0.45 or pool.num_free_blocks < 5):
            pool.free(live.pop(rng.randrange(len(live))))
        else:
            toks = list(rng.choice(bases)) + [rng.randrange(5) for _ in range(rng.randrange(1, 8))]
            hits = pool.get_computed_blocks(toks)
            for j, b in enumerate(hits):
                assert shadow[b] == tuple(toks[j * BS : (j + 1) * BS])
            need = pool.blocks_needed(len(toks)) - len(hits)
            if need + pool.num_revived(hits) > pool.num_free_blocks:
                continue
            pool.take(hits)
            blocks = hits + pool.allocate(need)
            for j in range(len(hits), len(blocks)):
                shadow[blocks[j]] = tuple(toks[j * BS : (j + 1) * BS])
            pool.cache_full_blocks(toks, blocks, len(toks))
            hits_seen += len(hits)
            live.append(blocks)
        pool.check_invariant()
    for blocks in live:
        pool.free(blocks)
    pool.check_invariant()
    assert pool.num_in_use == 0 and hits_seen > 100 and pool.num_evictions > 0
