"""Pacing: the grader sends each model no more than its servers can serve, and can take it all back.

A class of notebooks is far more work than a cluster's slots. Sent all at once, the requests
queue on the servers, and the client's deadlines (which count that queue) expire on healthy
servers: they get marked down and requests fall back. So the grader holds its own queue, one per
model, and lets a request go to the cluster only when

- a decode slot of that model is free: requests in flight <= the ``slots.total`` that the model's
  decode servers report on ``/health`` (decoding holds a slot for the whole answer); and
- its prompt would be evaluated in time: the prompts in their prefill phase (sent, first token not
  yet back), this one included, take at most ``PREFILL_BUDGET_SHARE`` of the client's
  ``prefill_timeout`` at the speed measured for this model so far (prompt characters per second
  while any prompt was in its prefill phase). One prompt is always let through, so until a speed is
  measured prompts go one at a time, and a fast cluster opens up to its prefill slots within a
  request. On the production cluster (H100 prefill) that is its slots; on two shared CPU cores,
  about one prompt at a time.

Requests go out through ``client.stream`` where the client has it: reading the answer as it
is generated, a long answer is not cut off by a deadline on the whole reply, and closing the
stream (the batch is stopping) cancels the job on the decode server and frees its slot at once.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from ..client import overlap_figures
from ..errors import GradingStopped

PREFILL_BUDGET_SHARE = 0.25  # of the client's prefill_timeout: what the prompts ahead may take, expected
DEFAULT_PREFILL_TIMEOUT = 60.0  # a client that does not say (a fake)
WAIT_TICK = 0.2  # s: how often a request waiting for its turn looks at the stop flag


class PrefillMeter:
    """Prompt characters evaluated per second of prefill phase (any prompt of the model in it), recent first.

    A prompt's prefill phase runs from its request being sent to its first token: the /prefill,
    the KV handoff and the decode server's first step (or the decode server's own evaluation of
    the prompt when it serves alone)."""

    DECAY = 0.8  # weight of what was measured before each new observation

    def __init__(self):
        self.chars = 0.0
        self.busy = 0.0

    def observe(self, chars: int, busy_seconds: float) -> None:
        self.chars = self.chars * self.DECAY + chars
        self.busy = self.busy * self.DECAY + busy_seconds

    @property
    def rate(self) -> float | None:
        return self.chars / self.busy if self.busy > 0 and self.chars > 0 else None


@dataclass
class Capacity:
    """What the servers of one model can take at once, as their last ``/health`` said."""

    decode_slots: int
    prefill_slots: int | None  # None: no prefill server (the decode servers evaluate prompts themselves)


def capacity_of(client, model_key: str) -> Capacity:
    """The decode and prefill slots of a model's servers that are up (``client.status()``); at least 1."""
    decode = prefill = 0
    has_prefill = False
    for server in client.status():
        if server.get("model") != model_key or not server.get("up"):
            continue
        slots = server.get("slots")
        slots = slots if isinstance(slots, int) and not isinstance(slots, bool) and slots > 0 else 1
        if server.get("role") == "decode":
            decode += slots
        elif server.get("role") == "prefill":
            prefill += slots
            has_prefill = True
    return Capacity(max(1, decode), max(1, prefill) if has_prefill else None)


class Turn:
    """One admitted request: ``prefilled()`` once its first token is back, ``release()`` when it ends."""

    def __init__(self, pace: "ModelPace", chars: int, waited: float):
        self.pace, self.chars, self.waited = pace, chars, waited
        self._prefilling, self._released = True, False

    def prefilled(self) -> None:
        self.pace._end_prefill(self, measured=True)

    def release(self) -> None:
        self.pace._release(self)


class ModelPace:
    """The grader's queue for one model: first come, first served, admitted as ``Capacity`` and the
    measured prefill speed allow (see the module's docstring)."""

    def __init__(self, capacity, budget_s: float):
        self._capacity = capacity  # () -> Capacity, read at each admission
        self.budget_s = budget_s
        self.meter = PrefillMeter()
        self._cond = threading.Condition()
        self._queue: deque = deque()
        self.in_flight = 0
        self.prefilling = 0
        self.prefill_chars = 0
        self.most_in_flight = 0
        self._changed_at: float | None = None  # when ``prefilling`` last changed
        self._busy = 0.0  # seconds with a prompt in prefill since the last speed observation

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def _room(self, chars: int, capacity: Capacity) -> bool:
        if self.in_flight >= capacity.decode_slots:
            return False
        if self.prefilling == 0:
            return True
        if capacity.prefill_slots is not None and self.prefilling >= capacity.prefill_slots:
            return False
        rate = self.meter.rate
        return rate is not None and (self.prefill_chars + chars) / rate <= self.budget_s

    def admit(self, chars: int, stop: threading.Event) -> Turn:
        """Wait for this request's turn; ``GradingStopped`` if ``stop`` is set first."""
        started = time.monotonic()
        me = object()
        with self._cond:
            self._queue.append(me)
            try:
                while True:
                    if stop.is_set():
                        raise GradingStopped("the batch is stopping: this request was not sent")
                    if self._queue[0] is me and self._room(chars, self._capacity()):
                        break
                    self._cond.wait(WAIT_TICK)
            finally:
                self._queue.remove(me)
                self._cond.notify_all()
            self._account()
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self.prefilling += 1
            self.prefill_chars += chars
        return Turn(self, chars, time.monotonic() - started)

    def _account(self) -> None:
        """Count the time since the last change if a prompt was in prefill (the lock held, before
        ``prefilling`` changes)."""
        now = time.monotonic()
        if self.prefilling and self._changed_at is not None:
            self._busy += now - self._changed_at
        self._changed_at = now

    def _end_prefill(self, turn: Turn, measured: bool) -> None:
        with self._cond:
            if not turn._prefilling:
                return
            turn._prefilling = False
            self._account()
            self.prefilling -= 1
            self.prefill_chars -= turn.chars
            if measured:  # the prefill time since the last observation evaluated (at least) this prompt
                self.meter.observe(turn.chars, self._busy)
                self._busy = 0.0
            self._cond.notify_all()

    def _release(self, turn: Turn) -> None:
        self._end_prefill(turn, measured=False)  # failed or stopped before its first token: no speed learnt
        with self._cond:
            if turn._released:
                return
            turn._released = True
            self.in_flight -= 1
            self._cond.notify_all()


class ClusterPace:
    """A ``ModelPace`` per model of ``client``; ``stop`` (an Event) makes waiting and running requests end."""

    def __init__(self, client, stop: threading.Event | None = None, budget_share: float = PREFILL_BUDGET_SHARE):
        self.client = client
        self.stop = stop or threading.Event()
        timeout = getattr(client, "prefill_timeout", None) or DEFAULT_PREFILL_TIMEOUT
        self.budget_s = float(timeout) * budget_share
        self._models: dict[str, ModelPace] = {}
        self._lock = threading.Lock()

    def model_key(self, name: str) -> str:
        config = getattr(self.client, "config", None)
        try:
            return config.resolve_model(name) if config is not None else name
        except Exception:  # an unknown model: the client reports it when asked
            return name

    def of(self, name: str) -> ModelPace:
        key = self.model_key(name)
        with self._lock:
            if key not in self._models:
                self._models[key] = ModelPace(lambda: capacity_of(self.client, key), self.budget_s)
            return self._models[key]

    def snapshot(self) -> dict:
        """Per model: requests in flight, in their prefill phase, waiting here; the measured prompt speed."""
        with self._lock:
            models = dict(self._models)
        return {key: {"in_flight": p.in_flight, "prefilling": p.prefilling, "waiting": p.waiting,
                      "most_in_flight": p.most_in_flight,
                      "prompt_chars_per_s": round(p.meter.rate, 1) if p.meter.rate else None}
                for key, p in models.items()}

    # -- requests ------------------------------------------------------------------------------

    def generate(self, **kwargs) -> tuple[str, dict]:
        """One request, when its model has room; ``(text, metrics)`` like ``client.generate``, with
        ``paced_wait`` (seconds it waited here, not counted in the metrics' ``total_time``)."""
        prompt = kwargs.get("prompt") or ""
        turn = self.of(kwargs["model"]).admit(len(prompt), self.stop)
        try:
            if hasattr(self.client, "stream"):
                text, metrics = self._stream(kwargs, turn)
            else:  # a client without streams (a test's fake): the whole answer at once, not cancellable
                text, metrics = self.client.generate(**kwargs)
                turn.prefilled()
        finally:
            turn.release()
        return text, {**metrics, "paced_wait": round(turn.waited, 6)}

    def _stream(self, kwargs: dict, turn: Turn) -> tuple[str, dict]:
        pieces, metrics = [], None
        stream = self.client.stream(**kwargs, on_route=lambda route: turn.prefilled())
        try:
            for item in stream:
                if isinstance(item, dict):
                    metrics = item
                else:
                    pieces.append(item)
                if self.stop.is_set() and metrics is None:
                    raise GradingStopped("the batch is stopping: this request was cancelled")
        finally:
            stream.close()  # early: closes the connection, and the decode server cancels the job
        return "".join(pieces), metrics

    def generate_many(self, requests_: list[dict], max_workers=None) -> tuple[list, dict]:
        """``client.generate_many``'s contract, paced: each request in its own thread, results in order
        (an exception is a result), and the overlap of the requests' own times (waiting here excluded)."""
        if not hasattr(self.client, "stream"):
            return self._generate_many_at_once(requests_)
        started = time.perf_counter()
        results: list = [None] * len(requests_)

        def run(i: int, kwargs: dict) -> None:
            try:
                results[i] = self.generate(**kwargs)
            except Exception as exc:  # reported per request, never lost
                results[i] = exc

        threads = [threading.Thread(target=run, args=(i, kwargs), name=f"grading-request-{i}", daemon=True)
                   for i, kwargs in enumerate(requests_)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - started
        request_time = sum(r[1]["total_time"] for r in results if isinstance(r, tuple))
        return results, {**overlap_figures(request_time, wall), "requests": len(results),
                         "failed": sum(1 for r in results if not isinstance(r, tuple))}

    def _generate_many_at_once(self, requests_: list[dict]) -> tuple[list, dict]:
        """A client without streams (a test's fake): take every request's turn, in the models' order (so
        that two rounds never hold one model's turn each while waiting for the other's), then the
        client's own ``generate_many``."""
        turns = []
        try:
            for kwargs in sorted(requests_, key=lambda k: self.model_key(k["model"])):
                turns.append(self.of(kwargs["model"]).admit(len(kwargs.get("prompt") or ""), self.stop))
            results, combined = self.client.generate_many(requests_)
        except GradingStopped as exc:
            return [exc] * len(requests_), {**overlap_figures(0.0, 0.0), "requests": len(requests_),
                                             "failed": len(requests_)}
        finally:
            for turn in turns:
                turn.prefilled()
                turn.release()
        return results, combined
