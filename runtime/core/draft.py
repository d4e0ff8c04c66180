"""`draft_model` speculation: a second checkpoint with the target's tokenizer proposes the
next tokens greedily, one draft step per token.

The draft's KV cache lives beside the target's with the same block ids: the draft reads and
writes through the target's block tables, so the target's block pool accounts both (a prefix
hit, a preemption, a rolled-back proposal act on both caches at once). To keep the two
caches in step, every target step is also run through the draft (`mirror`: its tokens' KV,
prompt chunks included). Proposals come after the scheduler has placed the step
(`fill`): it allotted each speculating row placeholders and the blocks for them; the draft
then decodes from the row's last token through those positions, and its tokens replace the
placeholders. A greedy draft proposes deterministically, so the verification keeps the
target's distribution exactly (runtime/core/speculative.py).

The engine runs synchronously with a draft (a mirrored row must know its input token on the
host), refuses one whose tokenizer differs from the target's, sliding-window KV layouts on
either side (their block tables differ per layer group), tensor parallelism, and KV
transferred from a prefill replica (runtime/core/disagg.py: the draft never computed it).
Its weights and KV cache come on top of the target's memory (logged at start).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

from runtime.config import EngineConfig
from runtime.core.request import Request

log = logging.getLogger(__name__)


class DraftModel:
    def __init__(self, config: EngineConfig, target_vocab_size: int, target_groups: int, target_tokenizer: Any):
        from runtime.checkpoint.store import load_checkpoint
        from runtime.kv_groups import KVGroups
        from runtime.model.quant import prepare, quantization_of
        from runtime.model.runner import ModelRunner

        import jax.numpy as jnp

        path = Path(config.speculative.model)
        if not (path / "config.json").is_file():
            raise ValueError(f"speculative_config.model: {path} is not a pagedjax checkpoint (no config.json); "
                             "`pagedjax convert` makes one")
        cfg, params, tok = load_checkpoint(path)
        if cfg.vocab_size != target_vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocabulary ({cfg.vocab_size}) is not the "
                             f"target's ({target_vocab_size}); a draft must share the target's tokenizer")
        if tok.tok.get_vocab(with_added_tokens=True) != target_tokenizer.tok.get_vocab(with_added_tokens=True):
            raise ValueError(f"speculative_config.model: the draft's tokenizer ({path}) is not the target's")
        if cfg.max_position_embeddings < config.scheduler.max_model_len:
            raise ValueError(f"speculative_config.model: the draft reaches {cfg.max_position_embeddings} positions, "
                             f"less than max_model_len ({config.scheduler.max_model_len})")
        if config.tensor_parallel_size != 1:
            raise ValueError("speculative_config: a draft model under tensor parallelism is not supported yet")
        if target_groups != 1 or KVGroups.of(cfg, config.cache.kv_groups).num_groups != 1:
            raise ValueError("speculative_config.model: a draft model with sliding-window layers on either side is "
                             "not supported yet (their KV block tables differ per layer group)")
        q = quantization_of(params)
        params = prepare(params, q, cfg, tok, lm_head="head" in params)
        dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[config.dtype]
        self.cfg = cfg
        self.runner = ModelRunner(cfg, params, config.cache, config.scheduler, config.attention_backend, dtype, q,
                                  kernels=config.kernels)
        self.envelope = config.scheduler
        log.info("draft model %s: %d layers, d %d, %s KV beside the target's (%.1f MiB)", path, cfg.num_layers,
                 cfg.hidden_size, config.cache.kv_dtype, self.runner.kv_cache_bytes() / 2**20)

    def warmup(self, progress: bool = True) -> float:
        return self.runner.warmup(progress)

    def mirror(self, seqs: list, num_seqs: int, num_tokens: int) -> None:
        """Run the target's step through the draft: its KV for the same tokens and slots (the
        draft's samples are not read)."""
        self.runner.launch(seqs, num_seqs, num_tokens)

    def fill(self, reqs: Sequence[Request]) -> None:
        """Replace each request's placeholder proposals with the draft's greedy tokens: draft
        step j feeds every row still proposing its token j (the row's last token, then its
        own proposals) at its next position."""
        from runtime.model.batch import ScheduledSeq
        from runtime.model.sampling import SamplingParams, SamplingRow

        greedy = SamplingRow(SamplingParams(temperature=0.0), 0)
        depth = max((len(r.spec_token_ids) for r in reqs), default=0)
        for j in range(depth):
            rows = [r for r in reqs if len(r.spec_token_ids) > j]
            seqs = [ScheduledSeq(token_ids=[r.spec_token_ids[j - 1] if j else r.token_ids[-1]],
                                 start_pos=r.num_computed_tokens + j, block_tables=r.block_tables,
                                 prompt_len=r.num_prompt_tokens, state_row=r.state_row, reset_row=False,
                                 sample=True, sampling_row=greedy) for r in rows]
            S, T = self.envelope.bucket_for(len(seqs), len(seqs))
            out = self.runner.run(seqs, S, T)["token_ids"]
            for r, t in zip(rows, out):
                r.spec_token_ids[j] = int(t)

    def recover(self) -> bool:
        """After a failed step: True when the draft's cache was lost (rebuilt empty)."""
        return self.runner.recover()
