"""Issue 27 §2: the pieces of "a hung server is found in seconds", in process.

- ``server/progress.py``: a request's work on a helper thread, a heartbeat line whenever the next line
  is slow, an error as the last line with its HTTP status, the work stopped when the client goes;
- ``watch.py``: silence is a stalled server, heartbeats with no progress for several times what the
  server's speed says are too, and the caller's own deadline is not the server's fault (a streamed KV's
  decode has the prefill's allowance while it waits for that KV);
- the owner counts the prompt tokens a batched backend evaluates for a request;
- ``base.check_bound``: text that cannot fit the context by the vocabulary's longest token is refused
  before it is tokenized.
"""
from __future__ import annotations

import threading
import time

import pytest

from disaggregated_inference.backends.base import check_bound
from disaggregated_inference.errors import ContextOverflow, Overloaded, UpstreamTimeout
from disaggregated_inference.server import progress
from disaggregated_inference.watch import PROGRESS_FACTOR, Watch


def test_a_slow_answer_comes_after_heartbeats_that_say_what_the_request_is_doing():
    def work(status):
        status.phase = "queued"
        time.sleep(0.35)
        status.phase, status.tokens, status.evaluated = "prefill", 100, 40
        time.sleep(0.35)
        yield {"done": True, "answer": 42}

    lines = list(progress.lines(work, interval=0.1))
    assert lines[-1] == {"done": True, "answer": 42}
    beats = lines[:-1]
    assert {"status": "queued"} in beats and {"status": "prefill", "tokens": 100, "evaluated": 40} in beats
    assert len(beats) >= 2


def test_an_error_is_the_last_line_with_its_http_status():
    def work(status):
        yield {"text": "a", "done": False}
        raise Overloaded("no slot came free", retry_after=1)

    lines = list(progress.lines(work, interval=1.0))
    assert lines[0] == {"text": "a", "done": False}
    assert lines[-1]["status"] == 503 and lines[-1]["code"] == "overloaded" and lines[-1]["done"] is True

    def broken(status):
        raise RuntimeError("boom")
        yield  # a generator

    last = list(progress.lines(broken, interval=1.0))[-1]
    assert last["status"] == 500 and last["code"] == "internal_error" and "boom" in last["error"]


def test_work_that_is_a_plain_iterator_ends_without_an_error_on_its_thread():
    # POST /prefill with progress answers from iter([...]); closing it broke the helper thread
    # (AttributeError, a traceback per request in the prefill server's log) after the answer was sent
    failures = []
    previous, threading.excepthook = threading.excepthook, failures.append
    try:
        assert list(progress.lines(lambda status: iter([{"done": True, "answer": 1}]), interval=1.0)) == \
            [{"done": True, "answer": 1}]
        for thread in [t for t in threading.enumerate() if t.name == "request-work"]:
            thread.join(2)
    finally:
        threading.excepthook = previous
    assert failures == []


def test_the_work_stops_when_the_client_goes_away():
    closed = threading.Event()

    def work(status):
        try:
            for i in range(1000):
                time.sleep(0.01)
                yield {"text": str(i), "done": False}
        finally:
            closed.set()

    lines = progress.lines(work, interval=1.0)
    next(lines)
    lines.close()
    assert closed.wait(2), "the work went on after the client had gone"


def test_silence_is_a_stalled_server_and_a_deadline_is_the_callers():
    watch = Watch("d1", silence=0.2, timeout=None, what="decode_timeout")
    assert watch.read_timeout() == 0.2
    err = watch.timed_out()
    assert err.details.get("stalled") and not err.details.get("deadline") and "d1" in err.message
    watch = Watch("d1", silence=5.0, timeout=0.1, what="decode_timeout")
    assert watch.read_timeout() <= 0.1
    time.sleep(0.12)
    err = watch.timed_out()
    assert err.details.get("deadline") and not err.details.get("stalled") and "decode_timeout" in err.message
    with pytest.raises(UpstreamTimeout) as info:
        watch.heard({"text": "x", "done": False})  # pieces still coming: the caller's time is up all the same
    assert info.value.details.get("deadline")
    assert watch.heard({"done": True, "metrics": {}}) is False  # an answer that arrived is taken
    watch.lift_deadline()
    assert watch.heard({"text": "x", "done": False}) is False


def test_a_streamed_kvs_decode_has_the_prefills_allowance_while_it_waits_then_its_own_deadline():
    # the decode server of an overlapped handoff waits for the prefill to make the KV: that wait is not decode time
    watch = Watch("d1", silence=5.0, timeout=0.1, what="decode_timeout", waiting=0.3)
    time.sleep(0.15)
    assert watch.heard({"status": "importing"}) is True  # past decode_timeout, within the prefill's allowance
    assert watch.heard({"status": "decode", "generated": 1}) is True  # moved on: decode_timeout from here
    time.sleep(0.15)
    with pytest.raises(UpstreamTimeout) as info:
        watch.heard({"text": "x", "done": False})
    assert info.value.details.get("deadline") and "decode_timeout" in info.value.message
    waiting = Watch("d2", silence=5.0, timeout=0.1, what="decode_timeout", waiting=0.1)
    time.sleep(0.25)
    with pytest.raises(UpstreamTimeout):  # the prefill's allowance is bounded too
        waiting.heard({"status": "importing"})


def test_heartbeats_without_progress_are_given_up_after_several_times_what_the_speed_says():
    # 100 tokens left at 2,000 tokens/s should take 0.05 s: given up after max(silence, 4 x 0.05 s)
    watch = Watch("p1", silence=0.3, timeout=None, what="prefill_timeout", prompt_speed=2000.0)
    assert watch.heard({"status": "queued"}) is True  # waiting for a slot: the server bounds that itself
    time.sleep(0.4)
    assert watch.heard({"status": "queued"}) is True
    assert watch.heard({"status": "prefill", "tokens": 200, "evaluated": 100})
    time.sleep(0.2)
    assert watch.heard({"status": "prefill", "tokens": 200, "evaluated": 150})  # progress: fine
    time.sleep(max(0.3, PROGRESS_FACTOR * 50 / 2000.0) + 0.1)
    with pytest.raises(UpstreamTimeout) as info:
        watch.heard({"status": "prefill", "tokens": 200, "evaluated": 150})
    assert info.value.details.get("stalled") and "no progress" in info.value.message
    # a server whose speed is not known yet is judged by its silence alone
    unknown = Watch("p2", silence=0.3, timeout=None, what="prefill_timeout")
    unknown.heard({"status": "prefill", "tokens": 200, "evaluated": 0})
    time.sleep(0.4)
    assert unknown.heard({"status": "prefill", "tokens": 200, "evaluated": 0}) is True


def test_the_owner_counts_the_prompt_tokens_it_evaluates_for_a_request():
    from disaggregated_inference.backends.base import Eval
    from disaggregated_inference.server.owner import ModelOwner

    class Batched:
        slots, batched = 1, True

        def load(self, progress):
            pass

        def evaluate(self, evals, waiting=0):
            for ev in evals:
                ev.done = min(len(ev.tokens), ev.done + 10)
                ev.row = 0
            return 10

        def close(self):
            pass

    def job(backend):
        ev = Eval(0, list(range(35)), 0)
        yield ev
        return "done"

    owner = ModelOwner(Batched())
    while not owner.ready:
        time.sleep(0.01)
    status = progress.Progress("prefill")
    assert owner.call(job, progress=status) == "done"
    assert status.evaluated == 35
    owner.close()


def test_text_that_cannot_fit_is_refused_before_it_is_tokenized():
    check_bound(b"a" * 8000, "prompt", n_ctx=100, longest_token=81)  # 99 tokens at least: may fit
    with pytest.raises(ContextOverflow) as info:
        check_bound(b"a" * 8100, "messages", n_ctx=100, longest_token=81)  # 100 at least: cannot
    assert info.value.field == "messages" and "81 bytes" in info.value.message
    check_bound(b"a" * 10 ** 6, "prompt", n_ctx=100, longest_token=0)  # no bound for this vocabulary
