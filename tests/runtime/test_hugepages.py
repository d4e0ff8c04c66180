"""runtime/kernels/cpu/hugepages.py: the weights' huge-page arena and the KV cache's collapse."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.kernels.cpu import hugepages


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "none"
    return text[text.index("[") + 1:text.index("]")]


def test_placed_weights_keep_their_values_and_alias_one_aligned_arena():
    rng = np.random.default_rng(0)
    tree = {"a": jnp.asarray(rng.standard_normal((300, 200)).astype(np.float32)),
            "b": (jnp.asarray(rng.standard_normal((64, 1000)).astype(np.float32)),),
            "small": jnp.ones((16,), jnp.float32), "i8": jnp.asarray(rng.integers(-9, 9, (512, 300)), jnp.int8)}
    placed = hugepages.place_weights(tree)
    for k in ("a", "small", "i8"):
        np.testing.assert_array_equal(np.asarray(placed[k]), np.asarray(tree[k]))
        assert placed[k].dtype == tree[k].dtype and placed[k].shape == tree[k].shape
    np.testing.assert_array_equal(np.asarray(placed["b"][0]), np.asarray(tree["b"][0]))
    assert placed["small"] is tree["small"]  # (under MIN_BYTES: left where it was)
    big = [placed["a"], placed["b"][0], placed["i8"]]
    ptrs = sorted(x.unsafe_buffer_pointer() for x in big)
    assert all(p % hugepages.ALIGN == 0 for p in ptrs)  # in the arena, each at a 4 KB boundary
    assert ptrs[-1] - ptrs[0] < 2 * sum(x.nbytes for x in big)  # one arena, not three allocations
    # a jitted product reads them in place and gets the same numbers
    f = jax.jit(lambda t: t["a"].sum() + t["b"][0].sum())
    np.testing.assert_allclose(float(f(placed)), float(f(tree)), rtol=1e-6)


def test_disabled_by_the_environment(monkeypatch):
    monkeypatch.setenv("PAGEDJAX_HUGEPAGES", "0")
    tree = {"a": jnp.ones((512, 512), jnp.float32)}
    assert hugepages.place_weights(tree)["a"] is tree["a"]
    assert hugepages.collapse(tree) == 0


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off here")
def test_arena_and_cache_are_advised_for_huge_pages():
    """What the module does where the kernel offers huge pages: the weights' arena and the
    whole 2 MB pages of an XLA buffer (the KV cache) are advised MADV_HUGEPAGE. (Whether the
    kernel then finds free 2 MB pages depends on the machine's memory, so that is not
    asserted; `pagedjax bench offline --part decode` measures what it buys.)"""
    placed = hugepages.place_weights({"w": jnp.ones((64 << 20) // 4, jnp.float32)})
    assert hugepages.advised(placed["w"].unsafe_buffer_pointer())
    cache = jnp.zeros((32 << 20) // 4, jnp.float32)
    assert hugepages.collapse(cache) >= (30 << 20)  # all but the unaligned ends of 32 MB
    ptr = cache.unsafe_buffer_pointer()
    assert hugepages.advised(-(-ptr // hugepages.HUGE) * hugepages.HUGE)
    np.testing.assert_array_equal(np.asarray(placed["w"][:4]), np.ones(4, np.float32))
    assert float(cache.sum()) == 0.0  # the collapse kept the contents
    assert not hugepages.advised(0)  # (no mapping there)
