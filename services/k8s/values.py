"""The values of `deepinfer deploy k8s`: every key with its one default and meaning, and the checks of a values file.

A values file is YAML holding any subset of SPEC's keys; a key not in SPEC is an error naming its path
(`engine.replicas.prefil`), and so is a value of the wrong type or a required key left out.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from kvstore.latent_format import check_latent_format
from services.common.config import check_redis_url

REQUIRED = object()
SECRETS_HELP = "service_token, salt_key, mac_key, admin_token, redis_password, api_keys"


class Key(NamedTuple):
    default: Any
    help: str
    kind: type | None = None  # the value's type when there is no default to take it from


class ValuesError(ValueError):
    """A values file a user wrote is wrong; the message names the key's path."""


SPEC: dict[str, Any] = {
    "image": Key(REQUIRED, "the DeepInfer image (the Dockerfile's), in a registry the nodes pull from", str),
    "imagePullPolicy": Key("IfNotPresent", "Always, IfNotPresent or Never"),
    "namespace": Key("deepinfer", "the namespace of every object (create it first)"),
    "secrets": {
        "name": Key(REQUIRED, f"the Secret of the deployment's secret files, a key each: {SECRETS_HELP}", str),
    },
    "model": {
        "preset": Key("mini", "the preset `model.init` creates; its shapes size the engines (a converted "
                              "checkpoint: its architecture's preset)"),
        "dir": Key("", "the model directory (default /models/PRESET)"),
        "init": Key(True, "a Job creates the preset's weights in the model volume once (compose's model-init)"),
        "volume": Key("pvc:deepinfer-models", "where /models comes from: pvc:CLAIM (ReadWriteMany across nodes) or "
                                              "a host path on the storage nodes"),
        "cacheDtype": Key("bfloat16", "latent cache dtype: bfloat16 or float32"),
        "latentFormat": Key("bf16", "latents on disk: bf16 or fp8"),
    },
    "gateway": {
        "replicas": Key(2, "gateway pods (the autoscaler's minimum)"),
        "maxReplicas": Key(8, "the autoscaler's maximum (equal to replicas: no autoscaler)"),
        "requestsInFlight": Key(32, "the autoscaler's target: gateway_requests_in_flight per pod, on average"),
        "openAccess": Key(False, "requests without a known API key are served as tenant 'public'"),
        "serviceType": Key("ClusterIP", "the gateway Service's type: ClusterIP, NodePort or LoadBalancer"),
        "cpu": Key("2", "CPU request and limit of a gateway pod"),
        "memoryGiB": Key(4, "memory request and limit of a gateway pod, GiB"),
        "nodeSelector": Key({}, "node labels a gateway pod needs"),
        "tolerations": Key([], "tolerations of a gateway pod"),
    },
    "engine": {
        "replicas": {
            "both": Key(1, "engines that prefill and decode (the StatefulSet `engine`)"),
            "prefill": Key(0, "prefill engines (`engine-prefill`); they come with decode engines"),
            "decode": Key(0, "decode engines (`engine-decode`); they come with prefill engines"),
        },
        "gpus": Key(1, "nvidia.com/gpu per engine pod (0: CPU engines)"),
        "gpuMemoryGiB": Key(80, "memory of one GPU, GiB: the model's weights and the pool must fit (0: no check)"),
        "poolGiB": Key(1.0, "latent pool per engine, GiB (--pool-gib)"),
        "overheadGiB": Key(4, "memory beyond weights, pool and staging buffer: runtime, compiled programs, GiB"),
        "cpu": Key("8", "CPU request and limit of an engine pod"),
        "jaxCacheGiB": Key(10, "each engine's volume of compiled XLA programs, GiB"),
        "startupSeconds": Key(600, "how long an engine may take to answer /healthz after its start"),
        "nodeSelector": Key({}, "node labels an engine pod needs (with host-path volumes, the storage nodes' too)"),
        "tolerations": Key([{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                           "tolerations of an engine pod"),
    },
    "kvstore": {
        "cpu": Key("2", "CPU request and limit of a kvstore pod"),
        "memoryGiB": Key(4, "memory request and limit of a kvstore pod, GiB"),
        "tolerations": Key([], "tolerations of a kvstore pod"),
    },
    "storage": {
        "volumes": Key(REQUIRED, "the cache volumes, in order: a host path (one SSD each), pvc:CLAIM or "
                                 "s3://BUCKET/PREFIX", list),
        "nodeSelector": Key({}, "labels of the nodes that hold the volumes: a kvstore runs on each"),
        "budgetGiB": Key(0.0, "cache bytes per volume, GiB (0: 80% of its file system; s3 volumes need one)"),
        "s3Endpoint": Key("", "AWS_ENDPOINT_URL_S3 of s3 volumes (empty: AWS's)"),
        "s3Region": Key("us-east-1", "AWS_REGION of s3 volumes"),
        "s3CredentialsSecret": Key("", "with s3 volumes: the Secret whose key `credentials` is an AWS shared "
                                       "credentials file"),
    },
    "redis": {
        "url": Key("", "an external Redis or Valkey, redis://USER@HOST:PORT/DB (empty: a Valkey StatefulSet)"),
        "cluster": Key(False, "the external Redis is a Redis Cluster"),
        "memoryGiB": Key(4, "memory request and limit of the Valkey StatefulSet's pod, GiB"),
        "storageGiB": Key(10, "the Valkey StatefulSet's volume (append-only file and snapshots), GiB"),
        "storageClass": Key("", "its storage class (empty: the cluster's default)"),
    },
    "monitoring": {
        "serviceMonitor": Key(True, "a ServiceMonitor (Prometheus Operator) scraping every service's /metrics"),
        "interval": Key("15s", "its scrape interval"),
        "labels": Key({}, "its labels (those the Prometheus selects ServiceMonitors by)"),
    },
}


def load_values(path: str | Path) -> dict:
    """The checked values of a YAML file, defaults filled in; ValuesError names a bad key."""
    try:
        given = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as error:
        raise ValuesError(f"{path}: not YAML: {error}") from None
    return check_values(given or {})


def check_values(given: dict) -> dict:
    values = _merge(SPEC, given, "")
    storage, model = values["storage"], values["model"]
    if not storage["volumes"]:
        raise ValuesError("storage.volumes: give at least one volume")
    for i, volume in enumerate(storage["volumes"]):
        if not isinstance(volume, str) or not volume.startswith(("/", "pvc:", "s3://")):
            raise ValuesError(f"storage.volumes[{i}]: {volume!r} is none of /HOST/PATH, pvc:CLAIM, s3://BUCKET/PREFIX")
    if any(volume.startswith("s3://") for volume in storage["volumes"]):
        if not storage["s3CredentialsSecret"]:
            raise ValuesError("storage.s3CredentialsSecret is required with s3 volumes: the Secret whose key "
                              "`credentials` is an AWS shared credentials file")
        if not storage["budgetGiB"] > 0:
            raise ValuesError("storage.budgetGiB must be > 0 with s3 volumes: an object store has no file system "
                              "to take a default from")
    if not model["volume"].startswith(("/", "pvc:")):
        raise ValuesError(f"model.volume: {model['volume']!r} is neither pvc:CLAIM nor a /HOST/PATH")
    if model["cacheDtype"] not in ("bfloat16", "float32"):
        raise ValuesError(f"model.cacheDtype must be bfloat16 or float32, got {model['cacheDtype']!r}")
    _named("model.latentFormat", check_latent_format, model["latentFormat"])
    _named("redis.url", check_redis_url, values["redis"]["url"])
    if values["redis"]["cluster"] and not values["redis"]["url"]:
        raise ValuesError("redis.cluster needs redis.url: the in-cluster Valkey is one server")
    replicas = values["engine"]["replicas"]
    if not sum(replicas.values()):
        raise ValuesError("engine.replicas: every role has 0 replicas")
    if bool(replicas["prefill"]) != bool(replicas["decode"]):
        raise ValuesError("engine.replicas: prefill and decode engines come together (a prompt prefilled by one "
                          "is decoded by the other)")
    gateway = values["gateway"]
    if not 1 <= gateway["replicas"] <= gateway["maxReplicas"]:
        raise ValuesError("gateway: 1 <= replicas <= maxReplicas must hold, got "
                          f"{gateway['replicas']} and {gateway['maxReplicas']}")
    return values


def _named(path: str, check, value: Any) -> None:
    try:
        check(value)
    except ValueError as error:
        raise ValuesError(f"{path}: {error}") from None


def _merge(spec: dict, given: Any, path: str) -> dict:
    if not isinstance(given, dict):
        raise ValuesError(f"{path or 'the values'}: expected a mapping, got {type(given).__name__}")
    unknown = sorted(set(given) - set(spec), key=str)
    if unknown:
        raise ValuesError(f"{_join(path, unknown[0])}: unknown key (known here: {', '.join(spec)})")
    merged = {}
    for name, entry in spec.items():
        where = _join(path, name)
        if isinstance(entry, dict):
            merged[name] = _merge(entry, given.get(name) or {}, where)
        elif given.get(name) is None or entry.default is REQUIRED and given[name] == "":
            if entry.default is REQUIRED:
                raise ValuesError(f"{where} is required: {entry.help}")
            merged[name] = copy.deepcopy(entry.default)
        else:
            merged[name] = _typed(entry, given[name], where)
    return merged


def _typed(entry: Key, value: Any, where: str) -> Any:
    kind = entry.kind or type(entry.default)
    if kind is float and type(value) is int:
        return float(value)
    if kind is str and type(value) in (int, float):  # quantities such as cpu: 2
        return str(value)
    if type(value) is not kind:
        raise ValuesError(f"{where}: expected {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def _join(path: str, name: Any) -> str:
    return f"{path}.{name}" if path else str(name)


def values_table() -> str:
    """The Markdown table of every key, its default and meaning (docs/deployment.md holds it)."""
    rows = ["| key | default | meaning |", "|---|---|---|"]

    def walk(spec: dict, path: str) -> None:
        for name, entry in spec.items():
            if isinstance(entry, dict):
                walk(entry, _join(path, name))
            else:
                rows.append(f"| `{_join(path, name)}` | {_shown(entry.default)} | {entry.help} |")
    walk(SPEC, "")
    return "\n".join(rows)


def _shown(default: Any) -> str:
    if default is REQUIRED:
        return "required"
    return "`" + yaml.safe_dump(default, default_flow_style=True, width=1000).strip().removesuffix("...").strip() + "`"
