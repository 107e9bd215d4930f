"""A one-writer, many-reader message queue in shared memory (one host).

The engine core writes each step's SchedulerOutput once, pickled, and every worker reads the
same bytes: no pipe per worker, no copy per reader. The memory is a ring of `num_slots` slots;
each holds one chunk of a message (a message larger than a slot takes consecutive slots).

Layout: a metadata array of int64, one row per slot, then the slots' data.

    row = [seq, num_bytes, is_last, read_seq[0], ..., read_seq[num_readers - 1]]

Message chunks are numbered 1, 2, 3, ... (`seq`) and chunk s lives in slot (s - 1) % num_slots.
The writer may fill slot k with chunk s once every reader has acknowledged chunk s - num_slots
there (read_seq[r] >= s - num_slots); it writes the data and the size first and publishes `seq`
last. Reader r waits for seq == s in its next slot, copies the data out, then writes
read_seq[r] = s. Each int64 field has one writer, and aligned 8-byte stores and loads are
atomic; a lock acquire/release between the data and the flag orders the two for CPython (the
fence vLLM's shm_broadcast uses).

Waiting spins first (`spin_s`, useful when a GPU step is a few milliseconds and a sleep would
add latency), then sleeps in growing steps up to 1 ms; every `check_interval_s` it calls the
owner's `check()`, which raises when the other side is dead, so no wait hangs forever.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any, Optional

import numpy as np

_FIELDS = 3  # seq, num_bytes, is_last (then one read_seq per reader)
_MAX_SLEEP_S = 1e-3
_fence_lock = threading.Lock()


def _fence() -> None:
    with _fence_lock:
        pass


def _slot_free(row: np.ndarray, oldest: int) -> Callable[[], bool]:
    """Whether every reader acknowledged the chunk `oldest` that last used the slot."""
    return lambda: bool((row[_FIELDS:] >= oldest).all())


def _published(row: np.ndarray, seq: int) -> Callable[[], bool]:
    return lambda: bool(row[0] == seq)


@dataclass(frozen=True)
class ShmQueueHandle:
    """What another process needs to attach to a queue (picklable)."""

    name: str
    num_readers: int
    num_slots: int
    slot_bytes: int


class ShmBroadcastQueue:
    """See the module docstring. Create it in the writer's process (`create`), pass `handle()`
    to the readers, which `attach(handle, reader_rank)`. Only the creator unlinks the memory."""

    def __init__(self, handle: ShmQueueHandle, shm: shared_memory.SharedMemory,
                 reader_rank: Optional[int], owner: bool) -> None:
        self.handle_ = handle
        self._shm = shm
        self._owner = owner
        self.reader_rank = reader_rank
        num_cols = _FIELDS + handle.num_readers
        meta_bytes = handle.num_slots * num_cols * 8
        buf = shm.buf
        assert buf is not None  # an open segment
        self._meta = np.ndarray((handle.num_slots, num_cols), dtype=np.int64,
                                buffer=buf[:meta_bytes])
        self._data = buf[meta_bytes:]
        self._next_seq = 1  # the next chunk this side writes or reads
        self.spin_s = 0.0
        self.check: Callable[[], None] = lambda: None
        self.check_interval_s = 0.1

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def create(cls, num_readers: int, num_slots: int = 16, slot_bytes: int = 1 << 20,
               reader_rank: Optional[int] = None) -> "ShmBroadcastQueue":
        """A new queue; this process writes it, or reads it as `reader_rank` (a reply queue,
        whose writer attaches)."""
        if num_readers < 1 or num_slots < 1 or slot_bytes < 1:
            raise ValueError("a queue needs at least one reader, one slot and one byte a slot")
        size = num_slots * (_FIELDS + num_readers) * 8 + num_slots * slot_bytes
        shm = shared_memory.SharedMemory(create=True, size=size)
        meta_bytes = num_slots * (_FIELDS + num_readers) * 8
        assert shm.buf is not None  # just created
        shm.buf[:meta_bytes] = bytes(meta_bytes)
        handle = ShmQueueHandle(shm.name, num_readers, num_slots, slot_bytes)
        return cls(handle, shm, reader_rank, owner=True)

    @classmethod
    def attach(cls, handle: ShmQueueHandle, reader_rank: Optional[int]) -> "ShmBroadcastQueue":
        """Attaches to a queue another process created: as reader `reader_rank`, or as its writer
        (reader_rank None) when the creator only reads (a worker's reply queue)."""
        if reader_rank is not None and not 0 <= reader_rank < handle.num_readers:
            raise ValueError(f"reader rank {reader_rank} out of range ({handle.num_readers})")
        shm = shared_memory.SharedMemory(name=handle.name)
        # The creator owns the segment; keep this process's resource tracker from unlinking it
        # (Python < 3.13 registers every attach).
        try:
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - nothing to unregister on some platforms
            pass
        return cls(handle, shm, reader_rank, owner=False)

    def handle(self) -> ShmQueueHandle:
        return self.handle_

    def close(self) -> None:
        """Releases this process's mapping (and the segment itself, in the creator)."""
        self._meta = np.empty((0, 0), dtype=np.int64)
        self._data.release()
        try:
            self._shm.close()
        except BufferError:  # a view is still exported somewhere; the OS frees it at exit
            pass
        if self._owner:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass

    # ---- waiting --------------------------------------------------------------------------------
    def _wait(self, ready: Callable[[], bool], timeout_s: Optional[float], what: str) -> None:
        if ready():
            return
        start = last_check = time.monotonic()
        sleep = 1e-6
        while not ready():
            now = time.monotonic()
            if now - last_check >= self.check_interval_s:
                last_check = now
                self.check()
                if timeout_s is not None and now - start > timeout_s:
                    raise TimeoutError(f"shared-memory queue: {what} for {timeout_s:.0f} s")
            if now - start < self.spin_s:
                continue
            time.sleep(sleep)
            sleep = min(sleep * 2, _MAX_SLEEP_S)

    # ---- writer ---------------------------------------------------------------------------------
    def enqueue(self, obj: Any, timeout_s: Optional[float] = None) -> None:
        """Pickles obj once and publishes it to every reader."""
        self.enqueue_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), timeout_s)

    def enqueue_bytes(self, payload: bytes, timeout_s: Optional[float] = None) -> None:
        h = self.handle_
        view = memoryview(payload)
        offset = 0
        while True:
            seq = self._next_seq
            slot = (seq - 1) % h.num_slots
            row = self._meta[slot]
            oldest = seq - h.num_slots
            self._wait(_slot_free(row, oldest), timeout_s, "waiting for readers to free a slot")
            chunk = view[offset : offset + h.slot_bytes]
            start = slot * h.slot_bytes
            self._data[start : start + len(chunk)] = chunk
            offset += len(chunk)
            is_last = offset >= len(payload)
            row[1] = len(chunk)
            row[2] = int(is_last)
            _fence()
            row[0] = seq
            self._next_seq = seq + 1
            if is_last:
                return

    # ---- reader ---------------------------------------------------------------------------------
    def dequeue(self, timeout_s: Optional[float] = None) -> Any:
        """The next message (blocks until it is there; TimeoutError after timeout_s)."""
        return pickle.loads(self.dequeue_bytes(timeout_s))

    def poll(self) -> bool:
        """Whether the next message has at least started to arrive (never blocks)."""
        slot = (self._next_seq - 1) % self.handle_.num_slots
        return bool(self._meta[slot, 0] == self._next_seq)

    def dequeue_bytes(self, timeout_s: Optional[float] = None) -> bytes:
        if self.reader_rank is None:
            raise RuntimeError("this side of the queue writes; it cannot dequeue")
        h = self.handle_
        col = _FIELDS + self.reader_rank
        parts: list[bytes] = []
        while True:
            seq = self._next_seq
            slot = (seq - 1) % h.num_slots
            row = self._meta[slot]
            self._wait(_published(row, seq), timeout_s, "waiting for a message")
            _fence()
            num_bytes, is_last = int(row[1]), bool(row[2])
            start = slot * h.slot_bytes
            parts.append(bytes(self._data[start : start + num_bytes]))
            _fence()
            row[col] = seq
            self._next_seq = seq + 1
            if is_last:
                return parts[0] if len(parts) == 1 else b"".join(parts)
