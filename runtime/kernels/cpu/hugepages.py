"""The CPU backend's weights on 2 MB pages (Linux transparent huge pages).

Why: a decode step streams every weight from memory, and on 4 KB pages the reads pay a TLB
miss every 4 KB and restart the hardware prefetchers at each page boundary. On the 2-core
AMX Xeon here two threads read a 512 MB array at 22 GB/s on 4 KB pages and at 28 GB/s on
2 MB pages (np.max, 5 passes each, alternating). XLA:CPU allocates each weight with malloc,
on 4 KB pages (transparent huge pages are usually `madvise`-only), and a buffer of 1-7 MB
(most of SmolLM2's per-layer products) holds no 2 MB-aligned range that the kernel could
collapse later. So the weights are copied once, at engine start, into one 2 MB-aligned
host arena advised MADV_HUGEPAGE before it is touched, and handed to XLA without a copy
(`jax.device_put` of a 64-byte-aligned host array aliases it on the CPU backend).

Nothing changes where huge pages are unavailable (another OS, THP `never`, no free 2 MB
pages): the arena is ordinary memory then. PAGEDJAX_HUGEPAGES=0 keeps XLA's own buffers,
for an A/B.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from typing import Any

import jax
import numpy as np

from runtime.config import KernelConfig

log = logging.getLogger(__name__)

HUGE = 2 << 20
ALIGN = 4096           # each array's start in the arena (XLA needs 64 bytes)
MIN_BYTES = 64 << 10   # smaller arrays stay where they are (a norm weight, a bias)
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25  # Linux 6.1+: back an advised range with huge pages now, not when khugepaged gets there


def enabled(kernels: KernelConfig | None = None) -> bool:
    return (sys.platform.startswith("linux") and jax.default_backend() == "cpu"
            and (kernels or KernelConfig().with_env()).huge_pages)


def _madvise(addr: int, length: int, advice: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), ctypes.c_int(advice)) == 0
    except (OSError, AttributeError):
        return False


def _arena(nbytes: int) -> np.ndarray:
    """An uninitialized, 2 MB-aligned byte array of `nbytes` (rounded up to 2 MB), advised for
    huge pages before any page of it is touched."""
    size = -(-nbytes // HUGE) * HUGE
    raw = np.empty(size + HUGE, np.uint8)
    off = (-raw.ctypes.data) % HUGE
    arena = raw[off:off + size]
    _madvise(arena.ctypes.data, size, MADV_HUGEPAGE)
    return arena


def place_weights(tree: Any, kernels: KernelConfig | None = None) -> Any:
    """`tree` with its CPU arrays of MIN_BYTES or more moved into one huge-page arena (the
    same values, now aliasing host memory XLA reads in place); unchanged when disabled."""
    if not enabled(kernels):
        return tree
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    big = [i for i, a in enumerate(leaves) if isinstance(a, (jax.Array, np.ndarray)) and a.nbytes >= MIN_BYTES
           and (not isinstance(a, jax.Array) or a.is_fully_addressable and len(a.devices()) == 1)]
    if not big:
        return tree
    offsets, total = [], 0
    for i in big:
        offsets.append(total)
        total += -(-leaves[i].nbytes // ALIGN) * ALIGN
    arena = _arena(total)
    aliased = 0
    for i, off in zip(big, offsets):
        a = leaves[i]
        host = arena[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
        host[...] = np.asarray(a)
        placed = jax.device_put(host)
        aliased += placed.unsafe_buffer_pointer() == host.ctypes.data
        leaves[i] = placed
    # (best effort, as for the KV cache: pages that were touched before the advice, say a
    # reused allocation, stay 4 KB until collapsed)
    _madvise(arena.ctypes.data, arena.nbytes, MADV_COLLAPSE)
    log.info("weights: %d arrays, %.0f MB in a huge-page arena (%d aliased in place)", len(big), total / 1e6, aliased)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def collapse(tree: Any, kernels: KernelConfig | None = None) -> int:
    """Back the whole 2 MB pages inside each CPU array of `tree` with huge pages, in place
    (the KV cache: XLA allocates it, and donation keeps it at the same address step after
    step). Returns the bytes advised; 0 when disabled or where madvise refuses."""
    if not enabled(kernels):
        return 0
    done = 0
    for a in jax.tree_util.tree_leaves(tree):
        if not isinstance(a, jax.Array) or a.nbytes < HUGE or len(a.devices()) != 1:
            continue
        ptr = a.unsafe_buffer_pointer()
        lo, hi = -(-ptr // HUGE) * HUGE, (ptr + a.nbytes) // HUGE * HUGE
        if hi > lo and _madvise(lo, hi - lo, MADV_HUGEPAGE):
            _madvise(lo, hi - lo, MADV_COLLAPSE)  # (best effort: no free huge pages leaves it as it was)
            done += hi - lo
    return done


def advised(addr: int) -> bool:
    """Whether the mapping holding `addr` is advised MADV_HUGEPAGE ("hg" in its VmFlags)."""
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and ":" not in head:
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= addr < hi
                elif inside and line.startswith("VmFlags:"):
                    return "hg" in line.split()[1:]
    except OSError:
        pass
    return False
