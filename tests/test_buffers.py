"""Large KV buffers: mapped memory that goes back to the system, and a pool that reuses it briefly."""
import ctypes
import mmap

from disaggregated_inference import buffers
from disaggregated_inference.buffers import HUGE_THRESHOLD, BufferPool


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
