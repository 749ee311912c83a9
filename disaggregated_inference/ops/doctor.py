"""``disagg doctor``: check a running cluster before its first request.

What it checks, each failure a row with a fix:

- every server answers ``/health`` and has its model loaded;
- each prefill/decode pair of one model would accept each other's bundles: the fingerprints
  (library version, model digest, flash_attn, KV types, ...) are compared as the decode server
  compares them at request time (``kv.fingerprint.differences``), and the decode side's context
  must hold every prompt the prefill side takes;
- the data path: each decode server pulls a test blob from each prefill server of its model
  (``POST /kv/probe`` on the decode server, ``GET /kv/probe`` on the prefill server, the path and
  token a KV bundle takes); the throughput and a KV-bytes-per-token figure measured by one small
  real prefill give the handoff time of 2k/8k/32k-token prompts; each decode server keeps its last
  probe's throughput (``disagg_kv_probe_bytes_per_second``), the capacity the dashboards show;
- the API token: the client's token opens every server, and every server the config gives a
  token really requires one; clocks within a few seconds of this machine's.

Exit status (through ``ops.cli``): 0 when nothing is wrong, 1 when a problem was found.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import requests

from ..kv import fingerprint as fp
from ..kv import neutral

PROMPT_LENGTHS = (2048, 8192, 32768)
MAX_CLOCK_SKEW_S = 5.0
SAMPLE_PROMPT = "The quarterly sales report lists revenue by region, product line and month. " * 8

KV_KINDS = ("llama_seq_state", "neutral_kv")  # the kinds that move KV (token_ids recomputes)


@dataclass
class Problem:
    where: str
    problem: str
    fix: str


@dataclass
class Report:
    servers: list = field(default_factory=list)    # one dict per server
    pairs: list = field(default_factory=list)      # one dict per prefill -> decode pair
    problems: list = field(default_factory=list)   # Problem

    def to_dict(self) -> dict:
        return {"ok": not self.problems, "servers": self.servers, "pairs": self.pairs,
                "problems": [asdict(p) for p in self.problems]}


class Doctor:
    def __init__(self, cfg, api_token: str | None = None, probe_bytes: int = 4 << 20, timeout: float = 30.0):
        self.cfg = cfg
        self.token = api_token if api_token is not None else cfg.client.get("api_token")
        self.probe_bytes = probe_bytes
        self.timeout = timeout
        self.report = Report()
        self.http = requests.Session()
        if self.token:
            self.http.headers["Authorization"] = f"Bearer {self.token}"

    def problem(self, where: str, what: str, fix: str) -> None:
        self.report.problems.append(Problem(where, what, fix))

    # -- the checks --------------------------------------------------------------------------------

    def run(self) -> Report:
        self._check_config_tokens()
        health = {entry.name: self._check_server(entry) for entry in self.cfg.servers}
        for model in self.cfg.models:
            prefills = [e for e in self.cfg.prefill_servers if e.model == model and health.get(e.name)]
            decodes = [e for e in self.cfg.decode_servers if e.model == model and health.get(e.name)]
            handing_over = [e for e in prefills if health[e.name].get("handoff") in KV_KINDS]
            per_token = self._kv_bytes_per_token(handing_over[0]) if handing_over else None
            for p in prefills:
                for d in decodes:
                    self._check_pair(model, p, health[p.name], d, health[d.name], per_token)
        self.http.close()
        return self.report

    def measure_links(self) -> list:
        """Only the data paths: each decode server pulls the probe from each prefill server of its model.
        The decode servers keep each result (``disagg_kv_probe_bytes_per_second``), which the dashboards
        show as the link's capacity. Returns the pairs' rows; problems go to the report as in ``run``."""
        for model in self.cfg.models:
            for p in (e for e in self.cfg.prefill_servers if e.model == model):
                for d in (e for e in self.cfg.decode_servers if e.model == model):
                    row = {"model": model, "prefill": p.name, "decode": d.name}
                    self.report.pairs.append(row)
                    self._measure_path(f"{model}: {p.name} -> {d.name}", p, d, row, None)
        self.http.close()
        return self.report.pairs

    def _check_config_tokens(self) -> None:
        server_token, client_token = self.cfg.server.get("api_token"), self.token
        if server_token and server_token != client_token:
            self.problem("config", "the servers require an API token the client does not send "
                         "(client.api_token differs from server.api_token)",
                         "set client.api_token to the servers' token (or DISAGG_API_TOKEN where the client runs)")

    def _check_server(self, entry) -> dict | None:
        where = f"{entry.role} {entry.name} ({entry.url})"
        row = {"name": entry.name, "role": entry.role, "model": entry.model, "url": entry.url, "state": "DOWN"}
        self.report.servers.append(row)
        started = time.time()
        try:
            resp = self.http.get(f"{entry.url}/health", timeout=self.timeout)
            health = resp.json()
        except (requests.RequestException, ValueError) as exc:
            row["error"] = f"{type(exc).__name__}"
            self.problem(where, f"not reachable: {type(exc).__name__}",
                         f"start it (disagg serve --config FILE --server {entry.name}) or fix host/port/firewall")
            return None
        finished = time.time()
        f = health.get("fingerprint") or {}
        row.update(state=health.get("status", "?"), loaded=bool(health.get("loaded")), backend=health.get("backend"),
                   library_version=f.get("library_version"), flash_attn=f.get("flash_attn"),
                   kv_types=f"{f.get('type_k')}/{f.get('type_v')}" if "type_k" in f else None,
                   n_ctx=f.get("n_ctx"), model_sha256=(f.get("model_sha256") or "")[:12] or None)
        if not health.get("loaded"):
            self.problem(where, f"model not loaded (status {health.get('status')}: "
                         f"{health.get('error') or health.get('progress')})",
                         "wait for the load to finish, or read the server log for why it failed")
            return None
        if "time" in health:
            skew = health["time"] - (started + finished) / 2
            row["clock_skew_s"] = round(skew, 2)
            if abs(skew) > MAX_CLOCK_SKEW_S:
                self.problem(where, f"clock {skew:+.1f} s from this machine's",
                             "run NTP (chrony/timesyncd) on every machine: lease expiry times are absolute")
        if self.cfg.server.get("api_token") and health.get("auth_required") is False:
            self.problem(where, "runs without an API token although the config sets one",
                         "restart it with the config's server.api_token (or DISAGG_API_TOKEN)")
        return health

    def _kv_bytes_per_token(self, prefill) -> float | None:
        """KV bytes per cached token, measured by one small real prefill (its lease given back)."""
        try:
            resp = self.http.post(f"{prefill.url}/prefill", json={"prompt": SAMPLE_PROMPT, "raw": True},
                                  timeout=self.timeout)
            body = resp.json()
            if resp.status_code != 200:
                self.problem(f"prefill {prefill.name}", f"a test prefill failed: {body.get('error')}",
                             "use the servers' token in client.api_token (or DISAGG_API_TOKEN)"
                             if resp.status_code == 401 else
                             "read the server log; a prefill server that cannot prefill serves no request")
                return None
            self.http.delete(f"{prefill.url}/kv/{body['kv']['handle']}", timeout=self.timeout)
            return body["kv"]["bytes"] / max(1, body["prompt_tokens"] - 1)
        except (requests.RequestException, ValueError, KeyError):
            return None

    def _check_pair(self, model, p, p_health, d, d_health, per_token) -> None:
        where = f"{model}: {p.name} -> {d.name}"
        row = {"model": model, "prefill": p.name, "decode": d.name, "compatible": True}
        self.report.pairs.append(row)
        ours, theirs = d_health.get("fingerprint") or {}, p_health.get("fingerprint") or {}
        kind, accepts = p_health.get("handoff"), d_health.get("accepts") or ()
        if kind == "neutral_kv" or (kind == "llama_seq_state" and kind not in accepts and "neutral_kv" in accepts):
            # another engine's K/V (or llama.cpp's, converted for the decoder): only the weights must agree
            diffs = [f"{key}: bundle has {theirs.get(key)!r}, this server has {ours.get(key)!r}"
                     for key in neutral.MODEL_KEYS if ours.get(key) != theirs.get(key)]
            row["kind"] = "neutral_kv"
        else:
            diffs = fp.differences(ours, theirs)
        if diffs:
            row["compatible"] = False
            self.problem(where, "the decode server would refuse every bundle: "
                         + "; ".join(diff.replace("bundle has", "prefill has").replace("this server", "decode")
                                     for diff in diffs),
                         "load the same GGUF file on both" if row.get("kind") == "neutral_kv" else
                         "run the same llama-cpp-python version, model file, flash_attn and type_k/type_v on both")
        if isinstance(ours.get("n_ctx"), int) and isinstance(theirs.get("n_ctx"), int) and ours["n_ctx"] < theirs["n_ctx"]:
            row["compatible"] = False
            self.problem(where, f"decode n_ctx {ours['n_ctx']} < prefill n_ctx {theirs['n_ctx']}: prompts in "
                         "between prefill and then fail on the decode server", "give both the same n_ctx")
        if kind not in KV_KINDS:
            row["path"] = "token ids only (prompt recomputed)"
            return
        self._measure_path(where, p, d, row, per_token)

    def _measure_path(self, where, p, d, row, per_token) -> None:
        probe_url = f"{(p.data_url or p.url).rstrip('/')}/kv/probe?bytes={self.probe_bytes}"
        try:
            resp = self.http.post(f"{d.url}/kv/probe", json={"url": probe_url}, timeout=self.timeout + 30)
            body = resp.json()
        except (requests.RequestException, ValueError) as exc:
            self.problem(where, f"data path not measured: {type(exc).__name__}", "check both servers' logs")
            return
        if resp.status_code == 401:
            self.problem(d.name, "the client's API token is refused", "use the servers' token in client.api_token")
            return
        if resp.status_code != 200:
            hint = ("the decode server's token is refused by the prefill server: give every server the same "
                    "server.api_token" if body.get("status_code") == 401 else
                    "make the prefill server's host:port (or data_url) reachable from the decode machine")
            self.problem(where, f"decode server cannot pull from the prefill server: {body.get('error')}", hint)
            return
        rate = body.get("bytes_per_second") or 0.0
        row["throughput_MB_s"] = round(rate / 1e6, 1)
        row["connect_ms"] = round(body["connect_seconds"] * 1000, 1)
        if per_token:
            row["kv_bytes_per_token"] = round(per_token)
            row["handoff_s"] = {str(n): round(body["first_byte_seconds"] + per_token * n / rate, 3) if rate else None
                                for n in PROMPT_LENGTHS}


def format_report(report: Report) -> str:
    lines = [f"{'server':26} {'role':8} {'model':10} {'state':9} {'library':8} {'flash':5} {'kv':9} {'n_ctx':>6}  digest"]
    for s in report.servers:
        lines.append(f"{s['name']:26} {s['role']:8} {s['model']:10} {s['state']:9} {str(s.get('library_version')):8} "
                     f"{str(s.get('flash_attn')):5} {str(s.get('kv_types')):9} {str(s.get('n_ctx')):>6}  "
                     f"{s.get('model_sha256') or s.get('error') or '-'}")
    if report.pairs:
        lines += ["", f"{'model':10} {'prefill -> decode':44} {'ok':3} {'MB/s':>8} {'KV B/tok':>9}  handoff 2k / 8k / 32k"]
        for r in report.pairs:
            times = r.get("handoff_s")
            handoff = " / ".join(f"{times[str(n)]:.3f}s" if times[str(n)] is not None else "-"
                                 for n in PROMPT_LENGTHS) if times else r.get("path", "-")
            lines.append(f"{r['model']:10} {r['prefill'] + ' -> ' + r['decode']:44} {'yes' if r['compatible'] else 'NO':3} "
                         f"{str(r.get('throughput_MB_s', '-')):>8} {str(r.get('kv_bytes_per_token', '-')):>9}  {handoff}")
    lines.append("")
    if not report.problems:
        lines.append("no problems found")
    else:
        lines.append(f"{len(report.problems)} problem(s):")
        for p in report.problems:
            lines += [f"  - {p.where}: {p.problem}", f"      fix: {p.fix}"]
    return "\n".join(lines)
