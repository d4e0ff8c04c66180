"""Moving a prompt's KV blocks from a prefill replica to a decode replica.

`KVBlocks` is what travels: the KV of some consecutive full prompt blocks, as host numpy
arrays laid out like the engine's cache leaves but layer-stacked per request -- K and V
(and for an int8/fp8 cache their float32 scales), each [num_layers, n, block_size,
kv_heads(, head_dim)] -- plus what the receiver checks before writing them: the cache
geometry and dtype, and the chained hashes and tokens of the blocks carried.

A `KVConnector` moves one record per request: `send` on the prefill side returns a small
picklable handle (what the orchestrator passes to the decode side), `recv` on the decode
side turns the handle back into the record within a timeout, `drop` frees the sender's
buffer whatever happened. Two CPU implementations: `InProcessConnector` (engines in one
process, tests) and `SharedMemoryConnector` (processes on one host: one shared-memory
segment per request holding all its arrays).

A GPU transport fits the same shape: `send` would keep the gathered arrays on the device
and register that buffer with the transport (NIXL `register_memory`, or an NCCL
send posted on a side stream), the handle carrying the agent name, remote descriptors and
layout instead of bytes; `recv` would post a READ into a buffer the decode side
registered and poll its completion until `timeout_s`, returning a KVBlocks whose arrays
are device arrays (runtime.model.runner.write_blocks accepts either); `drop` deregisters
and frees. Nothing above this interface changes.
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np


class TransferError(Exception):
    """A KV transfer failed (lost, timed out, or not matching this engine); the caller
    releases the reservation and retries or fails the request."""


class TransferTimeout(TransferError):
    pass


@dataclass
class KVBlocks:
    block_size: int
    kv_dtype: str                      # the cache dtype the values are stored in
    num_layers: int
    first_block: int                   # index in the prompt of the first block carried
    block_hashes: list[bytes]          # chained prefix hashes of the carried blocks
    token_ids: list[int]               # the prompt up to the end of the last carried block
    # Cache leaves in the engine's pytree order: [K, V] or [K values, K scales(, K zeros), V
    # values, V scales(, V zeros)]; each [num_layers, n, block_size, kv_heads, head_dim or groups].
    arrays: list[np.ndarray] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays)

    def header(self) -> "KVBlocks":
        """The record without its arrays (what a handle carries beside the bytes)."""
        return replace(self, arrays=[])


class KVConnector(Protocol):
    def send(self, request_id: str, blocks: KVBlocks) -> Any:
        """Make `blocks` available to a receiver; returns a small picklable handle."""
        ...

    def recv(self, handle: Any, timeout_s: float) -> KVBlocks:
        """The record behind `handle`; TransferError / TransferTimeout on failure."""
        ...

    def drop(self, handle: Any) -> None:
        """Free the sender's buffer (idempotent: after success, failure or timeout)."""
        ...


class InProcessConnector:
    """Both engines in one process: the handle is a key into a dict (copies on recv, so
    the receiver never aliases the sender's buffer)."""

    def __init__(self) -> None:
        self._buffers: dict[str, KVBlocks] = {}
        self._ids = itertools.count()

    def send(self, request_id: str, blocks: KVBlocks) -> str:
        handle = f"{request_id}/{next(self._ids)}"
        self._buffers[handle] = blocks
        return handle

    def recv(self, handle: str, timeout_s: float) -> KVBlocks:
        blocks = self._buffers.get(handle)
        if blocks is None:
            raise TransferError(f"KV transfer {handle!r}: no such buffer (dropped or never sent)")
        return replace(blocks, arrays=[a.copy() for a in blocks.arrays])

    def drop(self, handle: str) -> None:
        self._buffers.pop(handle, None)

    @property
    def num_buffers(self) -> int:
        return len(self._buffers)


@dataclass(frozen=True)
class ShmHandle:
    segment: str                                   # shared-memory name
    header: KVBlocks                               # the record without arrays
    layout: tuple[tuple[tuple[int, ...], str, int], ...]  # (shape, dtype name, byte offset) per array
    nbytes: int


class SharedMemoryConnector:
    """Processes on one host: one `multiprocessing.shared_memory` segment per request
    holding all its arrays back to back; the handle names the segment and the layout."""

    def __init__(self) -> None:
        self._segments: dict[str, Any] = {}  # created here, unlinked by drop

    def send(self, request_id: str, blocks: KVBlocks) -> ShmHandle:
        from multiprocessing import shared_memory

        layout, offset = [], 0
        for a in blocks.arrays:
            layout.append((tuple(a.shape), a.dtype.name, offset))
            offset += -(-int(a.nbytes) // 64) * 64  # 64-byte aligned
        name = f"pagedjax-kv-{uuid.uuid4().hex[:16]}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=max(offset, 1))
        for a, (shape, dtype, off) in zip(blocks.arrays, layout):
            np.ndarray(shape, a.dtype, buffer=shm.buf, offset=off)[...] = a
        self._segments[name] = shm
        return ShmHandle(name, blocks.header(), tuple(layout), blocks.nbytes)

    def recv(self, handle: ShmHandle, timeout_s: float) -> KVBlocks:
        import jax.numpy as jnp  # resolves the fp8 dtype name (ml_dtypes)
        from multiprocessing import resource_tracker, shared_memory

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                shm = shared_memory.SharedMemory(name=handle.segment)
                break
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    raise TransferTimeout(f"KV transfer: segment {handle.segment} did not appear "
                                          f"within {timeout_s:g} s") from None
                time.sleep(0.005)
        if handle.segment not in self._segments:
            # Python < 3.13 registers an attached segment for unlinking at our exit: the
            # sender owns it, so take that back.
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        try:
            arrays = [np.ndarray(shape, jnp.dtype(dtype), buffer=shm.buf, offset=off).copy()
                      for shape, dtype, off in handle.layout]
        finally:
            shm.close()
        return replace(handle.header, arrays=arrays)

    def drop(self, handle: ShmHandle) -> None:
        from multiprocessing import shared_memory

        shm = self._segments.pop(handle.segment, None)
        try:
            if shm is None:
                shm = shared_memory.SharedMemory(name=handle.segment)
            shm.close()
            shm.unlink()
        except FileNotFoundError:
            pass

    @property
    def num_buffers(self) -> int:
        return len(self._segments)


@dataclass(frozen=True)
class RayHandle:
    ref: Any                                       # ray.ObjectRef of one uint8 buffer (picklable; borrowed)
    header: KVBlocks                               # the record without arrays
    layout: tuple[tuple[tuple[int, ...], str, int], ...]  # (shape, dtype name, byte offset) per array
    nbytes: int


class RayConnector:
    """Replicas of a Ray cluster (the fleet): `send` packs the record's arrays into one
    buffer and `ray.put`s it (one object, so one transfer, not one per layer or leaf);
    the handle carries the ObjectRef with the header and layout. The sender keeps its
    reference until `drop`, so the object lives until the receiver has it even if the
    orchestrator lets go early; the receiver `ray.get`s it (the object store moves it
    between nodes) within the timeout."""

    def __init__(self) -> None:
        self._refs: dict[Any, Any] = {}  # ObjectRef -> ObjectRef: what keeps each object alive

    def send(self, request_id: str, blocks: KVBlocks) -> RayHandle:
        import ray

        layout, offset = [], 0
        for a in blocks.arrays:
            layout.append((tuple(a.shape), a.dtype.name, offset))
            offset += -(-int(a.nbytes) // 64) * 64  # 64-byte aligned, as in shared memory
        buf = np.zeros(max(offset, 1), np.uint8)
        for a, (_, _, off) in zip(blocks.arrays, layout):
            buf[off:off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        ref = ray.put(buf)
        self._refs[ref] = ref
        return RayHandle(ref, blocks.header(), tuple(layout), blocks.nbytes)

    def recv(self, handle: RayHandle, timeout_s: float) -> KVBlocks:
        import jax.numpy as jnp  # resolves the fp8 dtype name (ml_dtypes)
        import ray
        import ray.exceptions as rex

        try:
            buf = ray.get(handle.ref, timeout=timeout_s)
        except rex.GetTimeoutError:
            raise TransferTimeout(f"KV transfer: object not received within {timeout_s:g} s") from None
        except rex.RayError as exc:  # lost, owner died, ...
            raise TransferError(f"KV transfer: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                                ) from None
        arrays = []
        for shape, dtype, off in handle.layout:
            dt = jnp.dtype(dtype)
            n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            # copy: the object store's buffer is read-only and freed with the object
            arrays.append(np.frombuffer(buf, np.uint8, n, off).view(dt).reshape(shape).copy())
        return replace(handle.header, arrays=arrays)

    def drop(self, handle: RayHandle) -> None:
        # The last reference going frees the object (a receiver's borrow ends when it does).
        self._refs.pop(handle.ref, None)

    @property
    def num_buffers(self) -> int:
        return len(self._refs)
