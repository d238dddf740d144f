"""Paged KV cache bookkeeping with prefix caching (torch-free).

Blocks hold `block_size` tokens. A full block is keyed by a chain hash of (previous block's hash,
the sequence's cache salt, the block's tokens); the salt names the adapter set with scales and
digests, so identical prompts share blocks only under identical adapters (an adapter changes the
keys and values). Freed blocks that carry a hash stay reusable until their space is needed (LRU).
"""

from __future__ import annotations

from collections import OrderedDict

from lorafleet.worker.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, int] = {}  # block -> hash, for blocks registered in the cache
        self._block_of: dict[int, int] = {}  # hash -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks with no user, LRU first
        self.prefix_hits = 0  # tokens served from the prefix cache
        self.prefix_queries = 0  # prompt tokens looked up

    # -- capacity ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs to hold `num_tokens` in total."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    # -- prefix cache --------------------------------------------------------------------------
    def _chain(self, seq: Sequence, upto_blocks: int) -> list[int]:
        tokens, bs = seq.tokens, self.block_size
        hashes = list(seq.block_hashes[:upto_blocks])
        prev = hashes[-1] if hashes else hash(("root", seq.cache_salt))
        for i in range(len(hashes), upto_blocks):
            prev = hash((prev, tuple(tokens[i * bs : (i + 1) * bs])))
            hashes.append(prev)
        return hashes

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks to a sequence with no blocks yet; returns the tokens reused.

        The last token is always recomputed so the step has logits to sample from.
        """
        if not self.enable_prefix_caching or seq.block_table or seq.scores_prompt:
            return 0  # prompt logprobs need every prompt position's logits: nothing skipped
        candidates = (len(seq) - 1) // self.block_size
        hashes = self._chain(seq, candidates)
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            if self._refs[block] == 0:
                self._evictable.pop(block, None)
            self._refs[block] += 1
            seq.block_table.append(block)
        matched = len(seq.block_table)
        seq.block_hashes = hashes[:matched]
        seq.num_hashed_blocks = matched
        seq.num_computed = matched * self.block_size
        return seq.num_computed

    def admission_cost(self, seq: Sequence, budget: int) -> int:
        """Free blocks admitting `seq` with a token budget would use up: a read-only mirror of
        `match_prefix` (cached blocks nobody holds leave the free pool) and `allocate`."""
        matched = evictable = 0
        if self.enable_prefix_caching and not seq.block_table and not seq.scores_prompt:
            for h in self._chain(seq, (len(seq) - 1) // self.block_size):
                block = self._block_of.get(h)
                if block is None:
                    break
                matched += 1
                evictable += self._refs[block] == 0
        computed = matched * self.block_size if matched else seq.num_computed
        total = -(-(computed + min(len(seq) - computed, budget)) // self.block_size)
        return total - max(matched, len(seq.block_table)) + evictable

    def record_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        """Count a prefix lookup once its sequence was admitted (an undone admission does not count)."""
        self.prefix_queries += queried_tokens
        self.prefix_hits += hit_tokens

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's newly filled blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed // self.block_size
        if full <= seq.num_hashed_blocks:
            return
        hashes = self._chain(seq, full)
        for i in range(seq.num_hashed_blocks, full):
            h, block = hashes[i], seq.block_table[i]
            if h not in self._block_of and block not in self._hash_of:
                self._block_of[h] = block
                self._hash_of[block] = h
        seq.block_hashes = hashes
        seq.num_hashed_blocks = full

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (vLLM's reset_prefix_cache); only while no sequence holds one."""
        if any(self._refs):
            raise RuntimeError("cannot reset the prefix cache while sequences hold blocks")
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._hash_of.clear()
        self._block_of.clear()
        self._evictable.clear()
        self.prefix_hits = self.prefix_queries = 0

    # -- allocation ----------------------------------------------------------------------------
    def _take_block(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._evictable.popitem(last=False)  # least recently freed cached block
        del self._block_of[self._hash_of.pop(block)]
        return block

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq` to hold `num_tokens` tokens; False (and nothing changed) if blocks run out."""
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free:
            return False
        for _ in range(need):
            block = self._take_block()
            self._refs[block] = 1
            seq.block_table.append(block)
        return True

    def free(self, seq: Sequence) -> None:
        # Release in reverse so a sequence's tail is evicted before its (more shareable) head.
        for block in reversed(seq.block_table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_hashed_blocks = 0
