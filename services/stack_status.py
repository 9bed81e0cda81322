"""`deepinfer status`: what the stack started from a data dir is doing, read from its run file.

One line per process (pid, URL, whether it is the process that was started and is ready), then
the numbers an operator asks first: requests and tokens (rates averaged since the start), prompt
tokens served from the cache, TTFT, engine queues and pools, volume use. Exit 0: everything runs
and is ready; 1: something does not; 3: no stack runs from that data dir.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from services.common.config import load_config
from services.common.instance import INSTANCE_HEADER
from services.common.metrics_text import Samples, quantile
from services.launcher import StackConfig
from services.run_file import RunFile

NOT_RUNNING = 3


@dataclass(frozen=True)
class RunDirConfig:
    """deepinfer status|stop: the stack started from a data dir."""

    data_dir: str = field(default=StackConfig.data_dir, metadata={"help": "the data dir `deepinfer up` used"})


def _get(url: str, token: str = "", timeout_s: float = 3.0) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()
    except OSError:
        return 0, {}, b""


def service_state(run: RunFile, name: str) -> str:
    """'ready', 'starting', 'not running', or what answers on its port instead."""
    record = run.services[name]
    if not run.is_ours(name):
        return "not running"
    if name == "valkey":
        return "running"
    status, headers, _ = _get(record.url + "/readyz")
    if status == 0:
        return "not answering"
    if headers.get(INSTANCE_HEADER) != record.instance:
        return "its port is answered by another process"
    return "ready" if status == 200 else f"not ready ({status})"


def _samples(url: str) -> Samples:
    status, _, body = _get(url + "/metrics")
    return Samples(body.decode(errors="replace")) if status == 200 else Samples()


def _mib(n: float) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def report(run: RunFile) -> tuple[list[str], bool]:
    """The status lines and whether every process runs and is ready."""
    uptime = max(time.time() - run.started_at, 1e-3)
    lines = [f"DeepInfer from {run.data_dir}: launcher pid {run.launcher_pid or '-'}, up {uptime / 60:.1f} min"]
    healthy = True
    for name in run.stop_order()[::-1]:
        state = service_state(run, name)
        healthy &= state in ("ready", "running")
        lines.append(f"  {name:9s} {run.services[name].url:26s} pid {run.services[name].pid:<8d} {state}")
    if "gateway" in run.services:
        g = _samples(run.services["gateway"].url)
        requests = sum(v for (n, labels, v) in g.rows if n == "gateway_requests_total"
                       and labels.get("endpoint", "").startswith("/v1/") and labels.get("endpoint") != "/v1/models")
        hit, miss = g.total("gateway_prompt_tokens_total", cache="hit"), g.total("gateway_prompt_tokens_total", cache="miss")
        completion = g.total("gateway_completion_tokens_total")
        lines.append(f"requests  {requests:,.0f} ({requests / uptime:.2f}/s since start), "
                     f"{g.total('gateway_requests_in_flight'):.0f} in flight")
        lines.append(f"tokens    prompt {hit + miss:,.0f} ({hit / max(hit + miss, 1):.0%} from the cache), "
                     f"completion {completion:,.0f} ({completion / uptime:.1f}/s since start)")
        ttft = g.buckets("gateway_time_to_first_token_seconds")
        if (p50 := quantile(ttft, 0.5)) is not None:
            lines.append(f"TTFT      p50 {p50:.3f} s, p99 {quantile(ttft, 0.99):.3f} s")
    for name in [n for n in run.stop_order() if n.startswith("engine")]:
        status, _, body = _get(run.services[name].url + "/admin/stats", run.admin_token)
        if status == 200:
            stats = json.loads(body)
            e = _samples(run.services[name].url)
            tiers = e.by("deepinfer_engine_prefix_hit_tokens_total", "tier") or {
                "disk": e.total("deepinfer_engine_prefill_tokens_total", source="loaded")}
            prompt = e.total("deepinfer_engine_prefill_tokens_total")
            hits = ", ".join(f"{tier} {tokens / max(prompt, 1):.0%}" for tier, tokens in sorted(tiers.items()))
            pool = ", ".join(f"{n.removeprefix('deepinfer_engine_pool_')} {v:,.0f}" for n, labels, v in e.rows
                             if n.startswith("deepinfer_engine_pool_") and not labels)
            lines.append(f"{name:9s} in flight {stats.get('in_flight', 0)}, waiting {stats.get('waiting', 0)}, "
                         f"saves pending {stats.get('pending_saves', 0)}; prompt tokens hit: {hits}"
                         + (f"; pool: {pool}" if pool else ""))
    if "kvstore" in run.services:
        k = _samples(run.services["kvstore"].url)
        budgets = k.by("kvstore_volume_budget_bytes", "volume")
        for volume, used in sorted(k.by("kvstore_volume_used_bytes", "volume").items()):
            budget = budgets.get(volume, 0)
            lines.append(f"volume    {volume}: {_mib(used)} of {_mib(budget) if budget else 'no budget'}")
        errors = k.total("kvstore_write_failures_total") + k.total("kvstore_verification_failures_total")
        lines.append(f"kvstore   read {_mib(k.total('kvstore_bytes_read_total'))}, "
                     f"written {_mib(k.total('kvstore_bytes_written_total'))}, errors {errors:.0f}")
    return lines, healthy


def status(argv: list[str] | None = None) -> int:
    cfg = load_config(RunDirConfig, "up", argv, prog="deepinfer status")
    run = RunFile.read(cfg.data_dir)
    if run is None:
        print(f"no DeepInfer stack runs from data dir {cfg.data_dir} (no run file); start one with deepinfer up")
        return NOT_RUNNING
    lines, healthy = report(run)
    print("\n".join(lines))
    return 0 if healthy else 1
