"""A client for the grader: to a running cluster named by a config, or to an embedded local one."""
from __future__ import annotations

import logging
import signal
from contextlib import contextmanager
from dataclasses import replace

from .. import config as cluster_config
from ..errors import GradingError


log = logging.getLogger(__name__)

_RUNNING: set = set()  # local clusters started here and not stopped yet (``kill_local_clusters``)


def start_local_cluster(config=None, timeout: float = 600.0, progress=None):
    """Start every server of ``config`` on this machine, on free ports; wait until all are healthy.

    Returns the ``LocalCluster``; its ``config`` (a dict) says where the servers listen.
    """
    from ..ops.cluster import LocalCluster

    cluster = LocalCluster(cluster_config.coerce(config if config is not None else cluster_config.load()),
                           free_ports=True)
    _RUNNING.add(cluster)
    try:
        cluster.start()
        cluster.wait_healthy(timeout=timeout, progress=progress)
    except BaseException:
        stop_local_cluster(cluster)
        raise
    return cluster


def deterministic(cfg):
    """``cfg`` with every llama.cpp server's steps batch-invariant (``deterministic``), whatever its model
    entry or the server's own override says: a grade must not depend on what else the cluster was doing
    (docs/ARCHITECTURE.md, Determinism). Other engines' servers are left as they are.

    On the CPU (``n_gpu_layers`` 0) with an f16 V cache, flash attention goes off too: its kernel splits
    a lone row's attention across the threads, so a lone request would need a padding row to compute as
    beside others, at about half a plain step's speed; without it the load measures the lone row exact
    (``model_info.lone_rows_exact``) and the last notebooks of a class, graded alone, decode at 0.9x of
    plain steps (issue 44; docs/ARCHITECTURE.md, "A lone request's speed"). Without flash attention a
    verify step's rows compute otherwise than one-token steps, so ``paired_steps`` goes on with it: the
    load keeps the paired layout only where it measures every guess exact, and guesses then verify
    (docs/ARCHITECTURE.md, "Paired steps"). Prefill and decode servers change alike (flash attention is
    in the handoff's fingerprint, and the canary says whether a side's steps are paired)."""
    def invariant(entry):
        settings = entry.settings
        if settings.get("backend") != "llama_cpp":
            return entry
        changed = {"deterministic": True}
        on_cpu = int(settings.get("n_gpu_layers") or 0) == 0
        if on_cpu and settings.get("type_v", "f16") == "f16" and settings.get("flash_attn", True):
            changed["flash_attn"] = False
        if on_cpu and not changed.get("flash_attn", settings.get("flash_attn", True)):
            changed["paired_steps"] = True
        if all(settings.get(k) == v for k, v in changed.items()):
            return entry
        return replace(entry, settings={**settings, **changed})

    return replace(cfg, prefill_servers=[invariant(e) for e in cfg.prefill_servers],
                   decode_servers=[invariant(e) for e in cfg.decode_servers])


def stop_local_cluster(cluster) -> None:
    """Stop it as ``LocalCluster.stop`` does (each server asked, then waited for); interrupted, it stays
    listed for ``kill_local_clusters``."""
    cluster.stop()
    _RUNNING.discard(cluster)


def hurry_local_clusters() -> None:
    """Ask every local cluster started here to stop without finishing what its servers are serving
    (gunicorn's quick shutdown, SIGINT; ``stop_local_cluster`` still waits for them): for a stopped
    batch, whose requests nobody waits for any more; a graceful stop would finish a prefill first."""
    for cluster in list(_RUNNING):
        for proc in cluster.processes:
            if proc.proc is not None and proc.proc.poll() is None:
                proc.proc.send_signal(signal.SIGINT)


def kill_local_clusters() -> None:
    """End every local cluster started here at once (SIGKILL to each server's process group): for a
    program that must exit now (a second Ctrl-C) without leaving servers behind."""
    for cluster in list(_RUNNING):
        for proc in [cluster.gateway, *cluster.processes]:
            if proc is not None:
                try:
                    proc.kill()
                except Exception:  # noqa: BLE001 - already gone, or not ours to wait for: go on with the others
                    pass
        _RUNNING.discard(cluster)


def require_servers(client, models=()) -> None:
    """Fail early, with a useful message, when no decode server of a needed model answers.

    (A model without a prefill server still works: its decode server generates alone.)
    """
    states = client.check_health()
    config = getattr(client, "config", None)
    keys = {config.resolve_model(m) if config else m for m in models} or {s["model"] for s in states}
    missing = [k for k in sorted(keys)
               if not any(s["role"] == "decode" and s["model"] == k and s["loaded"] for s in states)]
    if missing:
        where = ", ".join(f"{s['name']} ({s['url']}): {s['last_error'] or 'not loaded'}"
                          for s in states if s["model"] in missing) or "none configured"
        raise GradingError(f"no decode server answers for model {', '.join(missing)} [{where}]; start the "
                           "cluster (`disagg up`) or grade with --local-cluster")


def not_batch_invariant(client) -> list[str]:
    """The up llama.cpp servers whose steps are not batch-invariant (``/health`` ->
    ``model_info.deterministic`` false): their answers can move with what else they serve."""
    names = []
    for server in list(getattr(client, "servers", {}).values()):
        info = server.health.get("model_info") if server.up and isinstance(server.health, dict) else None
        if isinstance(info, dict) and info.get("deterministic") is False:
            names.append(server.entry.name)
    return sorted(names)


DEFAULT_JOBS = 2  # notebooks at once when no decode server reports its slots


def decode_slots_by_model(client) -> dict[str, int]:
    """Per model key: the ``slots.total`` its decode servers that are up reported on ``/health`` (as last
    checked); a model none of whose servers reported is absent."""
    per_model: dict[str, int] = {}
    for server in list(getattr(client, "servers", {}).values()):
        if server.entry.role != "decode" or not server.up:
            continue
        slots = (server.health.get("slots") or {}).get("total") if isinstance(server.health, dict) else None
        if isinstance(slots, int) and not isinstance(slots, bool) and slots > 0:
            per_model[server.entry.model] = per_model.get(server.entry.model, 0) + slots
    return per_model


def default_jobs(client, models=("qwen", "gpt-oss"), default: int = DEFAULT_JOBS) -> int:
    """Notebooks graded at once unless ``--jobs`` says: the decode slots of the graded model that has
    the fewest (each notebook has one request at a time at each model), or ``default`` when no server
    reports its slots. Chosen by measurement (docs/benchmarks.md, "Grading a class"): with the grader's
    pacing, more notebooks than that only wait at the pace; fewer leave slots idle."""
    config = getattr(client, "config", None)
    per_model = decode_slots_by_model(client)
    keys = set()
    for name in models:
        try:
            keys.add(config.resolve_model(name) if config is not None else name)
        except Exception:  # noqa: BLE001 - an unknown model is reported when it is asked for
            continue
    counts = [per_model[k] for k in keys if k in per_model]
    return min(counts) if counts else default


@contextmanager
def open_client(config=None, *, local_cluster: bool = False, timeout: float = 600.0, progress=None,
                models=("qwen", "gpt-oss")):
    """``with open_client(...) as client:`` - and the embedded cluster, if asked for, is stopped after."""
    from ..client import DisaggregatedClient

    cfg = cluster_config.coerce(config if config is not None else cluster_config.load())
    cluster = start_local_cluster(deterministic(cfg), timeout, progress) if local_cluster else None
    try:
        if cluster is not None:
            cfg = cluster_config.from_dict(cluster.config, f"{cfg.source} (embedded local cluster)")
        client = DisaggregatedClient(cfg)
        try:
            if models:
                require_servers(client, models)
            if (moving := not_batch_invariant(client)):
                log.warning("servers without deterministic steps: %s; a model's text may differ graded alone or "
                            "beside others (set deterministic: true on their llama.cpp models, or grade with "
                            "--local-cluster)", ", ".join(moving))
            yield client
        finally:
            client.close()
    finally:
        if cluster is not None:
            stop_local_cluster(cluster)
