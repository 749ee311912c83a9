"""The energy this server's machine has used, from the counters the machine has, read through Zeus.

Zeus (the ML.ENERGY project's library, ``pip install zeus``) reads:

- NVIDIA GPUs: NVML's total energy since the driver loaded (Volta and newer), device ``gpu<i>``;
- Linux CPUs: RAPL under ``/sys/class/powercap`` where it is readable (Intel, and AMD Zen's ``amd_energy``
  through the same interface), devices ``cpu<i>`` (the package) and ``dram<i>`` where the package has one;
- Apple Silicon: IOReport's energy model, without root (``zeus-apple-silicon``), devices ``soc_cpu``,
  ``soc_gpu``, ``soc_dram``, ``soc_ane``.

Counters are cumulative joules, read when asked (``/metrics``: ``disagg_energy_joules_total{device=...}``;
``/health``: the ``energy`` block). A machine with none of them (a VM, a container without
``/sys/class/powercap``) reports no figure and says why: never a made-up zero. Every server of one machine
reports the same counters (``machine`` names it), so a reader counts a machine once.
"""
from __future__ import annotations

import logging
import socket
import threading

_lock = threading.Lock()
_probe = None  # (readers, reasons) once tried


def _readers():
    """The counters this machine has: a list of (device, read() -> joules), and why the others are missing."""
    global _probe
    with _lock:
        if _probe is not None:
            return _probe
        readers, reasons = [], []
        try:
            logging.getLogger("zeus").setLevel(logging.ERROR)
            from zeus.device import get_cpus, get_gpus, get_soc
        except ImportError:
            _probe = ([], ["zeus is not installed (pip install zeus): no energy counter is read"])
            return _probe
        try:
            gpus = get_gpus()
            for i in range(len(gpus)):
                if gpus.supports_get_total_energy_consumption(i):
                    readers.append((f"gpu{i}", lambda i=i: gpus.get_total_energy_consumption(i) / 1000.0))
                else:
                    reasons.append(f"gpu{i}: NVML gives no total energy for this GPU (pre-Volta)")
        except Exception as exc:  # noqa: BLE001 - Zeus raises its own per platform
            reasons.append(f"no GPU counter (NVML, AMD SMI): {_short(exc)}")
        try:
            cpus = get_cpus()
            for i in range(len(cpus.cpus)):
                readers.append((f"cpu{i}", lambda i=i: cpus.get_total_energy_consumption(i).cpu_mj / 1000.0))
                if cpus.supports_get_dram_energy_consumption(i):
                    readers.append((f"dram{i}", lambda i=i: (cpus.get_total_energy_consumption(i).dram_mj or 0)
                                    / 1000.0))
        except Exception as exc:  # noqa: BLE001
            reasons.append(f"no CPU counter (RAPL under /sys/class/powercap): {_short(exc)}")
        try:
            soc = get_soc()
            for part in ("cpu_total", "gpu", "dram", "ane"):
                if f"{part}_mj" in soc.get_available_metrics():
                    label = "soc_cpu" if part == "cpu_total" else f"soc_{part}"
                    readers.append((label, lambda p=part: (getattr(soc.get_total_energy_consumption(), f"{p}_mj")
                                                           or 0) / 1000.0))
        except Exception as exc:  # noqa: BLE001
            reasons.append(f"no SoC counter (Apple Silicon, Jetson): {_short(exc)}")
        _probe = (readers, reasons)
        return _probe


def _short(exc: Exception) -> str:
    return str(exc).split(". ")[0].rstrip(".")[:120]


def machine_id() -> str:
    """What tells this machine from another: its host name and boot id (Linux) where readable."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{socket.gethostname()}:{f.read().strip()[:8]}"
    except OSError:
        return socket.gethostname()


def snapshot() -> dict:
    """``{"machine", "source", "joules": {device: J} or None, "reason": why none (or which are missing)}``."""
    readers, reasons = _readers()
    joules = {}
    for device, read in readers:
        try:
            joules[device] = round(float(read()), 3)
        except Exception as exc:  # noqa: BLE001 - a counter that fails now is reported, not raised
            reasons = [*reasons, f"{device}: {exc}"]
    return {"machine": machine_id(), "source": "zeus" if joules else None, "joules": joules or None,
            "reason": ("no energy counter on this machine: " + "; ".join(reasons)) if reasons and not joules else None,
            "missing": reasons if joules and reasons else None}
