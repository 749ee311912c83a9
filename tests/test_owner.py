"""The model-owner thread: one thread runs the backend, HTTP threads queue work and wait."""
import threading
import time

import pytest

from disaggregated_inference.backends.base import Event
from disaggregated_inference.errors import BackendUnavailable, Overloaded
from disaggregated_inference.owner import ModelOwner


class FakeBackend:
    """Records which thread ran each call; ``gate`` holds a job until released."""

    def __init__(self, load_delay=0.0, fail_load=False):
        self.load_delay, self.fail_load = load_delay, fail_load
        self.threads, self.gate = [], threading.Event()
        self.gate.set()
        self.closed = False

    def load(self, progress):
        progress("loading fake weights")
        time.sleep(self.load_delay)
        if self.fail_load:
            raise RuntimeError("weights are corrupt")

    def work(self, value):
        self.threads.append(threading.current_thread().name)
        self.gate.wait(5)
        return value * 2

    def tokens(self, n, cancelled):
        for i in range(n):
            if cancelled():
                return
            self.threads.append(threading.current_thread().name)
            yield Event(piece=str(i))
            time.sleep(0.01)
        yield Event(metrics={"n": n})

    def close(self):
        self.closed = True


def ready_owner(backend, **kw) -> ModelOwner:
    owner = ModelOwner(backend, **kw)
    deadline = time.time() + 5
    while not owner.ready and time.time() < deadline:
        time.sleep(0.01)
    return owner


def test_calls_run_on_the_owner_thread_not_the_caller():
    backend = FakeBackend()
    owner = ready_owner(backend)
    assert owner.call(lambda b: b.work(21)) == 42
    assert backend.threads == ["model-owner"]
    owner.close()


def test_loading_and_failed_models_answer_503_with_the_reason():
    slow = ModelOwner(FakeBackend(load_delay=0.5))
    with pytest.raises(BackendUnavailable, match="still loading") as info:
        slow.call(lambda b: b.work(1))
    assert info.value.details["retry_after"] == 5
    broken = ModelOwner(FakeBackend(fail_load=True))
    time.sleep(0.2)
    assert broken.state == "failed" and "weights are corrupt" in broken.error
    with pytest.raises(BackendUnavailable, match="failed to load: RuntimeError: weights are corrupt"):
        broken.call(lambda b: b.work(1))


def test_work_not_picked_up_in_time_is_dropped_with_overloaded():
    backend = FakeBackend()
    owner = ready_owner(backend, queue_timeout=0.2)
    backend.gate.clear()  # the first job blocks the owner thread
    first = threading.Thread(target=lambda: owner.call(lambda b: b.work(1)))
    first.start()
    time.sleep(0.05)
    started = time.monotonic()
    with pytest.raises(Overloaded, match="did not pick the request up within 0.2s"):
        owner.call(lambda b: b.work(2))
    assert time.monotonic() - started < 1.0
    backend.gate.set()
    first.join()
    assert owner.call(lambda b: b.work(3)) == 6
    assert backend.threads.count("model-owner") == 2  # the dropped job never ran
    owner.close()


def test_streams_yield_in_order_and_closing_early_cancels_the_job():
    backend = FakeBackend()
    owner = ready_owner(backend)
    events = list(owner.stream(lambda b, cancelled: b.tokens(5, cancelled)))
    assert [e.piece for e in events[:-1]] == ["0", "1", "2", "3", "4"] and events[-1].metrics == {"n": 5}
    backend.threads.clear()
    stream = owner.stream(lambda b, cancelled: b.tokens(1000, cancelled))
    next(stream)
    stream.close()
    time.sleep(0.1)
    produced = len(backend.threads)
    assert produced < 1000
    assert owner.call(lambda b: b.work(5)) == 10  # the owner is free again


def test_errors_raised_by_the_backend_reach_the_caller():
    owner = ready_owner(FakeBackend())

    def boom(backend):
        raise ValueError("bad tokens")

    with pytest.raises(ValueError, match="bad tokens"):
        owner.call(boom)
    assert owner.call(lambda b: b.work(4)) == 8
