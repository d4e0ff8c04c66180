"""Disaggregated prefill/decode at the engine level: reserve, then transfer.

The order is what makes it safe (DESIGN: never prefill into nowhere):
  1. the decode engine `reserve`s the request's blocks: the full prompt blocks its own
     prefix cache already holds are pinned (skip_blocks), blocks for the rest are
     allocated, plus the decode growth its admission mode needs -- or NoRoom is raised
     and nothing changed;
  2. the prefill engine runs the prompt as an ordinary request with max_tokens=1 (its
     full blocks land in its prefix cache) and `export_kv` copies the missing blocks out;
  3. a KVConnector moves the record; the decode engine `import_kv`s it into the pinned
     blocks and registers each in its own prefix cache under its hash;
  4. the request is added to the decode engine with the reservation: the scheduler's
     prefix lookup hits the imported blocks, so only the prompt's tail (at least its last
     token) is computed there and the first token is sampled there with (seed, step 0) --
     the same tokens as colocated serving. The pins are released at the step boundary
     that admits the request, after its hits were taken (runtime/core/scheduler.py `_admit`).
On failure or timeout `release` returns every pinned block; the sender `drop`s its buffer.

Only full blocks before the prompt's last token travel (runtime/core/request.py `cacheable_blocks`):
the scheduler always computes the last token for its logits, so a block holding it would
be computed again anyway. Requests whose prompt must be computed in full on the decode
side (penalties, prompt logprobs: runtime/core/request.py `uses_prefix_cache`) transfer nothing.
The room check is the scheduler's own admission rule (runtime/core/capacity.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from runtime.core import capacity
from runtime.core.block_pool import BlockHash, hash_prompt_blocks
from runtime.core.kv_transfer import KVBlocks, KVConnector, TransferError
from runtime.model.runner import read_blocks, write_blocks
from runtime.core.request import Request, cacheable_blocks, uses_prefix_cache
from runtime.model.sampling import SamplingParams
from runtime.core.scheduler import Overloaded

if TYPE_CHECKING:
    from runtime.core.engine import LLMEngine


class NoRoom(Overloaded):
    """The decode engine cannot reserve the request's blocks now; nothing was changed.
    The request waits or goes to another decode replica."""

    def __init__(self, message: str):
        super().__init__("kv_reservation", message)


class KVMissing(TransferError):
    """The prefill engine no longer holds a block to export (evicted)."""


@dataclass(eq=False)
class Reservation:
    engine_id: int
    prompt_ids: list[int]
    cache_salt: str | None
    block_hashes: list[BlockHash]   # hashes of the prompt blocks that may be served from cache
    skip_blocks: int                # leading ones the decode cache already held
    num_transfer: int               # blocks to receive: block_hashes[skip:skip + num_transfer]
    block_ids: list[int] = field(default_factory=list)  # pinned: skipped, transfer targets, growth
    state: str = "reserved"         # reserved -> imported -> admitted | released

    @property
    def target_blocks(self) -> list[int]:
        return self.block_ids[self.skip_blocks:self.skip_blocks + self.num_transfer]


def _usable_hashes(engine: "LLMEngine", prompt_ids: Sequence[int], cache_salt: str | None) -> list[BlockHash]:
    bs = engine.pool.block_size
    hashes = hash_prompt_blocks(list(prompt_ids), bs, (cache_salt,) if cache_salt else ())
    return hashes[:cacheable_blocks(len(prompt_ids), bs)]


def reserve(engine: "LLMEngine", prompt_ids: Sequence[int], params: SamplingParams,
            cache_salt: str | None = None) -> Reservation:
    pool, sched, policy = engine.pool, engine.scheduler, engine.policy
    if not pool.enable_prefix_cache:
        raise ValueError("disaggregated decode needs the prefix cache (imported blocks are served through it)")
    if getattr(engine, "draft", None) is not None:
        raise ValueError("disaggregated decode with a draft model: transferred KV has no draft KV beside it "
                         "(use method ngram or suffix on a decode pool)")
    prompt = [int(t) for t in prompt_ids]
    total = len(prompt) + params.max_tokens
    if not prompt or capacity.never_fits(total, engine.envelope.max_model_len, pool):
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) does not fit "
                         f"this engine (max_model_len {engine.envelope.max_model_len})")
    with engine.lock:
        hashes = _usable_hashes(engine, prompt, cache_salt) if uses_prefix_cache(params) else []
        hits = pool.lookup_prefix(hashes, prompt)
        # The scheduler's admission rule on the same state, so a reservation that succeeds is admitted.
        promised = capacity.promised_growth(sched.running, policy.admission_mode, pool.block_size)
        room = capacity.headroom(pool, policy, num_tokens=len(prompt), max_total_tokens=total, hits=hits,
                                 promised=promised, engine_busy=bool(sched.running))
        if not room.fits:
            engine.metrics.kv_reservations.labels("no_room").inc()
            raise NoRoom(f"cannot reserve {room.need} KV blocks: {room.available} available, "
                         f"{room.kept_free} kept free (watermark)")
        pool.touch(hits)
        res = Reservation(id(engine), prompt, cache_salt, hashes, len(hits), len(hashes) - len(hits),
                          list(hits) + pool.allocate(room.need))
        engine.metrics.kv_reservations.labels("ok").inc()
        return res


def release(engine: "LLMEngine", res: Reservation) -> None:
    """Return every pinned block (a failed or abandoned transfer); idempotent. Blocks
    already imported stay in the prefix cache as ordinary cached blocks."""
    with engine.lock:
        if res.state in ("reserved", "imported"):
            engine.pool.free(res.block_ids)
            res.block_ids = []
            res.state = "released"


def _check(engine: "LLMEngine", res: Reservation, blocks: KVBlocks) -> None:
    c, m = engine.config.cache, engine.config.model
    if res.engine_id != id(engine):
        raise ValueError("reservation: made by another engine")
    if res.state != "reserved":
        raise ValueError(f"reservation: is {res.state}, not reserved")
    if (blocks.block_size, blocks.kv_dtype, blocks.num_layers) != (c.block_size, c.kv_dtype, m.num_layers):
        raise TransferError(f"KV blocks of block_size {blocks.block_size}, {blocks.kv_dtype}, {blocks.num_layers} "
                            f"layers do not match this engine's {c.block_size}, {c.kv_dtype}, {m.num_layers}")
    want = res.block_hashes[res.skip_blocks:res.skip_blocks + res.num_transfer]
    if blocks.first_block != res.skip_blocks or blocks.block_hashes != want:
        raise TransferError(f"KV blocks {blocks.first_block}..{blocks.first_block + blocks.num_blocks} are not "
                            f"the reserved {res.skip_blocks}..{res.skip_blocks + res.num_transfer} of this prompt")
    import jax

    leaves = jax.tree.leaves(engine.runner.kv)
    if len(blocks.arrays) != len(leaves):
        raise TransferError(f"KV blocks carry {len(blocks.arrays)} arrays, this cache has {len(leaves)}")
    for a, leaf in zip(blocks.arrays, leaves):
        shape = (m.num_layers, res.num_transfer, *leaf.shape[1:])
        if tuple(a.shape) != shape or a.dtype != leaf.dtype:
            raise TransferError(f"KV array {a.shape} {a.dtype} does not match this cache's {shape} {leaf.dtype}")


def import_kv(engine: "LLMEngine", res: Reservation, blocks: KVBlocks) -> None:
    """Validate, write the blocks into the reserved ones and register them in the prefix
    cache. A TransferError leaves the reservation as it was (release or retry)."""
    t0 = time.perf_counter()
    with engine.lock:
        _check(engine, res, blocks)
        targets = res.target_blocks
        if targets:
            write_blocks(engine.runner, targets, blocks.arrays)
        bs = engine.pool.block_size
        for i, block_id in enumerate(targets, res.skip_blocks):
            engine.pool.cache_block(block_id, res.block_hashes[i], res.prompt_ids[i * bs:(i + 1) * bs],
                                    res.block_hashes[i - 1] if i else None)
        res.state = "imported"
    engine.metrics.kv_transfer_bytes.labels("in").inc(blocks.nbytes)
    engine.metrics.kv_transfer_seconds.labels("import").observe(time.perf_counter() - t0)


def export_kv(engine: "LLMEngine", prompt_ids: Sequence[int], skip_blocks: int = 0,
              cache_salt: str | None = None) -> KVBlocks:
    """The KV of the prompt's transferable full blocks from `skip_blocks` on, copied from
    this engine's prefix cache (the prompt must have been prefilled here); KVMissing when
    a block was evicted meanwhile."""
    t0 = time.perf_counter()
    prompt = [int(t) for t in prompt_ids]
    with engine.lock:
        hashes = _usable_hashes(engine, prompt, cache_salt)
        ids = engine.pool.lookup_prefix(hashes, prompt)
        if len(ids) < len(hashes):
            raise KVMissing(f"the prefill engine holds {len(ids)} of the prompt's {len(hashes)} blocks "
                            "(evicted, or never prefilled here)")
        ids = ids[skip_blocks:]
        arrays = read_blocks(engine.runner, ids) if ids else []
    c = engine.config.cache
    blocks = KVBlocks(c.block_size, c.kv_dtype, engine.config.model.num_layers, skip_blocks,
                      hashes[skip_blocks:], prompt[:len(hashes) * c.block_size], arrays)
    engine.metrics.kv_transfer_bytes.labels("out").inc(blocks.nbytes)
    engine.metrics.kv_transfer_seconds.labels("export").observe(time.perf_counter() - t0)
    return blocks


def attach(engine: "LLMEngine", res: Reservation, req: Request) -> list[int]:
    """The pinned blocks a request added with `res` takes over (LLMEngine.add_request)."""
    if res.engine_id != id(engine) or res.state not in ("reserved", "imported"):
        raise ValueError(f"reservation: not usable here (state {res.state})")
    if res.prompt_ids != req.prompt_ids or res.cache_salt != req.cache_salt:
        raise ValueError("reservation: made for another prompt")
    return res.block_ids


def hand_over(res: Reservation) -> None:
    """The request `attach`ed to `res` was queued and holds its blocks now: the reservation
    gives them up (nothing is left to release)."""
    res.block_ids, res.state = [], "admitted"


def _run(engine: "LLMEngine", req: Request) -> None:
    while not req.is_finished:
        engine.step()


def prefill_then_decode(prefill: "LLMEngine", decode: "LLMEngine", connector: KVConnector,
                        prompt_ids: Sequence[int], params: SamplingParams, *, cache_salt: str | None = None,
                        timeout_s: float = 10.0, request_id: str | None = None) -> Request:
    """One request through both engines, synchronously (tests, offline use; a fleet runs
    the same steps across replicas). Raises NoRoom before anything is prefilled, and
    TransferError after one retry of the transfer; either way nothing stays reserved."""
    res = decode.reserve(prompt_ids, params, cache_salt=cache_salt)  # NoRoom: nothing happened anywhere
    try:
        if res.num_transfer:
            pre = prefill.add_request(prompt_ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                                      cache_salt=cache_salt)
            _run(prefill, pre)
            if pre.finish_reason == "error":
                raise TransferError(f"prefill failed for {pre.request_id}")
            blocks = prefill.export_kv(prompt_ids, res.skip_blocks, cache_salt=cache_salt)
            for attempt in (1, 2):
                t0 = time.perf_counter()
                handle = connector.send(request_id or pre.request_id, blocks)
                try:
                    decode.import_kv(res, connector.recv(handle, timeout_s))
                    decode.metrics.kv_transfer_seconds.labels("transfer").observe(time.perf_counter() - t0)
                    break
                except TransferError:
                    decode.metrics.kv_transfer_failures.inc()
                    if attempt == 2:
                        raise
                finally:
                    connector.drop(handle)
        req = decode.add_request(prompt_ids, params, request_id=request_id, cache_salt=cache_salt,
                                 reservation=res)
    except BaseException:
        decode.release(res)
        raise
    _run(decode, req)
    return req


__all__ = ["NoRoom", "KVMissing", "Reservation", "reserve", "release", "import_kv", "export_kv", "attach",
           "hand_over", "prefill_then_decode"]
