"""Host-side bookkeeping of the paged KV cache: free list, reference counts and prefix caching of full blocks.
A full block is named by a chained SHA-256 hash of every token up to its end, so equal names mean equal contents."""

from __future__ import annotations

import functools
import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence

_ROOT_TAG = b"netra_jax/kv-block/v1"


class OutOfBlocksError(RuntimeError):
    """More blocks were requested than are free (plain free plus cached free)."""


@functools.lru_cache(maxsize=64)
def root_hash(extra_key: str | bytes | None = None) -> bytes:
    """Parent hash of a sequence's first block; `extra_key` (adapter, model id) separates otherwise equal prompts."""
    h = hashlib.sha256(_ROOT_TAG)
    if extra_key is None:
        h.update(b"\x00")
    else:
        key = extra_key.encode() if isinstance(extra_key, str) else bytes(extra_key)
        h.update(b"\x01" + len(key).to_bytes(8, "little") + key)
    return h.digest()


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """sha256(parent || int64 little-endian token ids): a block's hash commits to every token before it."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def chain_hashes(
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    extra_key: str | bytes | None = None,
    memo: list[bytes] | None = None,
) -> list[bytes]:
    """Hashes of the first `num_blocks` full blocks of `token_ids`. `memo` (hashes already known for this token
    sequence, which only ever grows) is extended in place and returned."""
    memo = [] if memo is None else memo
    if num_blocks * block_size > len(token_ids):
        raise ValueError(f"{num_blocks} full blocks of {block_size} need more than {len(token_ids)} tokens")
    for j in range(len(memo), num_blocks):
        parent = memo[j - 1] if j else root_hash(extra_key)
        memo.append(hash_block(parent, token_ids[j * block_size : (j + 1) * block_size]))
    return memo


class BlockPool:
    """Every block is in exactly one state: plain free (no content worth keeping), cached free (reference count 0
    but its hash still registered, so a prefix hit can revive it; evicted oldest first), or in use (refs > 0)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._refs = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks  # hash of the tokens a full computed block holds
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # cached-free blocks; head is evicted first
        self._by_hash: dict[bytes, int] = {}  # registered hash -> the one block that serves hits for it
        self.prefix_hits_tokens = 0
        self.prefix_queries_tokens = 0
        self.num_evictions = 0

    # ------------------------------------------------------------------ counts
    @property
    def num_total(self) -> int:
        return self.num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out: plain free plus cached free (evicted on demand)."""
        return len(self._free) + len(self._cached)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_in_use / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits_tokens / self.prefix_queries_tokens if self.prefix_queries_tokens else 0.0

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._refs[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        self._check_id(block_id)
        return self._hash[block_id]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _check_id(self, b: object) -> None:
        if not isinstance(b, int) or not 0 <= b < self.num_blocks:
            raise ValueError(f"block id {b!r} is outside the pool [0, {self.num_blocks})")

    # ------------------------------------------------------------------ prefix cache
    def get_computed_blocks(
        self,
        token_ids: Sequence[int],
        extra_key: str | bytes | None = None,
        hashes: list[bytes] | None = None,
        record: bool = True,
    ) -> list[int]:
        """Longest chain of cached full blocks that prefixes `token_ids`, never covering the last token (it must be
        computed to have logits). Takes no references. `hashes` is the caller's memo for these tokens."""
        if not self.enable_prefix_caching or not token_ids:
            return []
        bs = self.block_size
        memo = [] if hashes is None else hashes
        blocks: list[int] = []
        for j in range((len(token_ids) - 1) // bs):
            if j == len(memo):
                parent = memo[j - 1] if j else root_hash(extra_key)
                memo.append(hash_block(parent, token_ids[j * bs : (j + 1) * bs]))
            b = self._by_hash.get(memo[j])
            if b is None:
                break
            blocks.append(b)
        if record:
            self.record_prefix_query(len(token_ids), len(blocks) * bs)
        return blocks

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries_tokens += num_query_tokens
        self.prefix_hits_tokens += num_hit_tokens

    def num_revived(self, block_ids: Sequence[int]) -> int:
        """How many of these hit blocks are cached free, i.e. how much `take` lowers `num_free_blocks`."""
        return sum(1 for b in block_ids if self._refs[b] == 0)

    def take(self, block_ids: Sequence[int]) -> None:
        """Take one reference on each hit block, reviving cached-free ones (they leave the eviction order)."""
        for b in block_ids:
            self._check_id(b)
            if self._refs[b] == 0 and b not in self._cached:
                raise ValueError(f"block {b} is free and holds no cached prefix; it cannot be shared")
        for b in block_ids:
            if self._refs[b] == 0:
                del self._cached[b]
            self._refs[b] += 1

    def cache_full_blocks(
        self,
        request_tokens: Sequence[int],
        block_ids: Sequence[int],
        num_computed_tokens: int,
        extra_key: str | bytes | None = None,
        hashes: list[bytes] | None = None,
    ) -> int:
        """Register the blocks that became full now that `num_computed_tokens` tokens of `request_tokens` are in
        `block_ids`. Returns how many hashes were newly registered (a block equal to an already registered one
        keeps its hash for chaining but is not registered, and goes back to the plain free list when freed)."""
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        if not 0 <= num_computed_tokens <= len(request_tokens):
            raise ValueError(f"num_computed_tokens {num_computed_tokens} outside [0, {len(request_tokens)}]")
        num_full = num_computed_tokens // bs
        if num_full > len(block_ids):
            raise ValueError(f"{num_computed_tokens} computed tokens need {num_full} blocks, got {len(block_ids)}")
        start = num_full  # blocks fill in order, so the unhashed full blocks are a suffix of the full ones
        while start > 0 and self._hash[block_ids[start - 1]] is None:
            start -= 1
        new = 0
        for i in range(start, num_full):
            b = block_ids[i]
            if hashes is not None and i < len(hashes):
                h = hashes[i]
            else:
                parent = self._hash[block_ids[i - 1]] if i else root_hash(extra_key)
                h = hash_block(parent, request_tokens[i * bs : (i + 1) * bs])
                if hashes is not None and i == len(hashes):
                    hashes.append(h)
            if self._refs[b] == 0:
                raise ValueError(f"block {b} is not in use and cannot be registered")
            self._hash[b] = h
            if h not in self._by_hash:
                self._by_hash[h] = b
                new += 1
        return new

    def reset_prefix_cache(self) -> int:
        """Forget every registered prefix: cached-free blocks become plain free, blocks in use stop serving hits.
        Returns how many cached-free blocks were dropped."""
        dropped = len(self._cached)
        for b in self._cached:
            self._hash[b] = None
            self._free.append(b)
        self._cached.clear()
        self._by_hash.clear()
        return dropped

    # ------------------------------------------------------------------ allocation
    def allocate(self, n: int) -> list[int]:
        """`n` blocks with one reference each: plain free ones first, then cached free ones evicted oldest first.
        Raises OutOfBlocksError (allocating nothing) when fewer than `n` are free."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"cannot allocate {n!r} blocks")
        if n > self.num_free_blocks:
            raise OutOfBlocksError(f"need {n} KV blocks, only {self.num_free_blocks} of {self.num_blocks} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._cached.popitem(last=False)
                del self._by_hash[self._hash[b]]
                self._hash[b] = None
                self.num_evictions += 1
            self._refs[b] = 1
            out.append(b)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block, last block first, so that a sequence's tail is evicted before its
        head (a later prefix hit needs the head). Registered blocks reaching 0 refs stay cached."""
        counts: dict[int, int] = {}
        for b in block_ids:
            self._check_id(b)
            counts[b] = counts.get(b, 0) + 1
        for b, c in counts.items():
            if self._refs[b] < c:
                raise ValueError(f"block {b} freed {c} time(s) but holds {self._refs[b]} reference(s)")
        for b in reversed(block_ids):
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            h = self._hash[b]
            if h is not None and self._by_hash.get(h) == b:
                self._cached[b] = None
            else:
                self._hash[b] = None
                self._free.append(b)

    # ------------------------------------------------------------------ checks
    def check_invariant(self) -> None:
        """Raise AssertionError unless every block is in exactly one state and the hash map is consistent."""
        n = self.num_blocks
        free, cached = set(self._free), set(self._cached)
        in_use = {b for b in range(n) if self._refs[b] > 0}
        if len(free) != len(self._free):
            raise AssertionError("a block appears twice in the free list")
        if free & cached or free & in_use or cached & in_use:
            raise AssertionError(f"blocks in two states: {sorted((free & cached) | (free | cached) & in_use)}")
        if len(free) + len(cached) + len(in_use) != n:
            raise AssertionError(f"free {len(free)} + cached {len(cached)} + in use {len(in_use)} != total {n}")
        if any(r < 0 for r in self._refs):
            raise AssertionError("negative reference count")
        for b in free:
            if self._hash[b] is not None:
                raise AssertionError(f"plain free block {b} still carries a hash")
        for b in cached:
            h = self._hash[b]
            if h is None or self._by_hash.get(h) != b:
                raise AssertionError(f"cached free block {b} is not registered under its hash")
        for h, b in self._by_hash.items():
            if self._hash[b] != h or (b not in in_use and b not in cached):
                raise AssertionError(f"hash map entry for block {b} is stale")
        if not self.enable_prefix_caching and (cached or self._by_hash):
            raise AssertionError("prefix caching is disabled but blocks are cached")
