"""Paged KV-cache bookkeeping: page allocation, reference counts, and prefix
caching by hashing full pages (each hash chains its parent's).

Page hashes are SHA-256 digests, not Python's `hash()`: tuple hashes of
integers are deterministic and cheap to collide on purpose, and a crafted
prompt whose page collided with another request's would read that request's
K/V (vLLM moved to SHA-256 for the same reason). A digest is cheap next to a step
(docs/performance.md#figures-behind-choices-in-the-code).

Freed pages keep their hash and stay reusable until they are evicted, least
recently freed first, so a later request with the same prefix finds them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine's sequences are what pages are held for; the engine imports this module
    from fw.engine.request import Sequence


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class PageManager:
    def __init__(self, num_blocks: int, page_size: int, enable_prefix_caching: bool):
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # page hash -> block id
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # -- prefix cache ------------------------------------------------------------------

    def _hash_blocks(self, seq: Sequence, upto_tokens: int) -> None:
        """Extend seq.block_hashes to cover the full pages among its first `upto_tokens` tokens."""
        p = self.page_size
        for i in range(len(seq.block_hashes), upto_tokens // p):
            digest = hashlib.sha256(seq.block_hashes[i - 1] if i else seq.request.cache_salt)
            digest.update(array("q", seq.token_ids[i * p:(i + 1) * p]).tobytes())
            seq.block_hashes.append(digest.digest())

    def _uses_prefix_cache(self, seq: Sequence) -> bool:
        # Prompt logprobs need the logits of every prompt position, so those prompts are computed.
        return self.enable_prefix_caching and seq.params.prompt_logprobs is None

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached pages holding seq's leading tokens; return how many tokens they cover.

        At least one token is left to compute, so the step produces logits."""
        if seq.block_table or not self._uses_prefix_cache(seq):
            return 0
        self._hash_blocks(seq, seq.num_tokens - 1)
        hits = []
        for h in seq.block_hashes:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        self.stats.queried_tokens += seq.num_tokens
        self.stats.hit_tokens += len(hits) * self.page_size
        for block in hits:
            if self.ref_counts[block] == 0:
                self.free.pop(block)
            self.ref_counts[block] += 1
        seq.block_table = hits
        seq.num_hashed_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.page_size
        seq.num_cached_tokens = seq.num_computed_tokens
        return seq.num_computed_tokens

    def undo_match(self, seq: Sequence) -> None:
        """Give back the pages `match_prefix` attached to a sequence that was not admitted after all.

        Waiting sequences must hold no pages: pinned there, they can starve the running
        sequences, or each other, of a cache they would fit in. The lookup is not counted;
        it is repeated, and counted, when the sequence is admitted."""
        if self._uses_prefix_cache(seq):
            self.stats.queried_tokens -= seq.num_tokens
            self.stats.hit_tokens -= seq.num_cached_tokens
        self.release(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Publish the pages seq has fully computed so other sequences can reuse them."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.page_size
        if full <= seq.num_hashed_blocks:
            return
        self._hash_blocks(seq, full * self.page_size)
        for i in range(seq.num_hashed_blocks, full):
            h, block = seq.block_hashes[i], seq.block_table[i]
            if h not in self.cached:
                self.cached[h] = block
                self.block_hash[block] = h
        seq.num_hashed_blocks = full

    # -- allocation ----------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make seq's block table cover its computed tokens plus `num_new_tokens`; False if out of pages."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > len(self.free):
            return False
        for _ in range(need):
            block, _ = self.free.popitem(last=False)
            old = self.block_hash[block]
            if old is not None:  # evict its cached content
                if self.cached.get(old) == block:
                    del self.cached[old]
                self.block_hash[block] = None
            self.ref_counts[block] = 1
            seq.block_table.append(block)
        return True

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Free seq's pages past the first `num_tokens` tokens: the pages a speculative verify pass
        took for draft tokens that were rejected. They were allocated in that step, so they are
        unshared and unpublished; they go to the front of the free list."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
                if self.block_hash[block] is None:
                    self.free.move_to_end(block, last=False)

    def release(self, seq: Sequence) -> None:
        """Drop seq's pages; the tail goes to the front of the eviction order."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
                if self.block_hash[block] is None:
                    self.free.move_to_end(block, last=False)  # uncached pages are reused first
        seq.block_table = []
        seq.num_hashed_blocks = 0
