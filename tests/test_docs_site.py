"""The documentation: the site under docs/ builds with every link checked, and the README is a page.

The site is built as CI builds it, ``mkdocs build --strict`` with mkdocs.yml's validation settings:
a link to a missing page or file, an anchor no heading makes, a page left out of ``nav`` or a
``nav`` entry without its page is a warning, and strict makes a warning fail. A copy of the pages
with one such fault each shows that every one of them fails the build. The README's links lead to
files that exist (into docs/: to an anchor of the built page), and its examples run against a
real cluster of tiny models (the gateway included) as written, with only the addresses replaced.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LINK = re.compile(r"(?<!!)\[[^\]\n]+\]\(([^)\s]+)\)")
FENCED = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = build(ROOT / "mkdocs.yml", out)
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def test_the_site_builds_with_every_link_checked(site):
    assert (site / "index.html").is_file() and (site / "configuration" / "index.html").is_file()
    page = (site / "configuration" / "index.html").read_text()
    assert 'id="model-options"' in page and "<table>" in page  # the generated table, rendered


@pytest.fixture
def copy_of_the_docs(tmp_path) -> Path:
    """The repository with its own docs/ and mkdocs.yml: every other entry a link to the real one."""
    for entry in ROOT.iterdir():
        if entry.name in ("docs", "mkdocs.yml", ".git", "site"):
            continue
        (tmp_path / entry.name).symlink_to(entry)
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    return tmp_path


def append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


FAULTS = {  # what is broken -> (how, what the failed build names)
    "a link to a missing page": (lambda d: append(d / "docs" / "index.md", "\n[gone](no-such-page.md)\n"),
                                 "no-such-page.md"),
    "an anchor no heading makes": (lambda d: append(d / "docs" / "index.md", "\n[gone](configuration.md#no-such)\n"),
                                   "#no-such"),
    "a link to a missing repository file": (lambda d: append(d / "docs" / "production.md", "\n[gone](../no/such.py)\n"),
                                            "../no/such.py"),
    "an anchor a repository file lacks": (
        lambda d: append(d / "docs" / "production.md", "\n[gone](../deploy/README.md#no-such-heading)\n"),
        "#no-such-heading"),
    "a page left out of nav": (lambda d: (d / "docs" / "orphan.md").write_text("# Orphan\n"), "orphan.md"),
    "a nav entry without its page": (
        lambda d: append(d / "mkdocs.yml", "  - Missing: missing-page.md\n"), "missing-page.md"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_broken_link_or_page_fails_the_build(fault, copy_of_the_docs, tmp_path_factory):
    breaks, named = FAULTS[fault]
    breaks(copy_of_the_docs)
    built = build(copy_of_the_docs / "mkdocs.yml", tmp_path_factory.mktemp("broken-site"))
    output = built.stdout + built.stderr
    assert built.returncode != 0, output
    assert "Aborted" in output and named in output, output


def readme_links() -> list[str]:
    return [t for t in LINK.findall(README.read_text()) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def test_the_readme_links_lead_to_files_and_anchors_that_exist(site):
    links = readme_links()
    assert len([t for t in links if t.startswith("docs/")]) >= 10  # the README points into the site
    for target in links:
        path, _, anchor = target.partition("#")
        assert (ROOT / path).exists(), f"README.md links to {target}: no such file"
        if path.startswith("docs/") and path.endswith(".md"):
            page = Path(path).relative_to("docs").with_suffix("")
            html = site / ("index.html" if page.name == "index" else page / "index.html")
            assert html.is_file(), f"README.md links to {target}: the site has no page for it"
            if anchor:
                assert f'id="{anchor}"' in html.read_text(), f"README.md links to {target}: no such anchor"


def test_the_readme_is_short_and_opens_with_the_two_commands():
    text = README.read_text()
    assert len(text) < 15_000, f"README.md is {len(text)} characters: move detail into docs/"
    first = FENCED.search(text).group(2)
    assert first.splitlines()[1:] == ["bash scripts/install.sh && .venv/bin/disagg demo", "",
                                      "# the test suite (what CI runs)",
                                      "bash scripts/install.sh && .venv/bin/python -m pytest"]
    assert '`.venv/bin/python -m pytest -m "not slow"`' in text  # the quick tier


def readme_blocks(language: str) -> list[str]:
    return [body for lang, body in FENCED.findall(README.read_text()) if lang == language]


def test_the_readme_examples_run_as_written(tiny_cluster, tiny_gateway, tmp_path, monkeypatch):
    """Each example of the README against the tiny cluster: only its config file, ports and the
    gateway's address differ from ``disagg up``'s (config_current.json, 8100/8101, 8080)."""
    config = tmp_path / "cluster.json"
    config.write_text(json.dumps(tiny_cluster.config))
    urls = {p.entry.name: p.url.removeprefix("http://") for p in tiny_cluster.processes}
    addresses = {"localhost:8100": urls["local-prefill-qwen"], "localhost:8101": urls["local-decode-qwen"],
                 "http://127.0.0.1:8080": tiny_gateway}
    python = readme_blocks("python")
    assert len(python) == 3
    monkeypatch.chdir(tmp_path)
    for block in python:
        code = block.replace('"config_current.json"', json.dumps(str(config)))
        for written, real in addresses.items():
            code = code.replace(written, real)
        assert code != block, block  # each example names the cluster it talks to
        exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})

    shell = [b for b in readme_blocks("bash") if "curl " in b or "disagg generate" in b]
    assert len(shell) == 2
    missing = [tool for tool in ("curl", "jq") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"the README's curl example needs {' and '.join(missing)}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for block in shell:
        # the venv's command, as this interpreter runs it (PYTHONPATH: this checkout's code), on this cluster
        script = re.sub(r"\.venv/bin/disagg (\w+)", rf"{sys.executable} -m disaggregated_inference \1 --config {config}",
                        block)
        for written, real in addresses.items():
            script = script.replace(written, real)
        ran = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, capture_output=True,
                             text=True, env=env, timeout=300)
        assert ran.returncode == 0, ran.stdout + ran.stderr
        assert ran.stdout.strip(), script
    decoded = json.loads(ran.stdout)  # the curl example's last answer: a handoff's
    assert decoded["metrics"]["method"] == "kv_handoff" and decoded["metrics"]["prompt_tokens_recomputed"] <= 1


@pytest.mark.slow  # under a minute on 2 cores: four notebooks (one invalid), two models, on the tiny cluster
def test_the_readme_grader_example_grades_the_examples(tiny_cluster, tmp_path):
    """The README's grader command as written, on the running tiny cluster instead of one it starts
    (``--config`` for ``--local-cluster``: the same flags otherwise)."""
    config = tmp_path / "cluster.json"
    config.write_text(json.dumps(tiny_cluster.config))
    (block,) = [b for b in readme_blocks("bash") if "business_analytics_grader_v2.py" in b]
    words = block.replace("\\\n", " ").split()
    assert words[0] == ".venv/bin/python" and "--local-cluster" in words
    args = [sys.executable, *words[1:]]
    args[args.index("--local-cluster")] = f"--config={config}"
    args[args.index("--out") + 1] = str(tmp_path / "grades")
    ran = subprocess.run([*args, "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    out = tmp_path / "grades"
    assert (out / "gradebook.csv").is_file() and (out / "summary.json").is_file()
    reports = sorted(p.stem for p in out.glob("*.json") if p.stem != "summary")
    assert "good_sales_analysis" in reports and all((out / f"{r}.md").is_file() for r in reports)
