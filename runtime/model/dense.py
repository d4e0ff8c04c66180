"""Dense (non-paged, no KV cache) greedy decoding: the baseline the paged engine is
checked against. Recomputes the whole prefix each token; padded to a few lengths so it
compiles a handful of programs, not one per token."""

from __future__ import annotations

from functools import partial
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from runtime.config import ModelConfig
from runtime.model.families import dense_logits
from runtime.model.families.llama import Params


@partial(jax.jit, static_argnums=(0,))
def _next_logits(cfg: ModelConfig, params: Params, padded: jax.Array, length: jax.Array) -> jax.Array:
    # Causal attention makes rows < length independent of the padding after them.
    logits = dense_logits(cfg, params, padded)
    return logits[length - 1]


def dense_greedy(cfg: ModelConfig, params: Params, prompt: Sequence[int], max_tokens: int,
                 stop_ids: Sequence[int] = ()) -> Iterator[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        size = max(64, 1 << (len(ids) - 1).bit_length())
        padded = np.zeros(size, np.int32)
        padded[: len(ids)] = ids
        tok = int(jnp.argmax(_next_logits(cfg, params, jnp.asarray(padded), jnp.int32(len(ids)))))
        ids.append(tok)
        yield tok
        if tok in stop_ids:
            return
