"""benchmarks/link.py's emulated link: made and removed by the script itself; refused clearly without root."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from benchmarks import link


def namespaces() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()


def test_without_root_it_says_so_and_stops_or_in_quick_json_mode_says_it_skipped(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert link.main(["--rate-gbit", "10"]) == 2
    assert "needs root" in capsys.readouterr().err
    assert link.main(["--quick", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "needs root" in out["skipped"] and out["machine"]["cpus"]


@pytest.mark.skipif(link.ShapedLink.unavailable() is not None, reason="needs root, Linux, ip and tc")
def test_the_shaped_link_is_made_and_removed_whatever_happens_in_between():
    shaped = link.ShapedLink(rate_gbit=10, delay_ms=0.1)
    with pytest.raises(RuntimeError, match="in between"):
        try:
            shaped.open()
            assert {shaped.prefill_ns, shaped.decode_ns} <= set(namespaces())
            qdisc = subprocess.run(["tc", "-n", shaped.prefill_ns, "qdisc", "show", "dev", shaped.prefill_dev],
                                   capture_output=True, text=True).stdout
            assert "tbf" in qdisc and "rate 10Gbit" in qdisc
            ping = shutil.which("ping")
            if ping:  # the two ends reach each other across the pair, and only there
                done = subprocess.run(["ip", "netns", "exec", shaped.decode_ns, ping, "-c", "1", "-W", "2",
                                       link.PREFILL_ADDR], capture_output=True)
                assert done.returncode == 0
            raise RuntimeError("something failed in between")
        finally:
            shaped.close()
    assert not {shaped.prefill_ns, shaped.decode_ns} & set(namespaces())
    assert subprocess.run(["ip", "link", "show", shaped.prefill_dev], capture_output=True).returncode != 0
