"""How a server process is tuned at its start: glibc's copy threshold, OpenMP's wait policy.

Both are read by a library only when the process starts (the dynamic loader, libgomp), so the
launcher (ops/launch.py) puts them in the server's environment; the server reports what it got.

**Large copies bypass the CPU cache.** The KV export and import are llama.cpp
copying a prompt's KV between its cache tensors and a buffer, one ``memcpy``
per layer for keys and one for values (770 KB each at 2k tokens of SmolLM2,
megabytes in production). glibc's x86 ``memcpy`` stores non-temporally only
from a threshold sized from the L3 cache (41 MiB on the development machine),
so each of these copies first reads every cache line it is about to overwrite:
they ran at about 60% of the speed of one large copy. Setting glibc's
``x86_non_temporal_threshold`` tunable to ``non_temporal_copy_bytes`` (default
256 KiB) made both about a quarter faster there (docs/benchmarks.md).
It applies to glibc on x86-64 Linux only; elsewhere (macOS, ARM) nothing is set. An operator's own setting of the
same tunable in ``GLIBC_TUNABLES`` wins.

**llama.cpp's CPU threads spin unless the machine is shared.** The CPU build
runs each op of the graph on an OpenMP team and meets a barrier after it.
OpenMP's default makes a thread that reaches a barrier spin for a while before
it sleeps; ``OMP_WAIT_POLICY=PASSIVE`` makes it sleep at once. Measured on the
2-core development machine (docs/benchmarks.md, "Throughput under
concurrency"): a decode server alone on the machine with 8 requests generating
ran at about half its rate when its threads slept at every barrier; but four
servers of two threads each sharing those 2 cores collapsed when they spun (at 8
concurrent requests, 0.04 requests/s against 0.6), since a spinning thread
holds a core while the partner it waits for is not running. So
``server.openmp_wait`` is ``auto`` by default: sleep when the config's
servers on this server's machine have more compute threads in all (each
engine's ``compute_threads``: llama.cpp's and torch's) than it has cores, spin otherwise; ``spin`` and ``sleep`` force
either. An operator's own ``OMP_WAIT_POLICY`` wins. PyTorch's CPU threads are an
OpenMP team too (its wheel's own libgomp reads the same variable): on the same
machine, loaded by other work, a 38-token forward of SmolLM2 with two torch
threads took 0.37-0.64 s with ``OMP_WAIT_POLICY=PASSIVE``, 1.8 s with libgomp's
default and 4.0-5.5 s with ``ACTIVE``.
"""
from __future__ import annotations

import os
import platform

TUNABLES = "GLIBC_TUNABLES"
NON_TEMPORAL = "glibc.cpu.x86_non_temporal_threshold"
MIN_NON_TEMPORAL_BYTES = 0x4040  # glibc ignores a smaller threshold
OPENMP_WAITS = ("auto", "spin", "sleep")  # server.openmp_wait


def openmp_wait(policy: str, compute_threads: int, cpus: int | None = None) -> str:
    """``spin`` or ``sleep`` for ``server.openmp_wait`` (``auto`` decided by the threads sharing the cores)."""
    if policy != "auto":
        return policy
    return "sleep" if compute_threads > (cpus or os.cpu_count() or 1) else "spin"


def glibc_on_x86() -> bool:
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):  # no such name outside glibc
        return False
    return libc.startswith("glibc") and platform.machine().lower() in ("x86_64", "amd64")


def with_copy_tunable(environ: dict, threshold: int) -> dict:
    """``environ`` with glibc told to copy ``threshold`` bytes and more with non-temporal stores.

    Unchanged for a threshold of 0, off glibc on x86-64, or when
    ``GLIBC_TUNABLES`` already names the tunable; other tunables are kept.
    """
    if not threshold or not glibc_on_x86() or _tunable(environ, NON_TEMPORAL) is not None:
        return environ
    current, setting = environ.get(TUNABLES, ""), f"{NON_TEMPORAL}={threshold}"
    return {**environ, TUNABLES: f"{current}:{setting}" if current else setting}


def copy_tunable_in_effect(environ=None) -> int | None:
    """The non-temporal copy threshold this process was started with; None for glibc's own."""
    value = _tunable(os.environ if environ is None else environ, NON_TEMPORAL)
    try:
        return None if value is None else int(value, 0)
    except ValueError:
        return None


def _tunable(environ, name: str) -> str | None:
    """The value ``GLIBC_TUNABLES`` in ``environ`` gives the tunable ``name`` (None: not given)."""
    for item in environ.get(TUNABLES, "").split(":"):
        key, sep, value = item.partition("=")
        if key == name and sep:
            return value
    return None
