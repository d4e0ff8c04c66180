"""The host-RAM KV tier (`--kv-offload-memory SIZE`): full prompt blocks the device pool's
prefix cache evicts go down to host memory instead of vanishing, and a waiting request whose
prompt continues past its device-cached prefix into them gets them copied back into device
blocks, registered in the prefix cache, before the scheduler admits it: the scheduler then
sees an ordinary prefix hit and computes only the rest.

One step of an engine with the tier (LLMEngine.step, under the engine lock):

    promote(engine)   waiting requests' host-tier runs -> device blocks (cached, ref 0)
    schedule()        admission and chunks, as without a tier
    offload(engine)   blocks the allocations evicted: their KV read to host before the step
                      launched next overwrites them

    swap(engine, plan) swap preemption: victims' KV read to host, resumed ones' written back

Blocks are keyed by the engine's chained block hashes and verified token by token, like the
device cache. The tier is bounded in bytes (least recently used first out) and holds only
blocks a device pool once computed, so it never serves KV another prompt made. The copies
are synchronous on the host thread, and happen only on steps that evict, promote or swap.

Swap preemption (`SwapSpace`, the seeds' "preempt aggressively using swap-to-CPU" for the
batch tier): a batch-tier victim's whole KV (its partial last block too) is parked in the
tier's budget, pinned there, and written back into fresh blocks when the scheduler admits it
again, so it resumes where it stopped instead of recomputing. `SwapSpace.decide` is the rule.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from runtime.core.block_pool import BlockHash
from runtime.core.request import Request, cacheable_blocks
from runtime.kv_groups import NULL_BLOCK

if TYPE_CHECKING:
    from runtime.core.engine import LLMEngine
    from runtime.core.scheduler import SchedulerOutput

log = logging.getLogger(__name__)
# Waiting requests (in admission order) whose prompts are looked up in the tier per step: the
# ones the scheduler may admit soon; the others wait for a later step.
PROMOTE_LOOKAHEAD = 8
# A request swapped back in is not swapped out again for this many scheduler steps (it is
# recomputed if it must go, and victims are picked among the others first): a request moved
# out and in on alternate steps would spend the steps copying instead of computing.
SWAP_COOLDOWN_STEPS = 16


@dataclass
class HostBlock:
    token_ids: tuple[int, ...]
    parent: BlockHash | None
    arrays: list[np.ndarray]  # per leaf of the KV cache: [L, 1, BS, ...] (runtime/model/runner.py read_blocks)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


class HostTier:
    """Blocks in host RAM under their hash, at most `capacity_bytes` (LRU). With `log` set
    (the engine's, when its pool records residency events) each block taken or dropped is
    reported as ("stored", hash, parent, tokens, MEDIUM) / ("removed", hash, MEDIUM): vLLM's
    KV events carry the medium, so the fleet router sees a replica's tier as a hit too."""

    MEDIUM = "CPU"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"kv_offload_memory: must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.blocks: OrderedDict[BlockHash, HostBlock] = OrderedDict()
        self.bytes = 0      # prefix blocks'
        self.swapped = 0    # bytes held for swapped-out requests (never dropped for prefix blocks)
        self.stored = 0     # blocks written down, ever
        self.dropped = 0    # blocks pushed out by newer ones
        self.promoted = 0   # blocks copied back up (prefix hits of this tier)
        self.log: Callable[[tuple], None] | None = None

    def put(self, block_hash: BlockHash, block: HostBlock) -> None:
        if block.nbytes > self.capacity_bytes:
            return
        if block_hash in self.blocks:  # (the same hash holds the same tokens' KV: keep the copy)
            self.blocks.move_to_end(block_hash)
            return
        if not self._make_room(block.nbytes):
            return
        self.blocks[block_hash] = block
        if self.log is not None:
            self.log(("stored", block_hash, block.parent, block.token_ids, self.MEDIUM))
        self.bytes += block.nbytes
        self.stored += 1

    def _make_room(self, nbytes: int) -> bool:
        """Drop least recently used prefix blocks until `nbytes` more fit (False: they cannot)."""
        if self.swapped + nbytes > self.capacity_bytes:
            return False
        while self.blocks and self.bytes + self.swapped + nbytes > self.capacity_bytes:
            gone, out = self.blocks.popitem(last=False)
            self.bytes -= out.nbytes
            self.dropped += 1
            if self.log is not None:
                self.log(("removed", gone, self.MEDIUM))
        return True

    def reserve(self, nbytes: int) -> bool:
        """Hold `nbytes` for a swapped-out request (prefix blocks make way); False: no room."""
        if not self._make_room(nbytes):
            return False
        self.swapped += nbytes
        return True

    def unreserve(self, nbytes: int) -> None:
        self.swapped -= nbytes

    def get(self, block_hash: BlockHash, token_ids: Sequence[int]) -> HostBlock | None:
        """The block under `block_hash` if it holds exactly `token_ids` (most recently used now)."""
        block = self.blocks.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        self.blocks.move_to_end(block_hash)
        return block


class DiskTier:
    """The third tier (`--kv-offload-dir DIR`): every block the host tier takes is also written
    to DIR, one file per block named by its hash, so a restarted server finds them. A file holds
    a header (the engine's fingerprint: model, weights sample, KV layout; the block's tokens and
    parent; the arrays' shapes and dtypes; the payload's sha256) and the payload. A file whose
    fingerprint is another engine's, whose tokens differ, or whose payload does not match its
    sha256 is skipped with a log line (and removed), never served. At most `capacity_bytes`
    on disk: the least recently used files go first."""

    MAGIC = b"PJKVB1\n"
    MEDIUM = "DISK"

    def __init__(self, directory: Path, capacity_bytes: int, fingerprint: str) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"kv_offload_disk: must be positive, got {capacity_bytes}")
        self.dir, self.capacity_bytes, self.fingerprint = Path(directory), capacity_bytes, fingerprint
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / ".write-test"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ValueError(f"kv_offload_dir: {self.dir} is not a writable directory ({exc.strerror})") from None
        files = sorted(self.dir.glob("*.kvb"), key=lambda f: f.stat().st_mtime)
        self.files: OrderedDict[BlockHash, int] = OrderedDict()
        for f in files:
            try:
                self.files[bytes.fromhex(f.stem)] = f.stat().st_size
            except ValueError:
                continue
        self.bytes = sum(self.files.values())
        self.loaded = len(self.files)   # blocks found at start
        self.stored = self.promoted = self.skipped = 0
        self.log: Callable[[tuple], None] | None = None  # residency events, as HostTier's

    def _path(self, block_hash: BlockHash) -> Path:
        return self.dir / f"{block_hash.hex()}.kvb"

    def announce(self) -> list[tuple]:
        """("stored", hash, parent, tokens, "DISK") for every block on disk that is this engine's
        (header only: fingerprint and tokens; the payload is checked when it is served), so a
        restarted replica tells the router what its disk holds. Foreign or unreadable files are
        left for `get` to skip."""
        out = []
        for block_hash in list(self.files):
            try:
                with open(self._path(block_hash), "rb") as f:
                    if f.read(len(self.MAGIC)) != self.MAGIC:
                        continue
                    n = struct.unpack("<I", f.read(4))[0]
                    head = json.loads(f.read(n))
            except (OSError, ValueError, struct.error):
                continue
            if head.get("fingerprint") == self.fingerprint:
                parent = head.get("parent")
                out.append(("stored", block_hash, None if parent is None else bytes.fromhex(parent),
                            tuple(head["tokens"]), self.MEDIUM))
        return out

    def put(self, block_hash: BlockHash, block: HostBlock) -> None:
        if block_hash in self.files:
            self.files.move_to_end(block_hash)
            return
        payload = b"".join(np.ascontiguousarray(a).tobytes() for a in block.arrays)
        header = json.dumps({"fingerprint": self.fingerprint, "tokens": list(block.token_ids),
                             "parent": None if block.parent is None else block.parent.hex(),
                             "arrays": [[list(a.shape), a.dtype.str] for a in block.arrays],
                             "sha256": hashlib.sha256(payload).hexdigest()}).encode()
        data = self.MAGIC + struct.pack("<I", len(header)) + header + payload
        if len(data) > self.capacity_bytes:
            return
        while self.files and self.bytes + len(data) > self.capacity_bytes:
            old, size = self.files.popitem(last=False)
            self.bytes -= size
            self._path(old).unlink(missing_ok=True)
            if self.log is not None:
                self.log(("removed", old, self.MEDIUM))
        path = self._path(block_hash)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # (a crash leaves no half-written block under a block's name)
        self.files[block_hash] = len(data)
        self.bytes += len(data)
        self.stored += 1
        if self.log is not None:
            self.log(("stored", block_hash, block.parent, block.token_ids, self.MEDIUM))

    def get(self, block_hash: BlockHash, token_ids: Sequence[int]) -> HostBlock | None:
        if block_hash not in self.files:
            return None
        path = self._path(block_hash)
        why = None
        try:
            data = path.read_bytes()
            if not data.startswith(self.MAGIC):
                why = "not a pagedjax KV block file"
            else:
                n = struct.unpack("<I", data[len(self.MAGIC):len(self.MAGIC) + 4])[0]
                start = len(self.MAGIC) + 4
                head = json.loads(data[start:start + n])
                payload = data[start + n:]
                if head.get("fingerprint") != self.fingerprint:
                    why = "written by another model, weights or KV layout"
                elif hashlib.sha256(payload).hexdigest() != head.get("sha256"):
                    why = "corrupt (its payload does not match its sha256)"
                elif tuple(head["tokens"]) != tuple(token_ids):
                    return None  # another prompt under this hash: never served, the file kept
        except (OSError, ValueError, KeyError, struct.error) as exc:
            why = f"unreadable ({exc})"
        if why is not None:
            log.warning("kv tier: skipping %s: %s", path.name, why)
            self.skipped += 1
            self.bytes -= self.files.pop(block_hash, 0)
            path.unlink(missing_ok=True)
            if self.log is not None:
                self.log(("removed", block_hash, self.MEDIUM))
            return None
        arrays, offset = [], 0
        for shape, dtype in head["arrays"]:
            dt = np.dtype(dtype)
            size = int(np.prod(shape)) * dt.itemsize
            arrays.append(np.frombuffer(payload[offset:offset + size], dt).reshape(shape).copy())
            offset += size
        self.files.move_to_end(block_hash)
        self.promoted += 1
        parent = head["parent"]
        return HostBlock(tuple(head["tokens"]), None if parent is None else bytes.fromhex(parent), arrays)


def fingerprint(engine_config: Any, params: Any) -> str:
    """What a block file must have been written by to be served here: the model's config, the
    KV layout, and a sample of the weights (a fine-tune of the same shape differs in them)."""
    import jax

    h = hashlib.sha256()
    c = engine_config
    h.update(json.dumps({k: v for k, v in c.model.to_json().items() if k != "name"}, sort_keys=True).encode())
    h.update(f"{c.cache.kv_dtype}/{c.cache.block_size}/{c.quantization}/{c.dtype}".encode())
    for leaf in jax.tree.leaves({"embed": params.get("embed"), "final_norm": params.get("final_norm")}):
        a = np.asarray(leaf)
        h.update(np.ascontiguousarray(a.reshape(-1)[:4096]).tobytes())
    return h.hexdigest()


def read_to_host(engine: "LLMEngine", entries: list[tuple]) -> list[tuple[BlockHash, HostBlock]]:
    """(block id, hash, token ids, parent hash) entries -> their KV copied from the device as
    HostBlocks, with their hashes."""
    from runtime.model.runner import read_blocks

    arrays = read_blocks(engine.runner, [b for b, *_ in entries])
    return [(block_hash, HostBlock(token_ids, parent, [a[:, i:i + 1].copy() for a in arrays]))
            for i, (_, block_hash, token_ids, parent) in enumerate(entries)]


def flush_to_disk(engine: "LLMEngine") -> int:
    """At shutdown: every block the device prefix cache still holds (group 0, registered) and
    the disk tier does not, written to disk, so a restart finds the prefixes that were never
    evicted too. Returns the blocks written."""
    disk = engine.disk_tier
    if disk is None:
        return 0
    with engine.lock:
        todo = [(i.block_id, i.block_hash, i.token_ids, i.parent_hash) for i in engine.pool.infos
                if i.block_hash is not None and i.group == 0 and i.token_ids is not None
                and i.block_hash not in disk.files]
        for start in range(0, len(todo), 256):
            for block_hash, block in read_to_host(engine, todo[start:start + 256]):
                disk.put(block_hash, block)
    if todo:
        log.info("kv tier: %d cached blocks written to %s at shutdown", len(todo), disk.dir)
    return len(todo)


def offload(engine: "LLMEngine") -> int:
    """Copy the KV of the cached blocks the pool evicted since the last call (it logged them
    before reusing them) into the host tier; their device contents are intact until the next
    launched step writes them. Returns the blocks copied."""
    log, engine.pool.offload_log = engine.pool.offload_log, []
    if not log:
        return 0
    for block_hash, block in read_to_host(engine, log):
        engine.host_tier.put(block_hash, block)
        if engine.disk_tier is not None:
            engine.disk_tier.put(block_hash, block)
    return len(log)


def promote(engine: "LLMEngine") -> int:
    """For the next waiting requests: the blocks of the prompt that follow its device-cached
    prefix and sit in the host tier, written into free device blocks and registered as cached
    (the allocation's own evictions offloaded first). Only into free blocks above the
    watermark, so a promotion never crowds out what admission would keep. Returns the blocks
    promoted."""
    from runtime.core import capacity
    from runtime.model.runner import write_blocks

    pool, tier, sched = engine.pool, engine.host_tier, engine.scheduler
    bs, total = pool.block_size, 0
    for req in sched.waiting_requests()[:PROMOTE_LOOKAHEAD]:
        if not req.uses_prefix_cache or req.num_computed_tokens or req.swap is not None:
            continue
        req.extend_block_hashes(bs)
        hashes = req.block_hashes[:cacheable_blocks(req.num_tokens, bs)]
        tokens = req.token_ids
        held = pool.lookup_prefix(hashes, tokens)
        start = len(held)
        run: list[HostBlock] = []
        for i in range(start, len(hashes)):
            block = tier.get(hashes[i], tokens[i * bs:(i + 1) * bs])
            if block is None and engine.disk_tier is not None:  # the third tier: into the host tier too
                block = engine.disk_tier.get(hashes[i], tokens[i * bs:(i + 1) * bs])
                if block is not None:
                    tier.put(hashes[i], block)
            if block is None:
                break
            run.append(block)
        if not run:
            continue
        pool.touch(held)  # the device prefix the run extends must not be what its allocation evicts
        room = pool.num_free_blocks - capacity.watermark_blocks(engine.policy, pool.num_blocks)
        run = run[:max(0, room)]
        if not run:
            pool.free(held)
            continue
        targets = pool.allocate(len(run))
        offload(engine)  # (what this allocation evicted, before it is overwritten)
        write_blocks(engine.runner, targets, [np.concatenate([b.arrays[k] for b in run], axis=1)
                                              for k in range(len(run[0].arrays))])
        for i, block_id in enumerate(targets, start):
            pool.cache_block(block_id, hashes[i], tokens[i * bs:(i + 1) * bs], hashes[i - 1] if i else None)
        pool.free(held + targets)  # cached now: the scheduler's lookup takes them as a prefix hit
        tier.promoted += len(run)
        total += len(run)
        req.ledger.add("promoted", "prefix blocks copied up from the host tier", blocks=len(run),
                       device_prefix_blocks=len(held))
    return total




@dataclass
class SwapOut:
    """A preempted request's KV while it waits in host RAM."""

    tables: list[list[int]]   # its block tables when preempted (NULL_BLOCK kept): read, then the layout restored
    num_computed_tokens: int  # where it resumes
    nbytes: int               # held in the host tier's budget
    arrays: list[np.ndarray] | None = None  # per KV leaf [L, n, BS, ...]: the tables' blocks in order
    restored: list[int] | None = None        # the fresh blocks they go back into (the scheduler's)


class SwapSpace:
    """Swap preemption on the host tier's budget: the rule, the rates it weighs, the counts."""

    def __init__(self, tier: HostTier, block_bytes: int) -> None:
        self.tier, self.block_bytes = tier, block_bytes
        self.copy_s_per_byte: float | None = None      # measured on the tier's copies (EMA)
        self.prefill_s_per_token: float | None = None  # measured on the engine's prefill steps (EMA)
        self.declined: dict[str, int] = {}             # batch-tier victims recomputed, by reason
        self.last_why = ""                              # why the last decision recomputed ("" when it swapped)

    def observe_copy(self, seconds: float, nbytes: int) -> None:
        if nbytes:
            self.copy_s_per_byte = _ema(self.copy_s_per_byte, seconds / nbytes)

    def observe_prefill(self, seconds: float, tokens: int) -> None:
        self.prefill_s_per_token = _ema(self.prefill_s_per_token, seconds / tokens)

    def decide(self, req: Request, step: int) -> SwapOut | None:
        """Whether a victim swaps (its SwapOut, bytes reserved) or recomputes (None): the one
        place that rule lives. Interactive requests keep recompute preemption; a batch request
        swaps unless it must compute every token anyway (penalties, prompt logprobs: the
        prefix-cache rule), came back from a swap within SWAP_COOLDOWN_STEPS, costs more to
        copy out and back than to recompute at the measured rates (before a rate is measured,
        a copy is taken to be cheaper), or does not fit the tier beside the other swaps."""
        if req.priority != "batch":
            self.last_why = "interactive tier"
            return None
        why = None
        nbytes = sum(b != NULL_BLOCK for t in req.block_tables for b in t) * self.block_bytes
        if not req.uses_prefix_cache:
            why = "computes every token"
        elif step - req.swapped_in_at < SWAP_COOLDOWN_STEPS:
            why = "cooldown"
        elif (self.copy_s_per_byte is not None and self.prefill_s_per_token is not None
              and 2 * nbytes * self.copy_s_per_byte >= req.num_computed_tokens * self.prefill_s_per_token):
            why = "recompute cheaper"
        elif not self.tier.reserve(nbytes):
            why = "host tier full"
        self.last_why = why or ""
        if why is not None:
            self.declined[why] = self.declined.get(why, 0) + 1
            return None
        return SwapOut([list(t) for t in req.block_tables], req.num_computed_tokens, nbytes)

    def release(self, swap: SwapOut) -> None:
        self.tier.unreserve(swap.nbytes)


def _ema(old: float | None, new: float, weight: float = 0.2) -> float:
    return new if old is None else (1 - weight) * old + weight * new


def swap(engine: "LLMEngine", plan: "SchedulerOutput") -> None:
    """After a schedule, before its step launches: the victims swapped out read their blocks
    (freed, maybe handed to someone else already, not yet overwritten) to host; the requests
    swapped in get them written into their fresh blocks. (A schedule that preempts admits no
    one, so the two never meet in one step.)"""
    import time

    from runtime.model.runner import read_blocks, write_blocks

    import jax

    space, sched = engine.swap_space, engine.scheduler
    jax.block_until_ready(engine.runner.kv)  # (the step in flight first: the timings are the copies')
    for req in plan.swapped_out:
        t0 = time.perf_counter()
        try:
            ids = [b for t in req.swap.tables for b in t if b != NULL_BLOCK]
            req.swap.arrays = [np.ascontiguousarray(a) for a in read_blocks(engine.runner, ids)]
        except Exception as exc:  # noqa: BLE001 -- the request recomputes instead; the engine goes on
            log.error("swap preemption: reading %s's KV to host failed (%s); it recomputes", req.request_id, exc)
            req.lost_tokens = req.swap.num_computed_tokens
            sched.drop_swap(req)
            req.ledger.add("preempted", f"the KV copy to host failed ({type(exc).__name__}): recompute")
            continue
        space.observe_copy(time.perf_counter() - t0, req.swap.nbytes)
    for req in plan.swapped_in:
        t0 = time.perf_counter()
        try:
            write_blocks(engine.runner, req.swap.restored, req.swap.arrays)
            jax.block_until_ready(engine.runner.kv)
        except Exception as exc:  # noqa: BLE001 -- its fresh blocks hold nothing: it recomputes into them
            log.error("swap preemption: writing %s's KV back failed (%s); it recomputes", req.request_id, exc)
            req.lost_tokens, req.num_computed_tokens, req.num_registered_blocks = req.num_computed_tokens, 0, 0
            sched.drop_swap(req)
            req.ledger.add("admitted", f"the KV copy back failed ({type(exc).__name__}): it recomputes from the start")
            continue
        space.observe_copy(time.perf_counter() - t0, req.swap.nbytes)
        sched.drop_swap(req)
