"""The one typed structure that crosses from host to device each step.

`StepInput` holds only arrays (a registered pytree dataclass), padded to a compiled
(num_seqs, num_tokens) bucket; `build_step_input` fills it from the scheduler's plan
with numpy on the host from the scheduler's rows (ScheduledSeq; runtime/core/request.py
step_row makes one from a request).

KV groups (runtime/kv_groups.py): block tables and slot mappings come one per group,
[G, S, MB] and [G, T] (G = 1 for a model without sliding layers); a layer reads its group's.
A sliding group's released entries (NULL_BLOCK, -1 on the host) become block 0 here: those
positions lie outside the window, so the attention masks whatever block 0 holds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import numpy as np

from runtime.model.kv_pages import SharedPrefix
from runtime.model.sampling import SamplingInputs

# structured outputs that may speculate in one step (their per-position masks ship in a fixed array)
GUIDED_SPEC_ROWS = 2

# penalty-state kinds for input tokens
TOKEN_PAD, TOKEN_PROMPT, TOKEN_OUTPUT = 0, 1, 2


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SpecInput:
    """Speculative decoding's verification (runtime/core/speculative.py). K is the configured
    number of proposals (0: speculation off, every array empty); a step samples after P
    positions, P = min(T, S * (K + 1)): each row's last token and each of its proposals."""

    draft_ids: jax.Array    # [S, K] i32 proposals per row; -1 = none
    slot_token: jax.Array   # [P] i32 index in [T] of the token each verify slot samples after
    slot_row: jax.Array     # [P] i32 the slot's sequence
    slot_offset: jax.Array  # [P] i32 the slot's place in its row's run (added to the sampling step)
    row_slots: jax.Array    # [S, K+1] i32 the slot of row i's j-th position (0 past its proposals)
    masks: jax.Array        # [GUIDED_SPEC_ROWS * K, W] i32 structured outputs' masks of proposal positions
    slot_mask: jax.Array    # [P] i32 the slot's row in `masks`; -1 = its sequence's token_mask row


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepInput:
    token_ids: jax.Array        # [T] int32 flattened tokens of all scheduled sequences, padded
    token_from_state: jax.Array # [T] bool  the token is the row's last sampled one, still on device
    positions: jax.Array        # [T] int32 absolute position of each token
    slot_mapping: jax.Array     # [G, T] int32 KV slot per group (block * block_size + offset); -1 = padding
    token_kind: jax.Array       # [T] int32 TOKEN_PAD | TOKEN_PROMPT | TOKEN_OUTPUT (penalty state)
    token_row: jax.Array        # [T] int32 penalty-state row of the token's sequence
    query_start_loc: jax.Array  # [S+1] int32 cumulative token offsets per sequence
    kv_lens: jax.Array          # [S] int32 context length after this step's tokens; 0 = padding
    block_tables: jax.Array     # [G, S, MB] int32 block ids per group and sequence (0-padded)
    num_seqs: jax.Array         # [1] int32 real sequences in this step
    logits_indices: jax.Array   # [S] int32 index in [T] of each sequence's last token
    state_rows: jax.Array       # [S] int32 penalty-state row per sequence (R-1 = scratch row)
    reset_rows: jax.Array       # [S] bool clear that row's penalty state before this step
    sample_mask: jax.Array      # [S] bool the sampled token is kept (chunk reached the end)
    prompt_targets: jax.Array   # [T] int32 the prompt token after this one, for prompt logprobs; -1 = none
    sampling: SamplingInputs    # per-sequence sampling parameters, [S] each
    shared: SharedPrefix        # leading blocks many sequences share in group 0 (cascade attention)
    spec: SpecInput             # speculative decoding's verification (K = 0: off)
    lora_slots: jax.Array       # [T] int32 the token's LoRA adapter slot (runtime/model/lora.py); -1 = none


@dataclass
class ScheduledSeq:
    """Host-side description of one sequence's work this step (from the scheduler)."""

    token_ids: Sequence[int]     # the tokens to compute this step
    start_pos: int               # position of token_ids[0]
    block_tables: Sequence[Sequence[int]]  # the sequence's block table per KV group (-1: released)
    prompt_len: int              # tokens before this index are prompt (for penalty kinds)
    state_row: int
    reset_row: bool
    sample: bool
    sampling_row: object         # runtime.model.sampling row for make_sampling_inputs
    count_from: int = 0          # tokens before this offset are already in the penalty state
    pending_last: bool = False   # the last token is pending: the device reads it from its state row
    prompt_next: Sequence[int] = ()  # prompt logprobs: each token's next prompt token (-1 past the prompt)
    drafts: Sequence[int] = ()   # speculative decoding: the last len(drafts) tokens are proposals to verify
    draft_masks: Any = None      # a structured output's [len(drafts), W] masks of the positions after its first
    lora_slot: int = -1          # the LoRA adapter slot its tokens use (runtime/model/lora.py); -1: the base model


def build_step_input(seqs: Sequence[ScheduledSeq], num_seqs_bucket: int, num_tokens_bucket: int,
                     max_blocks_per_seq: int, block_size: int, scratch_row: int,
                     token_mask: np.ndarray | None = None, num_groups: int = 1, cascade: bool = True,
                     spec_k: int = 0) -> StepInput:
    """Vectorised over tokens: the per-sequence Python work is list building only, so a
    256-sequence decode step costs well under a millisecond on the host. `num_groups`: KV
    groups (every row has that many tables); `cascade`: look for a shared prefix in group 0
    (off when group 0 slides: its released leading entries are not a shared prefix);
    `spec_k`: the proposals a row may carry (speculative decoding; 0: off)."""
    from runtime.model.sampling import make_sampling_inputs

    S, T, n = num_seqs_bucket, num_tokens_bucket, len(seqs)
    lens = np.fromiter((len(sq.token_ids) for sq in seqs), np.int32, n)
    starts = np.fromiter((sq.start_pos for sq in seqs), np.int32, n)
    t = int(lens.sum())
    seq_of_token = np.repeat(np.arange(n, dtype=np.int32), lens)
    qsl = np.zeros(S + 1, np.int32)
    np.cumsum(lens, out=qsl[1:n + 1])
    qsl[n + 1:] = t
    offset = np.arange(t, dtype=np.int32) - qsl[seq_of_token]  # index within its sequence's chunk
    pos = starts[seq_of_token] + offset

    all_tables = np.zeros((num_groups, S, max_blocks_per_seq), np.int32)
    nblocks = [_fill_table(all_tables[g], [sq.block_tables[g] for sq in seqs]) for g in range(num_groups)][0]
    tables = all_tables[0]

    token_ids = np.zeros(T, np.int32)
    token_ids[:t] = np.fromiter((x for sq in seqs for x in sq.token_ids), np.int32, t)
    from_state = np.zeros(T, bool)
    pending = np.fromiter((sq.pending_last for sq in seqs), bool, n)
    if pending.any():
        from_state[qsl[1:n + 1][pending] - 1] = True
    positions = np.zeros(T, np.int32)
    positions[:t] = pos
    slots = np.full((num_groups, T), -1, np.int32)
    slots[:, :t] = all_tables[:, seq_of_token, pos // block_size] * block_size + pos % block_size
    prompt_len = np.fromiter((sq.prompt_len for sq in seqs), np.int32, n)[seq_of_token]
    count_from = np.fromiter((sq.count_from for sq in seqs), np.int32, n)[seq_of_token]
    kind = np.zeros(T, np.int32)
    kind[:t] = np.where(offset < count_from, TOKEN_PAD, np.where(pos < prompt_len, TOKEN_PROMPT, TOKEN_OUTPUT))
    state_rows = np.full(S, scratch_row, np.int32)
    state_rows[:n] = np.fromiter((sq.state_row for sq in seqs), np.int32, n)
    token_row = np.full(T, scratch_row, np.int32)
    token_row[:t] = state_rows[seq_of_token]
    kv_lens = np.zeros(S, np.int32)
    kv_lens[:n] = starts + lens
    logits_idx = np.zeros(S, np.int32)
    logits_idx[:n] = qsl[1:n + 1] - 1
    reset = np.zeros(S, bool)
    reset[:n] = np.fromiter((sq.reset_row for sq in seqs), bool, n)
    sample_mask = np.zeros(S, bool)
    sample_mask[:n] = np.fromiter((sq.sample for sq in seqs), bool, n)
    targets = np.full(T, -1, np.int32)
    for i, sq in enumerate(seqs):
        if sq.prompt_next:
            targets[qsl[i]:qsl[i] + len(sq.prompt_next)] = sq.prompt_next
    sampling = make_sampling_inputs([sq.sampling_row for sq in seqs], S, token_mask)
    shared = (choose_shared_prefix(tables, nblocks, kv_lens, n, block_size) if cascade
              else SharedPrefix(np.zeros(max_blocks_per_seq, np.int32), np.zeros(1, np.int32), np.zeros(S, np.int32),
                                tables))
    spec = build_spec_input(seqs, S, T, spec_k, qsl, token_mask.shape[1] if token_mask is not None else 0)
    lora_slots = np.full(T, -1, np.int32)
    lora_slots[:t] = np.fromiter((sq.lora_slot for sq in seqs), np.int32, n)[seq_of_token]
    return StepInput(token_ids, from_state, positions, slots, kind, token_row, qsl, kv_lens, all_tables,
                     np.array([n], np.int32), logits_idx, state_rows, reset, sample_mask, targets, sampling, shared,
                     spec, lora_slots)


_ALL_ALLOWED: dict[tuple[int, int], np.ndarray] = {}


def build_spec_input(seqs: Sequence[ScheduledSeq], S: int, T: int, K: int, qsl: np.ndarray, W: int = 0) -> SpecInput:
    """Verify slots: row i's last token and its d_i proposals (the last d_i + 1 tokens of its
    chunk) take slots in row order; a row without proposals takes one, at its last token. A
    structured output's proposal positions (the engine lets at most GUIDED_SPEC_ROWS of them
    speculate per step) read their masks from `masks`; every other slot its row's."""
    n = len(seqs)
    P = min(T, S * (K + 1)) if K else 0
    drafts = np.full((S, K), -1, np.int32)
    slot_token, slot_row, slot_offset = np.zeros(P, np.int32), np.zeros(P, np.int32), np.zeros(P, np.int32)
    row_slots = np.zeros((S, K + 1), np.int32)
    slot_mask = np.full(P, -1, np.int32)
    key = (GUIDED_SPEC_ROWS * K, W)
    if key not in _ALL_ALLOWED:
        _ALL_ALLOWED[key] = np.full(key, -1, np.int32)
        _ALL_ALLOWED[key].flags.writeable = False
    masks = _ALL_ALLOWED[key]
    if K and n:
        d = np.fromiter((len(sq.drafts) for sq in seqs), np.int32, n)
        if d.any():
            for i in np.flatnonzero(d):
                drafts[i, :d[i]] = seqs[i].drafts
        cnt = d + 1
        first = np.cumsum(cnt) - cnt
        total = int(cnt.sum())
        rows = np.repeat(np.arange(n, dtype=np.int32), cnt)
        offset = np.arange(total, dtype=np.int32) - first[rows]
        slot_row[:total], slot_offset[:total] = rows, offset
        slot_token[:total] = (qsl[1:n + 1] - 1 - d)[rows] + offset
        row_slots[rows, offset] = np.arange(total, dtype=np.int32)
        guided = [i for i in np.flatnonzero(d) if seqs[i].draft_masks is not None]
        if len(guided) > GUIDED_SPEC_ROWS:  # (the engine lets no more speculate: runtime/core/engine.py _propose)
            raise ValueError(f"{len(guided)} structured outputs carry proposals; at most {GUIDED_SPEC_ROWS} may")
        if guided:
            masks = masks.copy()
            for g, i in enumerate(guided[:GUIDED_SPEC_ROWS]):
                m = seqs[i].draft_masks
                masks[g * K:g * K + len(m)] = m
                slot_mask[first[i] + 1:first[i] + 1 + len(m)] = g * K + np.arange(len(m), dtype=np.int32)
    return SpecInput(drafts, slot_token, slot_row, slot_offset, row_slots, masks, slot_mask)


def _fill_table(out: np.ndarray, tables: Sequence[Sequence[int]]) -> np.ndarray:
    """Rows of `out` [S, MB] <- the sequences' tables (released -1 entries as block 0);
    returns each table's length."""
    n = len(tables)
    nblocks = np.fromiter((len(t) for t in tables), np.int32, n)
    flat_blocks = np.fromiter((b for t in tables for b in t), np.int32, int(nblocks.sum()))
    rows = np.repeat(np.arange(n), nblocks)
    cols = np.arange(len(flat_blocks)) - np.repeat(np.cumsum(nblocks) - nblocks, nblocks)
    out[rows, cols] = np.maximum(flat_blocks, 0)
    return nblocks


def choose_shared_prefix(tables: np.ndarray, nblocks: np.ndarray, kv_lens: np.ndarray, n: int,
                         block_size: int) -> SharedPrefix:
    """The run of leading blocks held by the most sequences (prefix-cache hits on a common
    system prompt put the very same block ids there). Empty unless at least two share one."""
    S, mb = tables.shape
    blocks = np.zeros(mb, np.int32)
    start = np.zeros(S, np.int32)
    suffix = tables
    have = np.flatnonzero(nblocks[:n] > 0)
    if len(have) >= 2:
        firsts, counts = np.unique(tables[have, 0], return_counts=True)
        if counts.max() >= 2:
            members = have[tables[have, 0] == firsts[counts.argmax()]]
            limit = int(min(nblocks[members].min(), (kv_lens[members] // block_size).min()))
            same = (tables[members, :limit] == tables[members[0], :limit]).all(axis=0)
            length = int(np.cumprod(same).sum())
            if length:
                blocks[:length] = tables[members[0], :length]
                start[members] = length * block_size
                suffix = tables.copy()
                suffix[members] = np.concatenate(
                    [tables[members, length:], np.zeros((len(members), length), np.int32)], axis=1)
                return SharedPrefix(blocks, np.array([length * block_size], np.int32), start, suffix)
    return SharedPrefix(blocks, np.zeros(1, np.int32), start, suffix)


def describe(inp: StepInput) -> dict[str, tuple[int, ...]]:
    return {f.name: np.shape(getattr(inp, f.name)) for f in dataclasses.fields(inp) if f.name != "sampling"}
