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

**Sharing the cores.** The CPU build runs each op of llama.cpp's graph on an
OpenMP team and meets a barrier after it, hundreds of times a step. A thread
that spins there keeps a step at the engine's speed while its partner runs;
one that sleeps at once (``OMP_WAIT_POLICY=PASSIVE``) pays a wake-up per
barrier: one request decoded at a quarter of llama.cpp's own server's speed on
the 2-core development machine. But spinning threads of servers that share
cores collapse (four servers of two threads on two cores: every request ended
in 503), because a spinning thread holds a core its partner waits for.

So the llama.cpp servers of a config that share a machine share its cores at
run time (``server.share_cores``, on by default; ``server/cores.py``): before
each step a server takes all its threads while the busy servers' threads fit
the cores, and its share of them (one thread each, on two cores) while they do
not. Their threads then never outnumber the cores, and they spin
(``openmp_wait: auto``), at most ``SHARED_SPIN_COUNT`` rounds (libgomp's
``GOMP_SPINCOUNT``) before they sleep: long enough to cover the waits at the
barriers of a step, short enough that a thread whose server has just gone
idle soon gives its core up (libgomp's default, 300,000 rounds, is
milliseconds). Other programs can still take the cores a spinning thread's
partner needs; a server whose steps show it (``cores.Contention``) computes
with one thread for a while. Measured on the development machine
(docs/benchmarks.md, "Against llama.cpp's own server").
Without sharing (``share_cores: false``, or a transformers server on the
machine, whose torch threads are an OpenMP team too and take no share),
``auto`` sleeps when the config's servers on this server's machine have more
compute threads in all (each engine's ``compute_threads``) than it has cores,
and spins (OpenMP's default) otherwise; ``spin`` and ``sleep`` force either. An
operator's own ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` wins. PyTorch's CPU
threads read the same variables (its wheel's own libgomp): on the same
machine, loaded by other work, a 38-token forward of SmolLM2 with two torch
threads took 0.37-0.64 s with ``OMP_WAIT_POLICY=PASSIVE``, 1.8 s with
libgomp's default and 4.0-5.5 s with ``ACTIVE``.
"""
from __future__ import annotations

import os
import platform

TUNABLES = "GLIBC_TUNABLES"
NON_TEMPORAL = "glibc.cpu.x86_non_temporal_threshold"
MIN_NON_TEMPORAL_BYTES = 0x4040  # glibc ignores a smaller threshold
OPENMP_WAITS = ("auto", "spin", "sleep")  # server.openmp_wait
# libgomp's spin rounds at a barrier before a thread sleeps, for servers that share their cores. 10,000 kept one
# model near the engine's speed where 1,000 lost a sixth of it, and two busy models as fast as 1,000 did, while
# libgomp's default (300,000) lost to both there (docs/benchmarks.md). 30,000 since issue 44: a bare token loop
# of SmolLM2 at 2 threads on the quiet machine ran 150-154 tok/s at 10,000, 155-159 at 30,000 and 160-166 at
# 100,000 (libgomp's default 156-162), and the decode servers with two models busy ran as fast at 30,000 as at
# 10,000 (137 against 139 tok/s, 158 against 159 at 8 at once: docs/benchmarks.md, "The spin count").
SHARED_SPIN_COUNT = 30000
# A step whose thread was on a CPU this share of its wall time ran on free cores: it computed, or spun at a barrier
# while its partner computed. Less, and it waited for a core some other work held. The step cost measurement counts
# only such steps (backends/llama_slots.py), and a server that left one thread for a while tries all of them again
# once its steps run so (server/cores.py, ``Contention.FREE``).
STEP_ON_CPU = 0.8


def openmp_wait(policy: str, compute_threads: int, cpus: int | None = None, shared: bool = False) -> str:
    """``spin`` or ``sleep`` for ``server.openmp_wait``. ``auto``: spin when the machine's servers share
    its cores at run time (``shared``: their threads then fit the cores), else sleep when their
    ``compute_threads`` are more than the cores."""
    if policy != "auto":
        return policy
    if shared:
        return "spin"
    return "sleep" if compute_threads > (cpus or os.cpu_count() or 1) else "spin"


def openmp_set_by_operator(environ) -> bool:
    """Whether ``environ`` already tells libgomp how to wait: an operator's own setting wins over ours."""
    return any(key in environ for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"))


def openmp_environment(wait: str, shared: bool) -> dict:
    """What a server's environment tells libgomp (read when llama.cpp or torch loads), for its resolved
    ``wait`` (``openmp_wait``): sleep at once at a barrier for ``sleep``; for ``spin`` with shared
    cores, spin at most ``SHARED_SPIN_COUNT`` rounds."""
    if wait == "sleep":
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    if shared:
        return {"GOMP_SPINCOUNT": str(SHARED_SPIN_COUNT)}
    return {}


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
