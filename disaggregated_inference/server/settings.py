"""What one server process needs to know: its role, its model, its limits.

A server gets its settings from, in order: the defaults here, then the cluster
config file and server name (``DISAGG_CONFIG`` + ``DISAGG_SERVER``) or a JSON
object in ``DISAGG_SERVER_SETTINGS`` (what ``disagg serve`` passes to gunicorn),
then a dict given to ``create_app`` (tests).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields, replace

from .. import config as cluster_config
from ..backends.base import DEFAULT_BACKEND, ModelSettings, settings_class
from ..backends.registry import backend_class
from ..errors import ConfigError
from ..tuning import openmp_wait

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class ServerSettings(cluster_config.ServerOptions):
    """One server: the cluster-wide limits (``ServerOptions``) plus its role, model and name."""

    role: str = "prefill"
    model: ModelSettings = field(default_factory=ModelSettings)
    name: str = ""
    data_url: str | None = None  # base URL peers use to fetch KV from this server
    aliases: tuple = ()
    kv_peers: tuple = ()  # decode: the cluster's prefill servers (data_url or host:port), trusted KV sources
    core_group: str = ""  # the servers sharing this one's cores (server/cores.py); "" = none

    @property
    def engine_model(self) -> ModelSettings:
        """The model's settings as this server loads them. A prefill server never samples, so it never
        speculates: it loads without a proposer and skips measuring the step cost speculation needs
        (about 20 small steps at load)."""
        if self.role == "prefill" and getattr(self.model, "speculation", "off") != "off":
            return replace(self.model, speculation="off")
        return self.model

    @property
    def trusted_kv_sources(self) -> tuple:
        return (*self.kv_peers, *self.kv_sources)

    def to_json(self) -> str:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "model"}
        data["model"] = {f.name: getattr(self.model, f.name) for f in fields(self.model)}
        data["aliases"] = list(self.aliases)
        return json.dumps(data)

    @classmethod
    def from_dict(cls, data: dict, where: str = "settings") -> "ServerSettings":
        data = dict(data)
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"{where}: unknown server setting {sorted(unknown)[0]!r}", field=sorted(unknown)[0])
        model = data.pop("model", {})
        if isinstance(model, dict):
            engine_settings = settings_class(model.get("backend", DEFAULT_BACKEND))
            unknown = set(model) - set(engine_settings.__dataclass_fields__)
            if unknown:
                raise ConfigError(f"{where}: unknown model setting {sorted(unknown)[0]!r}", field=f"model.{sorted(unknown)[0]}")
            model = engine_settings(**model)
        if data.get("role", "prefill") not in ROLES:
            raise ConfigError(f"{where}: role must be one of {ROLES}, got {data.get('role')!r}", field="role")
        for key in ("aliases", "kv_peers", "kv_sources", "canary_pairs"):
            data[key] = tuple(data.get(key, ()))
        return cls(model=model, **data)


def prefill_addresses(entries) -> tuple:
    """Where the KV of these prefill servers is fetched from: each one's ``data_url``, or its host:port."""
    return tuple(e.data_url or e.address for e in entries)


def cohosted(cfg: cluster_config.ClusterConfig, entry) -> list:
    """The config's servers on ``entry``'s machine, itself included."""
    return [other for other in (*cfg.prefill_servers, *cfg.decode_servers) if other.machine == entry.machine]


def compute_threads(cfg: cluster_config.ClusterConfig, entry) -> int:
    """CPU threads the servers of the config that share ``entry``'s machine compute with on OpenMP teams
    (its own included): servers whose host is the same, every loopback name counting as one machine."""
    return sum(engine_threads(ModelSettings.from_dict(other.settings)) for other in cohosted(cfg, entry))


def engine_threads(model: ModelSettings) -> int:
    """The CPU threads a server of ``model`` computes with on an OpenMP team (its engine's ``compute_threads``)."""
    return backend_class(model.backend).compute_threads(model)


def core_group(cfg: cluster_config.ClusterConfig, entry, share: bool) -> str:
    """The group whose servers share ``entry``'s cores at run time (server/cores.py), or "" for none: the
    config's llama.cpp servers on its machine, when ``share`` and they are the only ones computing on
    OpenMP teams there (a transformers server's torch threads take no share, so the cores stay
    counted the old way: ``tuning.openmp_wait``)."""
    servers = cohosted(cfg, entry)
    models = [ModelSettings.from_dict(other.settings) for other in servers]
    if not share or ModelSettings.from_dict(entry.settings).backend != "llama_cpp" \
            or any(m.backend != "llama_cpp" and engine_threads(m) for m in models):
        return ""
    return f"{cfg.source}:{','.join(sorted(other.name for other in servers))}"


def from_cluster(cfg: cluster_config.ClusterConfig, server_name: str, prefill_entries=None) -> ServerSettings:
    """One server's settings: its entry and model, and every key of the config's ``server`` section
    that is a setting here, as the type of that setting's default (a config's ``30`` is ``30.0``).
    A decode server's ``kv_peers`` are the config's prefill servers (or ``prefill_entries``, e.g. with
    the ports a local cluster actually bound)."""
    entry = cfg.find_server(server_name)
    model = ModelSettings.from_dict(entry.settings, name=entry.model)
    limits = {f.name: cfg.server[f.name] if f.default is None else type(f.default)(cfg.server[f.name])
              for f in fields(ServerSettings) if f.name in cfg.server}
    group = core_group(cfg, entry, limits.get("share_cores", True))
    limits["openmp_wait"] = openmp_wait(limits.get("openmp_wait", "auto"), compute_threads(cfg, entry),
                                        shared=bool(group))
    return ServerSettings(role=entry.role, model=model, name=entry.name, data_url=entry.data_url, core_group=group,
                          aliases=tuple(cfg.models[entry.model].get("aliases", ())),
                          kv_peers=prefill_addresses(cfg.prefill_servers if prefill_entries is None else prefill_entries),
                          **limits)


def resolve(override=None, role: str | None = None) -> ServerSettings:
    if isinstance(override, ServerSettings):
        settings = override
    else:
        raw = os.environ.get("DISAGG_SERVER_SETTINGS")
        if raw:
            try:
                settings = ServerSettings.from_dict(json.loads(raw), "DISAGG_SERVER_SETTINGS")
            except ValueError as exc:
                raise ConfigError(f"DISAGG_SERVER_SETTINGS is not valid JSON: {exc}") from None
        elif os.environ.get("DISAGG_SERVER"):
            settings = from_cluster(cluster_config.load(), os.environ["DISAGG_SERVER"])
        else:
            settings = ServerSettings(role=role or "prefill")
        if override:
            base = json.loads(settings.to_json())
            model, given = base.pop("model"), override.get("model", {})
            if given.get("backend", model["backend"]) != model["backend"]:  # the shared settings carry over
                model = {k: v for k, v in model.items() if k in ModelSettings.__dataclass_fields__}
            model = {**model, **given}
            base.update({k: v for k, v in override.items() if k != "model"})
            base["model"] = model
            settings = ServerSettings.from_dict(base, "create_app(config)")
    if role and settings.role != role:
        settings = replace(settings, role=role)
    return settings
