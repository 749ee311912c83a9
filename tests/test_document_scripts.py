"""The design documents' script names (seeds 001 and 004) run the scripts that exist here.

Each is a thin wrapper under scripts/ that execs its counterpart with the same arguments;
docs/DEPLOYMENT.md lists them in one table. Checked by running both with ``--help`` and,
for the shell scripts, a dry run on the production config (stand-ins for ssh and rsync on
PATH record any call: a dry run makes none).
"""
from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
PRODUCTION = ROOT / "deploy" / "config.production.json"
WRAPPERS = {  # the documents' name -> what it runs
    "start_dgx_servers.sh": "start_prefill_servers.sh",
    "start_mac_servers.sh": "start_decode_servers.sh",
    "stop_all_servers.sh": "stop_all.sh",
    "deploy_to_machines.sh": "deploy.sh",
}
DASHBOARD = ("monitor_dashboard.py", "-m disaggregated_inference.webui")


def env_without_tools(tmp_path: Path) -> tuple[dict, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.log"
    for tool in ("ssh", "rsync"):
        exe = bin_dir / tool
        exe.write_text(f'#!/bin/sh\necho "{tool} $*" >> "{calls}"\nexit 0\n')
        exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "DISAGG_PYTHON": sys.executable}
    env.pop("DISAGG_CONFIG", None)
    return env, calls


def run(cmd: list, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_each_document_script_runs_its_counterpart(wrapper, tmp_path):
    env, calls = env_without_tools(tmp_path)
    target = WRAPPERS[wrapper]
    assert os.access(SCRIPTS / wrapper, os.X_OK)  # ./scripts/NAME works as the documents call it
    mine, theirs = run([SCRIPTS / wrapper, "--help"], env), run(["bash", SCRIPTS / target, "--help"], env)
    assert mine.returncode == theirs.returncode == 0, mine.stderr
    assert mine.stdout == theirs.stdout and f"Usage: {target}" in mine.stdout
    dry = ["-n", "--config", PRODUCTION]
    mine, theirs = run([SCRIPTS / wrapper, *dry], env), run(["bash", SCRIPTS / target, *dry], env)
    assert mine.returncode == theirs.returncode == 0, mine.stderr
    assert mine.stdout == theirs.stdout and "169.254.150." in mine.stdout
    assert not calls.exists(), calls.read_text()
    bad = run([SCRIPTS / wrapper, "--no-such-option"], env)
    assert bad.returncode == 2 and "--no-such-option" in bad.stderr


def test_monitor_dashboard_runs_the_web_interface(tmp_path):
    env, _ = env_without_tools(tmp_path)
    mine = run([sys.executable, SCRIPTS / DASHBOARD[0], "--help"], env)
    theirs = run([sys.executable, *DASHBOARD[1].split(), "--help"], env)
    assert mine.returncode == theirs.returncode == 0, mine.stderr
    assert mine.stdout == theirs.stdout and "--local-cluster" in mine.stdout


def test_deployment_guide_lists_every_document_script_with_what_it_runs():
    text = (ROOT / "docs" / "DEPLOYMENT.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+\.(?:sh|py))` \| `scripts/\1` \| .*?`([^`]+)`", text, re.M))
    expected = {**{name: f"scripts/{target}" for name, target in WRAPPERS.items()},
                DASHBOARD[0]: f"python {DASHBOARD[1]}"}
    assert rows == expected
