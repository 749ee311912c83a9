"""Issue 42 §4: the service units confine the servers, and cannot slip back.

Every systemd unit in deploy/systemd is rated by ``systemd-analyze security --offline=true`` (systemd 252,
Debian 12's, has it; ``.ci/run`` installs it where missing) and must rate 4.0 or lower; the GPU servers keep
the NVIDIA and DRI device nodes; the launchd job parses and has the confinement macOS offers.
"""
from __future__ import annotations

import plistlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNITS = sorted((ROOT / "deploy" / "systemd").glob("*.service"))
PLIST = ROOT / "deploy" / "launchd" / "com.disaggregated-inference.decode.plist"
LIMIT = 4.0


def _settings(unit: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in unit.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith(("#", "[")) and "=" in line:
            key, value = line.split("=", 1)
            found.setdefault(key.strip(), []).append(value.strip())
    return found


def _analyze():
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd; .ci/run does)")
    probe = subprocess.run([tool, "security", "--help"], capture_output=True, text=True)
    if "--offline" not in probe.stdout:
        pytest.skip("this systemd-analyze has no --offline (systemd 250 or later has)")
    return tool


def test_there_are_units_for_prefill_decode_and_the_gateway():
    assert {u.name for u in UNITS} >= {"disagg-prefill@.service", "disagg-decode@.service", "disagg-gateway.service"}


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_every_unit_rates_4_or_lower(unit, tmp_path):
    tool = _analyze()
    # an instance name for the templates: systemd-analyze rates a unit file by its own name
    target = tmp_path / unit.name.replace("@.", "@check.")
    target.write_text(unit.read_text())
    result = subprocess.run([tool, "security", "--offline=true", "--no-pager", str(target)],
                            capture_output=True, text=True, timeout=60)
    rating = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", result.stdout + result.stderr)
    assert rating, result.stdout[-2000:] + result.stderr[-2000:]
    assert float(rating.group(1)) <= LIMIT, result.stdout


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_gpu_stays_reachable_from_the_servers(role):
    settings = _settings(ROOT / "deploy" / "systemd" / f"disagg-{role}@.service")
    assert "PrivateDevices" not in settings  # it would hide /dev/nvidia* and /dev/dri
    assert settings["DevicePolicy"] == ["closed"]
    allowed = " ".join(settings["DeviceAllow"])
    for group in ("char-nvidia-frontend", "char-nvidia-uvm", "char-drm"):
        assert f"{group} rw" in allowed
    assert settings["RestrictAddressFamilies"] == ["AF_INET AF_INET6 AF_UNIX"]
    assert settings["ProtectSystem"] == ["strict"] and settings["ProtectHome"] == ["read-only"]
    assert settings["CacheDirectory"] == ["disaggregated-inference"]  # the one writable place but /tmp


def test_the_gateway_has_no_devices_and_no_writable_executable_memory():
    settings = _settings(ROOT / "deploy" / "systemd" / "disagg-gateway.service")
    assert settings["PrivateDevices"] == ["yes"] and settings["MemoryDenyWriteExecute"] == ["yes"]
    assert "disagg gateway" in settings["ExecStart"][0]


def test_the_launchd_job_parses_and_is_confined():
    job = plistlib.loads(PLIST.read_bytes())
    assert job["UserName"] == job["GroupName"] == "_disagg"  # a dedicated account, not the admin's
    assert job["Umask"] == 0o027 and job["InitGroups"] is True and job["AbandonProcessGroup"] is False
    for limits in (job["SoftResourceLimits"], job["HardResourceLimits"]):
        assert limits["Core"] == 0 and limits["NumberOfFiles"] >= 4096 and limits["NumberOfProcesses"] >= 16
    assert job["SoftResourceLimits"]["NumberOfProcesses"] <= job["HardResourceLimits"]["NumberOfProcesses"]
    assert job["ProgramArguments"][1] == "serve"
