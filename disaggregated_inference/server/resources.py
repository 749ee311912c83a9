"""What a server reports about the machine it runs on: memory, CPU, GPU.

GPU figures come from NVML where an NVIDIA driver is present (``nvidia-ml-py``
installed) and from the unified memory on Apple Silicon; elsewhere ``gpu`` is
``None`` rather than a made-up zero.
"""
from __future__ import annotations

import os
import platform
import threading

import psutil

_process = psutil.Process(os.getpid())
_nvml_lock = threading.Lock()
_nvml = None  # None: not tried, False: unavailable, else the module


def _nvml_module():
    global _nvml
    with _nvml_lock:
        if _nvml is None:
            try:
                import pynvml  # provided by nvidia-ml-py

                pynvml.nvmlInit()
                _nvml = pynvml
            except Exception:
                _nvml = False
        return _nvml or None


def gpu_snapshot():
    nvml = _nvml_module()
    if nvml is not None:
        gpus = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            util = nvml.nvmlDeviceGetUtilizationRates(handle)
            gpus.append({"index": i, "name": str(nvml.nvmlDeviceGetName(handle)),
                         "utilization_pct": util.gpu, "memory_used_bytes": mem.used,
                         "memory_total_bytes": mem.total})
        return {"kind": "nvidia", "devices": gpus}
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        vm = psutil.virtual_memory()
        return {"kind": "apple_unified_memory", "memory_used_bytes": vm.total - vm.available,
                "memory_total_bytes": vm.total}
    return None


def snapshot() -> dict:
    with _process.oneshot():
        rss = _process.memory_info().rss
        cpu = _process.cpu_percent(interval=None)
        threads = _process.num_threads()
    vm = psutil.virtual_memory()
    return {
        "process_rss_bytes": rss,
        "process_cpu_pct": cpu,
        "process_threads": threads,
        "system_memory_used_pct": vm.percent,
        "system_cpu_pct": psutil.cpu_percent(interval=None),
        "gpu": gpu_snapshot(),
    }
