"""The shared-memory broadcast queue: one writer, readers in other processes."""

from __future__ import annotations

import multiprocessing
import threading

import pytest

from pyorch.distributed.shm_broadcast import ShmBroadcastQueue, ShmQueueHandle

# Messages: small ones, one exactly a slot, ones spanning several slots, more than the ring.
SLOT = 64
MESSAGES = [b"", b"a", bytes(range(SLOT)), bytes(SLOT * 3 + 5), b"x" * (SLOT * 9)] + [
    f"msg {i}".encode() for i in range(40)
]


def _reader(handle: ShmQueueHandle, rank: int, out: "multiprocessing.Queue") -> None:
    q = ShmBroadcastQueue.attach(handle, rank)
    got = [q.dequeue_bytes(timeout_s=30) for _ in MESSAGES]
    obj = q.dequeue(timeout_s=30)
    q.close()
    out.put((rank, got, obj))


def test_every_reader_gets_every_message_in_order():
    ctx = multiprocessing.get_context("spawn")
    queue = ShmBroadcastQueue.create(num_readers=2, num_slots=4, slot_bytes=SLOT)
    results = ctx.Queue()
    readers = [ctx.Process(target=_reader, args=(queue.handle(), r, results)) for r in range(2)]
    for p in readers:
        p.start()
    try:
        # The ring holds 4 chunks: the writer must wait for both readers over and over.
        for m in MESSAGES:
            queue.enqueue_bytes(m, timeout_s=30)
        queue.enqueue({"step": 7, "ids": list(range(100))}, timeout_s=30)
        got = dict((r, (msgs, obj)) for r, msgs, obj in (results.get(timeout=60)
                                                         for _ in readers))
    finally:
        for p in readers:
            p.join(30)
        queue.close()
    for rank in range(2):
        assert got[rank][0] == MESSAGES
        assert got[rank][1] == {"step": 7, "ids": list(range(100))}


def test_waits_raise_instead_of_hanging():
    """A writer whose readers stall, and a reader whose writer is silent, give up through
    check() (the executor's death detection) or their timeout."""
    queue = ShmBroadcastQueue.create(num_readers=1, num_slots=2, slot_bytes=8)
    reader = ShmBroadcastQueue.attach(queue.handle(), 0)
    try:
        queue.enqueue_bytes(b"12345678" * 2)  # fills both slots; nobody reads
        with pytest.raises(TimeoutError, match="free a slot"):
            queue.enqueue_bytes(b"more", timeout_s=0.3)

        class Dead(Exception):
            pass

        def check() -> None:
            raise Dead("the other side died")

        queue.check = check
        queue.check_interval_s = 0.01
        with pytest.raises(Dead):
            queue.enqueue_bytes(b"more")
        assert reader.dequeue_bytes(timeout_s=5) == b"12345678" * 2
        assert not reader.poll()
        with pytest.raises(TimeoutError, match="waiting for a message"):
            reader.dequeue_bytes(timeout_s=0.3)
    finally:
        reader.close()
        queue.close()


def test_reply_queue_written_by_an_attached_writer():
    """The executor's reply queues: the creator reads, the worker attaches as the writer."""
    queue = ShmBroadcastQueue.create(num_readers=1, num_slots=2, slot_bytes=16, reader_rank=0)
    writer = ShmBroadcastQueue.attach(queue.handle(), None)
    try:
        t = threading.Thread(target=lambda: [writer.enqueue(("ok", i)) for i in range(10)])
        t.start()
        assert [queue.dequeue(timeout_s=10) for _ in range(10)] == [("ok", i) for i in range(10)]
        t.join()
        with pytest.raises(RuntimeError, match="cannot dequeue"):
            writer.dequeue()
    finally:
        writer.close()
        queue.close()


def test_bad_arguments():
    with pytest.raises(ValueError):
        ShmBroadcastQueue.create(num_readers=0)
    queue = ShmBroadcastQueue.create(num_readers=1, num_slots=1, slot_bytes=8)
    try:
        with pytest.raises(ValueError, match="reader rank"):
            ShmBroadcastQueue.attach(queue.handle(), 1)
    finally:
        queue.close()
