"""KV groups: how the layers share the one pool of KV pages (vLLM's hybrid KV cache manager,
adapted), and the three rules that follow from a group's attention window.

A model whose layers all see the whole context is one group of all L layers: a page holds
BS tokens of every layer, a request has one block table -- the layout pagedjax always had.
A model with sliding-window layers (ModelConfig.layer_windows) splits its layers into groups
of equal size g = gcd of the layer counts of each window (Gemma 3 270M: 3 full and 15
sliding layers -> g = 3, one full group and five sliding groups). A page is then BS tokens
x g layers, the cache arrays are [g * NB, BS, Hkv, D], and layer l (group G(l), index i(l)
within it) reads rows i(l) * NB + table_G(l)[b]. Each request holds one block table per
group: a full group's grows with the sequence; a sliding group's keeps only the blocks its
window can still see, its earlier entries released (NULL_BLOCK, which the device reads as
block 0: a position outside the window is masked and never reaches a result).

Why groups of equal size rather than one pool per kind: one pool, one free queue, one
prefix-cache eviction order -- memory moves between sequences of either kind freely.

The rules, each written once here:
  skipped_blocks   what a sliding group may free: blocks wholly before the next step's
                   first query position - window + 1
  live_blocks      what a group holds to compute tokens [start, end)
  hit_window       what a prefix hit of n blocks needs of a group (all n for a full group;
                   the blocks covering the window before the hit point for a sliding one)
  max_live_blocks  the most a group ever holds over a request's life (reserve mode, never_fits)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.config import ModelConfig

NULL_BLOCK = -1  # a released table entry of a sliding group (the device reads block 0 there)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVGroups:
    """The layer -> (group, index) map and each group's window (0 = full attention). Frozen
    and hashable: the jitted step takes it as a static argument."""

    group_size: int                # g: layers per group (a page = BS tokens x g layers)
    windows: tuple[int, ...]       # per group: keys a query sees, 0 = every key
    layer_group: tuple[int, ...]   # per layer: its group
    layer_index: tuple[int, ...]   # per layer: its index within the group (row base i * NB)

    @classmethod
    def of(cls, model: "ModelConfig", split: bool = True) -> "KVGroups":
        """The groups of `model`. Full groups come first (group 0 is then a full group when
        the model has any: cascade attention and residency events follow group 0), layers
        in order within each window. `split=False`: one group of all layers keeping every
        block (CacheConfig.kv_groups off; the keep-everything reference)."""
        windows = model.layer_windows()
        L = len(windows)
        if not split or len(set(windows)) == 1:
            w = windows[0] if split else 0
            return cls(L, (w,), (0,) * L, tuple(range(L)))
        kinds = sorted(set(windows))  # 0 (full) first
        members = {w: [i for i, x in enumerate(windows) if x == w] for w in kinds}
        g = math.gcd(*(len(m) for m in members.values()))
        group_of, index_of = [0] * L, [0] * L
        group_windows: list[int] = []
        for w in kinds:
            for start in range(0, len(members[w]), g):
                for i, layer in enumerate(members[w][start:start + g]):
                    group_of[layer], index_of[layer] = len(group_windows), i
                group_windows.append(w)
        return cls(g, tuple(group_windows), tuple(group_of), tuple(index_of))

    @classmethod
    def single(cls, num_layers: int = 1) -> "KVGroups":
        """One group of full attention: every block kept (a model without sliding layers)."""
        return cls(num_layers, (0,), (0,) * num_layers, tuple(range(num_layers)))

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    @property
    def frees_blocks(self) -> bool:
        """Some group releases blocks that slid out of its window."""
        return any(self.windows)

    # --- the rules ----------------------------------------------------------------------
    def skipped_blocks(self, group: int, first_query: int, block_size: int) -> int:
        """Leading blocks of `group` that no query at or after `first_query` can see: the
        ones wholly before first_query - window + 1 (a query at p sees keys p-window+1..p).
        0 for a full group. These a sliding group releases."""
        w = self.windows[group]
        return max(0, (first_query - w + 1) // block_size) if w else 0

    def live_blocks(self, group: int, start: int, end: int, block_size: int) -> int:
        """Blocks `group` holds to compute tokens [start, end): all of them up to `end`,
        less the ones skipped before the first query `start`."""
        return _cdiv(end, block_size) - self.skipped_blocks(group, start, block_size)

    def hit_window(self, group: int, n: int, block_size: int) -> range:
        """Block indices of `group` a prefix hit of `n` blocks must find cached: the next
        query (at n * block_size) reads back to the window's start, nothing earlier."""
        return range(self.skipped_blocks(group, n * block_size, block_size), n)

    def max_live_blocks(self, group: int, total_tokens: int, chunk: int, block_size: int) -> int:
        """The most blocks `group` holds at once over a request of `total_tokens` computed in
        steps of at most `chunk` tokens: a full group holds them all at the end; a sliding
        one at most the window before a chunk plus the chunk (and a block of misalignment)."""
        whole = _cdiv(total_tokens, block_size)
        w = self.windows[group]
        return whole if not w else min(whole, _cdiv(w - 1 + max(chunk, 1), block_size) + 1)

    def pages_for(self, total_tokens: int, chunk: int, block_size: int) -> int:
        """Pages of the pool a request of `total_tokens` may hold at once (every group)."""
        return sum(self.max_live_blocks(g, total_tokens, chunk, block_size) for g in range(self.num_groups))

    def steady_pages(self, tokens: int, block_size: int) -> int:
        """Pages a sequence of `tokens` holds between decode steps (its next query at
        `tokens`): what its KV costs once prefilled, the planner's per-sequence figure."""
        return sum(self.live_blocks(g, tokens, tokens, block_size) for g in range(self.num_groups))

    def describe(self) -> str:
        kinds = ", ".join(f"{self.windows.count(w)} {'full' if w == 0 else f'sliding {w}'}"
                          for w in sorted(set(self.windows)))
        return f"{self.num_groups} KV group(s) of {self.group_size} layers ({kinds})"
