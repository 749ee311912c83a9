"""Large KV buffers: mapped memory that goes back to the system, sendable files, and a pool that keeps them warm."""
import ctypes
import mmap
import os
import threading
import time

import pytest

from disaggregated_inference.kv import buffers
from disaggregated_inference.kv.buffers import HUGE_THRESHOLD, BufferPool


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_small_buffers_are_bytearrays_and_large_ones_mappings_that_are_counted_and_freed():
    assert isinstance(buffers.allocate(1000), bytearray)
    before = buffers.usage.live
    big = buffers.allocate(HUGE_THRESHOLD)
    assert isinstance(big, mmap.mmap) and len(big) == HUGE_THRESHOLD and big[:4] == b"\0\0\0\0"
    (ctypes.c_uint8 * len(big)).from_buffer(big)[0] = 7  # writable through ctypes, as llama.cpp writes it
    assert big[0] == 7
    assert buffers.usage.live == before + HUGE_THRESHOLD
    del big
    assert buffers.usage.live == before  # unmapped as soon as the last reference went


def test_pool_reuses_a_given_back_buffer_of_a_fitting_size():
    pool = BufferPool(keep=2, idle_seconds=10, clock=Clock())
    first = pool.take(HUGE_THRESHOLD + 10)
    assert len(first) == HUGE_THRESHOLD + 10 and pool.fresh == 1
    first[:3] = b"abc"
    underlying = first.obj
    pool.give(first)
    again = pool.take(HUGE_THRESHOLD)  # smaller request, same mapping
    assert again.obj is underlying and len(again) == HUGE_THRESHOLD and pool.reused == 1
    other = pool.take(HUGE_THRESHOLD)  # the pool is empty again: a new mapping
    assert other.obj is not underlying and pool.fresh == 2


def test_pool_does_not_hand_out_a_buffer_more_than_twice_too_big():
    pool = BufferPool(clock=Clock())
    pool.give(pool.take(4 * HUGE_THRESHOLD))
    small = pool.take(HUGE_THRESHOLD)
    assert len(small.obj) == HUGE_THRESHOLD and pool.reused == 0


def test_idle_buffers_are_dropped_after_the_idle_time_and_the_pool_is_bounded():
    clock = Clock()
    pool = BufferPool(keep=2, idle_seconds=5, clock=clock)
    taken = [pool.take(HUGE_THRESHOLD) for _ in range(3)]
    for view in taken:
        pool.give(view)
    assert pool.idle_bytes() == 2 * HUGE_THRESHOLD  # keep=2
    clock.now += 5.1
    pool.sweep()
    assert pool.idle_bytes() == 0


def test_small_buffers_and_bytearrays_are_not_pooled():
    pool = BufferPool(clock=Clock())
    small = pool.take(100)
    assert isinstance(small, bytearray)
    pool.give(small)
    pool.give(bytearray(HUGE_THRESHOLD))
    assert pool.idle_bytes() == 0


def test_idle_buffers_are_unmapped_by_one_timer_without_anyone_asking():
    pool = BufferPool(keep=2, idle_seconds=0.2)
    before_threads = threading.active_count()
    for _ in range(5):
        pool.give(pool.take(HUGE_THRESHOLD))  # one timer at a time, however many buffers come back
        assert threading.active_count() <= before_threads + 1
    assert pool.stats()["idle"] == 1 and pool.stats()["reused_total"] == 4
    deadline = time.monotonic() + 5
    while pool.stats()["idle"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.stats()["idle_bytes"] == 0


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="in-memory files (memfd) are Linux's")
def test_a_sendable_buffer_lies_in_an_in_memory_file_with_room_around_it_and_is_freed_with_it():
    before = buffers.usage.live
    view = buffers.sendable(HUGE_THRESHOLD + 3)
    assert len(view) == HUGE_THRESHOLD + 3 and bytes(view[:4]) == b"\0\0\0\0"
    view[:5] = b"hello"
    span = buffers.span_of(view)
    assert span.length == len(view) and span.offset >= 64 << 10 and span.tailroom >= 4096
    assert os.pread(span.fd, 5, span.offset) == b"hello"  # the file and the buffer are the same bytes
    inner = buffers.span_of(view[2:10])
    assert (inner.fd, inner.offset, inner.length) == (span.fd, span.offset + 2, 8)
    assert buffers.usage.live > before
    fd = span.fd
    del view, inner
    assert buffers.usage.live == before  # unmapped and the file closed with its last reference
    with pytest.raises(OSError):
        os.fstat(fd)


def test_plain_buffers_lie_in_no_file():
    assert buffers.span_of(bytearray(10)) is None
    assert buffers.span_of(buffers.allocate(HUGE_THRESHOLD)) is None
    assert buffers.sendable(100) == bytearray(100)  # small ones are plain
