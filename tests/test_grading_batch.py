"""Issue 34 on a FAKE cluster (tests/fakes.py: canned answers, streams timed by sleeps): a batch's
figures against the clock, progress that tells waiting from grading, the pace that keeps each model
within its slots, and a stop that starts nothing more, cancels what is in flight and resumes.

The same on real servers (tiny generated models) and the command line under SIGINT: test_grading_class.py.
"""
import json
import threading
import time
from pathlib import Path

import pytest

from disaggregated_inference.errors import GradingStopped
from disaggregated_inference.grading import grade_batch, load_rubric
from disaggregated_inference.grading.batch import BatchProgress
from disaggregated_inference.grading.classgen import NAMES, generate_class
from disaggregated_inference.grading.cli import Interrupts
from .fakes import FakeGradingClient, StreamingFakeClient
from disaggregated_inference.grading.pace import Capacity, ModelPace

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def rubric():
    return load_rubric(EXAMPLES / "rubric.yaml")


@pytest.fixture(scope="module")
def klass(tmp_path_factory):
    folder = tmp_path_factory.mktemp("class")
    generate_class(folder, 8)
    return folder


def names(n: int) -> list[str]:
    return [f"s{i:02d}" for i in range(1, n + 1)]


def test_the_summary_is_the_clock_s(klass, tmp_path, rubric):
    fake = StreamingFakeClient(prefill_s=0.1, piece_s=0.1)  # half a second per request
    wall_clock, before = time.monotonic(), time.time()
    batch = grade_batch(klass, rubric, fake, tmp_path, jobs=4)
    wall_clock, after = time.monotonic() - wall_clock, time.time()
    summary = json.loads((tmp_path / "summary.json").read_text())
    run, inf = summary["run"], summary["inference"]
    assert summary == batch.summary and run["graded"] == 8 and not run["stopped"]
    # the run's wall time is the batch's, start to end: within the clock read around it (the reports
    # written after it and the notebooks found before it are the difference); the sum of the notebooks'
    # own wall times, which the summary used to call its wall time, exceeds it when they overlap
    assert wall_clock - 1.0 < run["wall_time_s"] <= wall_clock
    assert before - 1 <= _epoch(run["started_at"]) <= _epoch(run["ended_at"]) <= after + 1
    # requests in flight = the requests' own time over that wall time; each notebook keeps its own figures
    request_time = sum(r["inference"]["request_time"] for r in batch.results)
    assert inf["request_time"] == pytest.approx(request_time, abs=1e-3) == run["request_time_s"]
    assert inf["wall_time"] == run["wall_time_s"]
    assert run["requests_in_flight"] == inf["overlap"] == pytest.approx(request_time / run["wall_time_s"], rel=1e-2)
    assert run["notebooks_per_minute"] == pytest.approx(8 / run["wall_time_s"] * 60, rel=1e-2)
    assert inf["requests"] == sum(len(r["inference"]["requests"]) for r in batch.results) >= 16
    md = (tmp_path / "summary.md").read_text()
    assert "this run: 8 graded, 0 kept from an earlier run; " in md
    assert f" s from {run['started_at']} to {run['ended_at']} (" in md

    # a second run keeps everything: its own (short) wall time, no request, nothing in flight
    again = grade_batch(klass, rubric, fake, tmp_path, jobs=4).summary
    assert again["run"]["graded"] == 0 and again["run"]["kept"] == 8 and again["inference"]["requests"] == 0
    assert again["run"]["requests_in_flight"] is None and again["graded"] == 8


def _epoch(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso).timestamp()


def test_progress_tells_waiting_from_grading_and_estimates_the_time_left(klass, tmp_path, rubric):
    events: list[BatchProgress] = []
    grade_batch(klass, rubric, StreamingFakeClient(prefill_s=0.02, piece_s=0.05), tmp_path, jobs=2,
                progress=events.append)
    assert all(e.total == 8 and e.waiting + e.grading + e.done == 8 for e in events)
    assert max(e.grading for e in events) == 2  # --jobs 2: two graded at once, the others waiting
    assert events[0].waiting == 7 and events[0].grading == 1 and events[0].status == "grading"
    first_done = next(i for i, e in enumerate(events) if e.done)
    assert all(e.eta_s is None for e in events[:first_done]) and events[first_done].eta_s > 0
    assert events[-1].final and events[-1].done == 8 and events[-1].grading == 0
    started = [e.name for e in events if e.status == "grading"]
    assert started == names(8)  # started in order, each once


def test_the_pace_keeps_each_model_within_its_decode_slots(klass, tmp_path, rubric):
    servers = [{"name": f"{role}-{model}", "role": role, "model": model, "up": True, "slots": 2}
               for model in ("qwen", "gpt-oss") for role in ("prefill", "decode")]
    fake = StreamingFakeClient(prefill_s=0.03, piece_s=0.03, servers=servers)
    batch = grade_batch(klass, rubric, fake, tmp_path, jobs=8)  # more notebooks at once than slots
    assert batch.graded == names(8)
    assert fake.most_open == {"qwen": 2, "gpt-oss": 2}  # never more than the 2 slots, and the 2 used
    assert all(v["most_in_flight"] == 2 for v in batch.summary["run"]["pace"].values())
    waited = [a["metrics"]["paced_wait"] for r in batch.results for a in r["layers"]["analysis"]["answers"]]
    assert max(waited) > 0  # the rest waited at the grader, not at the servers


def test_prompts_go_to_prefill_as_the_measured_speed_allows():
    pace = ModelPace(lambda: Capacity(decode_slots=8, prefill_slots=8), budget_s=10.0)
    stop = threading.Event()
    first = pace.admit(1000, stop)  # nothing in prefill: always let through
    admitted = []
    waiting = threading.Thread(target=lambda: admitted.append(pace.admit(1000, stop)), daemon=True)
    waiting.start()
    waiting.join(0.5)
    assert not admitted  # no speed measured yet: one prompt at a time
    first.prefilled()
    waiting.join(5)
    assert len(admitted) == 1 and pace.prefilling == 1
    pace.meter.chars, pace.meter.busy = 1000, 5.0  # 200 characters per second: 2,000 fit in the 10 s budget
    second = pace.admit(1000, stop)  # 2,000 characters in prefill: 10 s at the measured speed
    assert pace.prefilling == 2
    refused = []

    def third_request():
        try:
            admitted.append(pace.admit(500, stop))
        except GradingStopped as exc:
            refused.append(exc)

    third = threading.Thread(target=third_request, daemon=True)
    third.start()
    third.join(0.5)
    assert len(admitted) == 1  # 2,500 characters would take 12.5 s: it waits
    stop.set()
    third.join(5)
    assert not third.is_alive() and len(admitted) == 1 and len(refused) == 1  # a stop ends the wait
    for turn in (admitted[0], second, first):
        turn.release()
    assert pace.in_flight == 0 and pace.prefilling == 0 and pace.waiting == 0
    with pytest.raises(GradingStopped):  # once stopping, nothing more is sent, room or not
        pace.admit(10, stop)


class SomeFastOthersSlow(StreamingFakeClient):
    """The requests about the first ``fast`` students of the class end at once; the others' streams take
    about ``slow`` seconds."""

    def __init__(self, fast: int, slow: float):
        super().__init__(pieces=40)
        self.fast, self.slow = [f"Student: {name}" for name in NAMES[:fast]], slow

    def piece_delay(self, index: int) -> float:
        prompt = self.calls[index]["prompt"]
        return 0.0 if any(student in prompt for student in self.fast) else self.slow / self.pieces


def test_a_stop_starts_nothing_more_cancels_what_is_in_flight_and_resumes(klass, tmp_path, rubric):
    fake = SomeFastOthersSlow(fast=2, slow=30.0)  # s01 and s02 at once, the others' streams 30 s
    stop = threading.Event()
    stopped_at = []

    def progress(p: BatchProgress) -> None:
        if p.done == 2 and p.grading == 2 and not stop.is_set() and p.name is None:
            time.sleep(0.2)  # the two next notebooks' streams are open
            stopped_at.append(time.monotonic())
            stop.set()

    batch = grade_batch(klass, rubric, fake, tmp_path, jobs=2, progress=progress, stop=stop)
    took = time.monotonic() - stopped_at[0]
    assert took < 3.0  # the open streams were closed, not waited for (30 s each)
    assert batch.stopped and batch.graded == ["s01", "s02"] and batch.not_graded == names(8)[2:]
    assert fake.opened == 8 and fake.closed_early == 4  # s03 and s04: both requests cancelled; s05- never sent
    assert sorted(p.stem for p in tmp_path.glob("*.json")) == ["s01", "s02", "summary"]
    assert not list(tmp_path.glob("*.tmp"))
    for name in ("s01", "s02"):
        assert json.loads((tmp_path / f"{name}.json").read_text())["status"] in ("graded", "needs_review")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["run"]["stopped"] and summary["run"]["not_graded"] == 6 and summary["submissions"] == 2
    assert "6 not graded (stopped; run again to continue)" in (tmp_path / "summary.md").read_text()
    assert "2 notebooks graded in this run" in batch.describe_stop() and "run the same command again" in \
        batch.describe_stop()

    # the same batch again grades the rest only
    again = grade_batch(klass, rubric, StreamingFakeClient(), tmp_path, jobs=2)
    assert again.resumed == ["s01", "s02"] and again.graded == names(8)[2:] and not again.stopped
    assert again.summary["submissions"] == 8


def test_an_exception_in_the_calling_thread_stops_the_batch_then_propagates(klass, tmp_path, rubric):
    fake = SomeFastOthersSlow(fast=1, slow=30.0)  # s01 at once

    def progress(p: BatchProgress) -> None:
        if p.done == 1 and p.name is None:
            raise KeyboardInterrupt

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        grade_batch(klass, rubric, fake, tmp_path, jobs=2, progress=progress)
    assert time.monotonic() - started < 10
    assert fake.closed_early >= 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["run"]["stopped"] and summary["run"]["graded"] == 1 and summary["run"]["not_graded"] == 7
    assert sorted(p.stem for p in tmp_path.glob("*.json")) == ["s01", "summary"]
    assert json.loads((tmp_path / "s01.json").read_text())["submission"]["name"] == "s01"


def test_a_fake_without_streams_is_paced_too(klass, tmp_path, rubric):
    batch = grade_batch(klass, rubric, FakeGradingClient(), tmp_path, jobs=3)
    assert batch.graded == names(8) and batch.summary["run"]["servers_marked_down"] == []


def test_interrupts_stop_a_batch_and_abort_anything_else():
    interrupts = Interrupts()
    with pytest.raises(KeyboardInterrupt):  # before grading: Ctrl-C aborts (the cluster is stopped on the way out)
        interrupts(2, None)
    interrupts.count = 0
    with interrupts.during_grading() as stop:
        interrupts(2, None)  # while grading: the batch is asked to stop, nothing is raised
        assert stop.is_set()
    assert interrupts.phase == "finishing"
