"""Issue 18 item 4: a class at a time: several notebooks graded concurrently, results in order, resumable."""
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from disaggregated_inference.grading import deterministic_part, grade_batch, load_rubric
from disaggregated_inference.grading.cli import main
from disaggregated_inference.grading.connect import default_jobs
from .fakes import FakeGradingClient

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def rubric():
    return load_rubric(EXAMPLES / "rubric.yaml")


@pytest.fixture
def folder(tmp_path):
    src = EXAMPLES / "notebooks"
    dst = tmp_path / "class"
    dst.mkdir()
    for i in range(3):
        for name in ("good", "errors", "incomplete"):
            shutil.copy(src / f"{name}_sales_analysis.ipynb", dst / f"s{i}_{name}.ipynb")
    return dst


class SlowFake(FakeGradingClient):
    """Each round of requests takes a while; counts how many submissions are at the models at once."""

    def __init__(self):
        super().__init__()
        self.lock, self.active, self.most = threading.Lock(), 0, 0

    def generate_many(self, requests_, max_workers=None):
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
        time.sleep(0.05)
        try:
            with self.lock:  # the fake's queues and lists are not made for threads
                return super().generate_many(requests_, max_workers)
        finally:
            with self.lock:
                self.active -= 1


def test_jobs_grade_concurrently_in_order_with_the_same_results(folder, tmp_path, rubric):
    one = grade_batch(folder, rubric, SlowFake(), tmp_path / "one", jobs=1)
    fake = SlowFake()
    events = []
    many = grade_batch(folder, rubric, fake, tmp_path / "many", jobs=4, progress=events.append)
    assert fake.most > 1  # several notebooks were at the models at the same time
    names = [r["submission"]["name"] for r in many.results]
    assert names == sorted(names) == [r["submission"]["name"] for r in one.results]
    assert [deterministic_part(r) for r in many.results] == [deterministic_part(r) for r in one.results]
    finished = [e for e in events if e.name and e.status != "grading"]
    assert [e.done for e in finished] == list(range(1, 10)) and all(e.total == 9 for e in events)
    assert sum(1 for e in events if e.status == "grading") == 9
    # never more than --jobs grading at once; every notebook is waiting, grading or done
    assert max(e.grading for e in events) <= 4
    assert all(e.waiting + e.grading + e.done == 9 for e in events)
    # resumable: graded again, everything is kept
    again = grade_batch(folder, rubric, SlowFake(), tmp_path / "many", jobs=4)
    assert again.graded == [] and len(again.resumed) == 9


def test_default_jobs_are_the_decode_slots_of_the_model_with_the_fewest():
    def server(role, model, health, up=True):
        return SimpleNamespace(entry=SimpleNamespace(role=role, model=model), health=health, up=up)

    client = SimpleNamespace(servers={
        "p": server("prefill", "qwen", {"slots": {"total": 8}}),
        "d1": server("decode", "qwen", {"slots": {"total": 4, "busy": 1}}),
        "d2": server("decode", "qwen", {"slots": {"total": 2}}),
        "d3": server("decode", "gpt-oss", {"slots": {"total": 16}}, up=False),
        "d4": server("decode", "gpt-oss", {"slots": {"total": 3}}),
    })
    assert default_jobs(client) == 3  # qwen has 6, gpt-oss 3 (its server that is down is not counted)
    assert default_jobs(client, ("qwen",)) == 6
    not_reported = SimpleNamespace(servers={"d": server("decode", "qwen", {"loaded": True})})
    assert default_jobs(not_reported) == 2
    assert default_jobs(FakeGradingClient()) == 2


def test_jobs_must_be_positive(tmp_path, capsys):
    code = main([str(EXAMPLES / "notebooks"), "--rubric", str(EXAMPLES / "rubric.yaml"), "--out", str(tmp_path),
                 "--jobs", "0"])
    assert code == 2 and "--jobs must be at least 1" in capsys.readouterr().err
