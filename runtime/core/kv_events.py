"""KV-cache residency events in vLLM's wire format, and the router's view built from them.

A replica's block pool logs ("stored", hash, parent, tokens) and ("removed", hash) as
its prefix cache changes (runtime/core/block_pool.py). `encode_batch` turns one step's worth
into vLLM's `KVEventBatch` (msgpack, array-like structs tagged by class name: the same
bytes vLLM publishes on its ZMQ socket), so llm-d's precise prefix scorer or Ray's
KV-aware router could consume a pagedjax replica unchanged. `Residency` is the consumer
side: per replica, the set of block hashes it can serve, and how many leading blocks of
a prompt it holds. Hashes are the engine's own chained sha256 (block_pool.hash_block),
so a match is exact, not a text heuristic.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence

import msgspec

BlockHash = bytes


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the three event kinds (the msgpack tag is the class name, as in vLLM)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def to_vllm_events(pool_events: Iterable[tuple], block_size: int) -> list[KVCacheEvent]:
    """Pool events -> vLLM events; consecutive stores of one chain become one BlockStored
    (vLLM batches a request's new blocks the same way), consecutive removals one BlockRemoved.
    A KV tier's events (runtime/core/kv_tiers.py) end in their medium ("CPU", "DISK"); the
    device pool's carry none (vLLM's default medium). A block computed under a LoRA adapter carries
    its lora_id (runtime/core/lora.py: the id of that adapter's load)."""
    out: list[KVCacheEvent] = []
    for ev in pool_events:
        if ev[0] == "stored":
            _, h, parent, tokens, *rest = ev  # (then: medium, lora_id; each optional)
            where = rest[0] if rest else None
            lora = rest[1] if len(rest) > 1 else None
            last = out[-1] if out else None
            if (isinstance(last, BlockStored) and last.block_hashes[-1] == parent and last.medium == where
                    and last.lora_id == lora):
                last.block_hashes.append(h)
                last.token_ids.extend(tokens)
            else:
                out.append(BlockStored([h], parent, list(tokens), block_size, lora_id=lora, medium=where))
        elif ev[0] == "removed":
            where = ev[2] if len(ev) > 2 else None
            if out and isinstance(out[-1], BlockRemoved) and out[-1].medium == where:
                out[-1].block_hashes.append(ev[1])
            else:
                out.append(BlockRemoved([ev[1]], medium=where))
        elif ev[0] == "cleared":
            out.append(AllBlocksCleared())
        else:
            raise ValueError(f"unknown pool event {ev[0]!r}")
    return out


def encode_batch(events: Sequence[KVCacheEvent], ts: float | None = None) -> bytes:
    return _encoder.encode(KVEventBatch(time.time() if ts is None else ts, list(events)))


def decode_batch(data: bytes) -> KVEventBatch:
    return _decoder.decode(data)


class Residency:
    """Which block hashes each replica's prefix cache holds, kept from its event stream: the
    device pool's and, per medium, its KV tiers' (a tier's block is served by copying it up,
    not recomputing it, so it counts as held; a block leaves a medium only by that medium's
    removal).

    Two sources: events (exact, a little late) and `expect` (the router's own note that it
    just sent a prompt somewhere: its blocks will be there in a step, so the next request
    with that prefix follows it instead of racing the events). Thread-safe: the router and
    the event pump run on different threads. `clock`: monotonic seconds (tests pass a fake
    one to expire `expect` notes without sleeping)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._held: dict[str, set[BlockHash]] = {}
        self._tiers: dict[str, dict[str, set[BlockHash]]] = {}  # replica -> medium -> hashes
        self._expected: dict[str, dict[BlockHash, float]] = {}
        self._lock = threading.Lock()
        self.events_applied = 0

    def apply(self, replica: str, batch: KVEventBatch) -> None:
        with self._lock:
            held = self._held.setdefault(replica, set())
            tiers = self._tiers.setdefault(replica, {})
            expected = self._expected.setdefault(replica, {})
            for ev in batch.events:
                medium = getattr(ev, "medium", None)
                where = held if medium in (None, "GPU") else tiers.setdefault(medium, set())
                if isinstance(ev, BlockStored):
                    where.update(ev.block_hashes)
                    for h in ev.block_hashes:
                        expected.pop(h, None)
                elif isinstance(ev, BlockRemoved):
                    where.difference_update(ev.block_hashes)
                else:  # (a fresh replica, or a reset: nothing it held is known any more)
                    held.clear()
                    tiers.clear()
                    expected.clear()
                self.events_applied += 1

    def expect(self, replica: str, hashes: Sequence[BlockHash], ttl_s: float = 10.0) -> None:
        until = self._clock() + ttl_s
        with self._lock:
            exp = self._expected.setdefault(replica, {})
            for h in hashes:
                exp[h] = until

    def matched(self, replica: str, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of `hashes` the replica holds (or is about to)."""
        now = self._clock()
        with self._lock:
            held = self._held.get(replica, ())
            tiers = self._tiers.get(replica, {}).values()
            exp = self._expected.get(replica, {})
            n = 0
            for h in hashes:
                if h in held or exp.get(h, 0.0) > now or any(h in t for t in tiers):
                    n += 1
                else:
                    break
            return n

    def forget(self, replica: str) -> None:
        """A replica died or was stopped: nothing of it can serve a hit any more."""
        with self._lock:
            self._held.pop(replica, None)
            self._tiers.pop(replica, None)
            self._expected.pop(replica, None)

    def num_blocks(self, replica: str) -> int:
        with self._lock:
            return len(self._held.get(replica, ()))
