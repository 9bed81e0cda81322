"""The Kubernetes objects of a DeepInfer stack, as plain dicts, from checked values (values.py).

The stack is compose.yaml's: one image; the same commands, flags, secret files (/run/secrets/NAME, read through
DEEPINFER_<SERVICE>_<FIELD>_FILE), ports, health endpoints and mount points; the Services are named as compose's
services (`redis`, `kvstore`, `engine`, `gateway`), so the URLs are the same. What Kubernetes adds: an engine
StatefulSet per role with a headless Service (the gateway resolves it to every ready replica), a kvstore DaemonSet on
the storage nodes, the gateway's autoscaler, disruption budgets, a ServiceMonitor, and resources sized from the model.
"""
from __future__ import annotations

from typing import Any

from services.k8s.sizing import GIB, engine_memory, gib, weight_bytes
from services.k8s.values import ValuesError

UID = 10001  # the image's user `deepinfer`
SECRETS_DIR = "/run/secrets"
S3_CREDENTIALS = "/run/secrets/s3/credentials"
PORTS = {"redis": 6379, "kvstore": 8100, "engine": 8200, "gateway": 8000}
SECRETS = {  # each service's deployment secrets, as compose.yaml mounts them
    "redis": ["redis_password"],
    "kvstore": ["admin_token", "service_token", "mac_key", "redis_password"],
    "engine": ["admin_token", "service_token", "mac_key", "redis_password"],
    "gateway": ["admin_token", "service_token", "salt_key", "redis_password", "api_keys"],
}
START_SECONDS = {"kvstore": 30, "gateway": 30}  # compose's start_period; the engine's is a value
STOP_SECONDS = {"engine": 40, "gateway": 40}  # each drains for up to 30 s
ROLE_NAMES = {"both": "engine", "prefill": "engine-prefill", "decode": "engine-decode"}
REDIS_USER_URL = "redis://deepinfer@redis:6379/0"
JAX_CACHE = "/home/deepinfer/.cache/deepinfer/jax"  # model/runner.py's default for user deepinfer
# compose's Valkey: an ACL file written from the password file by shell builtins (the password is on no command
# line), `default` may only PING; an append-only file fsynced every second plus snapshots, in /data.
VALKEY_SCRIPT = (
    "umask 077 && printf 'user default on nopass resetchannels -@all +ping\\nuser deepinfer on >%s ~* &* +@all\\n' "
    "\"$(cat /run/secrets/redis_password)\" > /tmp/users.acl && exec valkey-server --protected-mode no "
    "--aclfile /tmp/users.acl --dir /data --appendonly yes --appendfsync everysec --save '3600 1 300 100 60 10000'")
VALKEY_PING = ("import socket; s = socket.create_connection(('127.0.0.1', 6379), 2); s.sendall(b'PING\\r\\n'); "
               "assert s.recv(16) == b'+PONG\\r\\n'")


def stack(values: dict) -> dict[str, list[dict]]:
    """Component name -> its objects."""
    v = values
    components = {"gateway": gateway(v), "kvstore": kvstore(v)}
    for role, replicas in v["engine"]["replicas"].items():
        if replicas:
            components[ROLE_NAMES[role]] = engine(v, role, replicas)
    if not v["redis"]["url"]:
        components["redis"] = redis(v)
    if v["model"]["init"]:
        components["model-init"] = [model_init(v)]
    if v["monitoring"]["serviceMonitor"]:
        components["monitoring"] = [service_monitor(v)]
    return components


# ------------------------------------------------------------------------------------------------ the services

def gateway(v: dict) -> list[dict]:
    g = v["gateway"]
    engines = [f"--engine=http://{ROLE_NAMES[role]}:{PORTS['engine']}"
               for role, replicas in v["engine"]["replicas"].items() if replicas]
    args = ["--host=0.0.0.0", f"--port={PORTS['gateway']}", *engines, f"--redis-url={redis_url(v)}",
            *(["--redis-cluster"] if v["redis"]["cluster"] else []),
            *([] if v["model"]["init"] else [f"--model-dir={model_dir(v)}"])]  # a converted model's tokenizer
    env = {"DEEPINFER_GATEWAY_OPEN_ACCESS": str(g["openAccess"]).lower()}
    pod = pod_spec(v, "gateway", ["python", "-m", "services.gateway"], args, env,
                   resources(g["cpu"], g["memoryGiB"] * GIB), {**g["nodeSelector"], **beside_host_paths(v, "gateway")},
                   g["tolerations"])
    labels = selector("gateway")
    autoscaled = g["maxReplicas"] > g["replicas"]  # then the autoscaler owns the replica count
    objects = [workload("Deployment", "gateway", v, labels, pod, **({} if autoscaled else {"replicas": g["replicas"]})),
               service("gateway", v, labels, g["serviceType"]),
               disruption_budget("gateway", v, labels)]
    if autoscaled:
        objects.append(obj("autoscaling/v2", "HorizontalPodAutoscaler", "gateway", v, spec={
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "gateway"},
            "minReplicas": g["replicas"], "maxReplicas": g["maxReplicas"],
            # a Pods metric: served by a metrics adapter (docs/deployment.md)
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": "gateway_requests_in_flight"},
                "target": {"type": "AverageValue", "averageValue": str(g["requestsInFlight"])}}}]}))
    return objects


def engine(v: dict, role: str, replicas: int) -> list[dict]:
    e, m = v["engine"], v["model"]
    name = ROLE_NAMES[role]
    memory = engine_memory(m["preset"], m["cacheDtype"], m["latentFormat"], e["poolGiB"], e["overheadGiB"])
    if e["gpus"] and e["gpuMemoryGiB"] and memory.device > e["gpuMemoryGiB"] * GIB:
        raise ValuesError(f"engine: {m['preset']}'s weights ({memory.weights / GIB:.1f} GiB) and the pool "
                          f"(engine.poolGiB {e['poolGiB']}) do not fit one GPU "
                          f"(engine.gpuMemoryGiB {e['gpuMemoryGiB']})")
    args = ["--host=0.0.0.0", f"--port={PORTS['engine']}", f"--role={role}", f"--model-dir={model_dir(v)}",
            f"--cache-dtype={m['cacheDtype']}", f"--redis-url={redis_url(v)}",
            *(["--redis-cluster"] if v["redis"]["cluster"] else []),
            *volume_flags(v), f"--pool-gib={e['poolGiB']:g}",
            *([f"--budget-bytes={int(v['storage']['budgetGiB'] * GIB)}"] if v["storage"]["budgetGiB"] else [])]
    env = {"DEEPINFER_ENGINE_LATENT_FORMAT": m["latentFormat"], **s3_environment(v)}
    limits = resources(e["cpu"], memory.total, e["gpus"])
    node_selector = {**e["nodeSelector"], **beside_host_paths(v, "engine")}
    pod = pod_spec(v, "engine", ["python", "-m", "services.engine"], args, env, limits, node_selector,
                   e["tolerations"], start_seconds=e["startupSeconds"], init=[wait_for_model(v)],
                   mounts=[("jax-cache", JAX_CACHE, False)])
    labels = selector("engine", role)
    claim = {"metadata": {"name": "jax-cache"}, "spec": {
        "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": f"{e['jaxCacheGiB']}Gi"}}}}
    pod["metadata"]["annotations"] = {  # what the memory request is made of, GiB
        "deepinfer.io/memory-gib": ", ".join(f"{term} {size / GIB:.2f}" for term, size in memory._asdict().items())}
    return [workload("StatefulSet", name, v, labels, pod, replicas=replicas, serviceName=name,
                     podManagementPolicy="Parallel", volumeClaimTemplates=[claim]),
            service(name, v, labels, headless=True),
            disruption_budget(name, v, labels)]


def kvstore(v: dict) -> list[dict]:
    k, m = v["kvstore"], v["model"]
    env = {"DEEPINFER_KVSTORE_BUDGET_GIB": f"{v['storage']['budgetGiB']:g}",
           "DEEPINFER_KVSTORE_LATENT_FORMAT": m["latentFormat"], **s3_environment(v)}
    args = ["--host=0.0.0.0", f"--port={PORTS['kvstore']}", f"--redis-url={redis_url(v)}",
            *(["--redis-cluster"] if v["redis"]["cluster"] else []), f"--dtype={m['cacheDtype']}", *volume_flags(v)]
    # the entrypoint reads the model's fingerprint and geometry, then runs `python -m services.kvstore`
    pod = pod_spec(v, "kvstore", ["python", "/app/docker/kvstore_for_model.py", model_dir(v)], args, env,
                   resources(k["cpu"], k["memoryGiB"] * GIB), v["storage"]["nodeSelector"], k["tolerations"],
                   init=[wait_for_model(v)])
    labels = selector("kvstore")
    return [workload("DaemonSet", "kvstore", v, labels, pod), service("kvstore", v, labels)]


def redis(v: dict) -> list[dict]:
    r = v["redis"]
    probe = {"exec": {"command": ["python", "-c", VALKEY_PING]}, "periodSeconds": 5, "timeoutSeconds": 3}
    pod = pod_spec(v, "redis", ["sh", "-c"], [VALKEY_SCRIPT], {}, resources("1", r["memoryGiB"] * GIB), {}, [],
                   probes={"readinessProbe": {**probe, "failureThreshold": 3},
                           "livenessProbe": {**probe, "failureThreshold": 10}},
                   mounts=[("data", "/data", False)])
    labels = selector("redis")
    claim = {"metadata": {"name": "data"}, "spec": {
        "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": f"{r['storageGiB']}Gi"}},
        **({"storageClassName": r["storageClass"]} if r["storageClass"] else {})}}
    # One server and no disruption budget: a budget for one pod would block every node drain.
    return [workload("StatefulSet", "redis", v, labels, pod, replicas=1, serviceName="redis",
                     volumeClaimTemplates=[claim]),
            service("redis", v, labels, headless=True, metrics=False)]


def model_init(v: dict) -> dict:
    m = v["model"]
    script = f"test -f {model_dir(v)}/meta.json || deepinfer model init --preset {m['preset']} --out {model_dir(v)}"
    memory = weight_bytes(m["preset"]) + v["engine"]["overheadGiB"] * GIB
    pod = pod_spec(v, "model-init", ["sh", "-c"], [script], {}, resources("2", memory),
                   beside_host_paths(v, "model-init"), [], probes={})
    pod["spec"]["restartPolicy"] = "OnFailure"
    return obj("batch/v1", "Job", "model-init", v, spec={"backoffLimit": 3, "template": pod})


def service_monitor(v: dict) -> dict:
    """Every DeepInfer Service's pods, job names as deploy/prometheus.yml's (the Grafana dashboard selects by job)."""
    return obj("monitoring.coreos.com/v1", "ServiceMonitor", "deepinfer", v, labels=v["monitoring"]["labels"], spec={
        "selector": {"matchLabels": {"app.kubernetes.io/part-of": "deepinfer", "deepinfer.io/metrics": "true"}},
        "jobLabel": "deepinfer.io/job",
        "endpoints": [{"port": "http", "path": "/metrics", "interval": v["monitoring"]["interval"],
                       "authorization": {"type": "Bearer",
                                         "credentials": {"name": v["secrets"]["name"], "key": "admin_token"}}}]})


# ------------------------------------------------------------------------------------------------ the parts

def obj(api_version: str, kind: str, name: str, v: dict, labels: dict | None = None, **fields: Any) -> dict:
    return {"apiVersion": api_version, "kind": kind, **fields, "metadata": {
        "name": name, "namespace": v["namespace"],
        "labels": {"app.kubernetes.io/part-of": "deepinfer", **(labels or {})}}}


def selector(service_name: str, role: str = "") -> dict:
    return {"app.kubernetes.io/name": service_name, **({"deepinfer.io/role": role} if role else {})}


def workload(kind: str, name: str, v: dict, labels: dict, pod: dict, **spec: Any) -> dict:
    pod["metadata"]["labels"] = {"app.kubernetes.io/part-of": "deepinfer", **labels}
    return obj("apps/v1", kind, name, v, labels, spec={"selector": {"matchLabels": labels}, "template": pod, **spec})


def service(name: str, v: dict, labels: dict, service_type: str = "ClusterIP", headless: bool = False,
            metrics: bool = True) -> dict:
    component = labels["app.kubernetes.io/name"]
    job = {"deepinfer.io/metrics": "true", "deepinfer.io/job": f"deepinfer-{component}"} if metrics else {}
    spec = {"selector": labels, "ports": [{"name": "http" if metrics else "redis", "port": PORTS[component],
                                           "targetPort": PORTS[component]}]}
    spec |= {"clusterIP": "None"} if headless else {"type": service_type}
    return obj("v1", "Service", name, v, {**labels, **job}, spec=spec)


def disruption_budget(name: str, v: dict, labels: dict) -> dict:
    return obj("policy/v1", "PodDisruptionBudget", name, v, labels,
               spec={"maxUnavailable": 1, "selector": {"matchLabels": labels}})


def resources(cpu: str, memory_bytes: int, gpus: int = 0) -> dict:
    amounts = {"cpu": cpu, "memory": gib(memory_bytes), **({"nvidia.com/gpu": gpus} if gpus else {})}
    return {"requests": dict(amounts), "limits": dict(amounts)}


def pod_spec(v: dict, service_name: str, command: list[str], args: list[str], env: dict[str, str], limits: dict,
             node_selector: dict, tolerations: list, start_seconds: int | None = None, init: list | None = None,
             probes: dict | None = None, mounts: list | None = None) -> dict:
    """A pod of one container: the secrets of `service_name` as files, the model and cache volumes it needs."""
    port = PORTS.get(service_name)
    secret_env = {f"DEEPINFER_{service_name.upper()}_{secret.upper()}_FILE": f"{SECRETS_DIR}/{secret}"
                  for secret in SECRETS.get(service_name, []) if service_name in ("gateway", "kvstore", "engine")}
    volumes, volume_mounts = pod_volumes(v, service_name)
    volume_mounts += [{"name": name, "mountPath": path, **({"readOnly": True} if ro else {})}
                      for name, path, ro in mounts or []]
    if probes is None:
        start = start_seconds or START_SECONDS[service_name]
        probes = {"startupProbe": http_probe("/healthz", -(-start // 5)), "livenessProbe": http_probe("/healthz", 10),
                  "readinessProbe": http_probe("/readyz", 3)}
    container = {
        "name": service_name, "image": v["image"], "imagePullPolicy": v["imagePullPolicy"],
        "command": command, "args": args, "resources": limits, "volumeMounts": volume_mounts,
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}, **probes}
    if secret_env or env:
        container["env"] = [{"name": name, "value": value} for name, value in sorted({**secret_env, **env}.items())]
    if port:
        container["ports"] = [{"name": "http" if service_name != "redis" else "redis", "containerPort": port}]
    spec = {"containers": [container], "volumes": volumes,
            "securityContext": {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID},
            **({"initContainers": init} if init else {}),
            **({"nodeSelector": node_selector} if node_selector else {}),
            **({"tolerations": tolerations} if tolerations else {}),
            **({"terminationGracePeriodSeconds": STOP_SECONDS[service_name]} if service_name in STOP_SECONDS else {})}
    return {"metadata": {}, "spec": spec}


def http_probe(path: str, failures: int) -> dict:
    """compose's healthcheck: every 5 s, 3 s to answer (liveness: 10 failures in a row, as its retries)."""
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": 5, "timeoutSeconds": 3,
            "failureThreshold": failures}


def pod_volumes(v: dict, service_name: str) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts) of a pod: its secret files, the models, the cache volumes and the S3 credentials."""
    volumes, mounts = [], []
    if SECRETS.get(service_name):
        volumes.append({"name": "secrets", "secret": {
            "secretName": v["secrets"]["name"], "defaultMode": 0o440,
            "items": [{"key": name, "path": name} for name in SECRETS[service_name]]}})
        mounts.append({"name": "secrets", "mountPath": SECRETS_DIR, "readOnly": True})
    if mounts_model(v, service_name):
        volumes.append({"name": "models", **volume_source(v["model"]["volume"])})
        mounts.append({"name": "models", "mountPath": "/models", "readOnly": service_name != "model-init"})
    if service_name in ("engine", "kvstore"):
        for i, volume in enumerate(v["storage"]["volumes"]):
            if not volume.startswith("s3://"):
                volumes.append({"name": f"ssd{i}", **volume_source(volume)})
                mounts.append({"name": f"ssd{i}", "mountPath": f"/volumes/ssd{i}"})
        if s3_environment(v):
            volumes.append({"name": "s3-credentials", "secret": {
                "secretName": v["storage"]["s3CredentialsSecret"], "defaultMode": 0o440,
                "items": [{"key": "credentials", "path": "credentials"}]}})
            mounts.append({"name": "s3-credentials", "mountPath": S3_CREDENTIALS.rsplit("/", 1)[0], "readOnly": True})
    return volumes, mounts


def mounts_model(v: dict, service_name: str) -> bool:
    """Engines, kvstore and model-init mount the models; the gateway too for a converted model's tokenizer."""
    return service_name in ("engine", "kvstore", "model-init") or service_name == "gateway" and not v["model"]["init"]


def volume_source(volume: str) -> dict:
    if volume.startswith("pvc:"):
        return {"persistentVolumeClaim": {"claimName": volume.removeprefix("pvc:")}}
    return {"hostPath": {"path": volume, "type": "Directory"}}  # made and given to uid 10001 by the operator


def volume_flags(v: dict) -> list[str]:
    """--volume per cache volume, in order: a mounted one at compose's /volumes/ssdN, an s3 one as it is."""
    return [f"--volume={volume}" if volume.startswith("s3://") else f"--volume=/volumes/ssd{i}"
            for i, volume in enumerate(v["storage"]["volumes"])]


def s3_environment(v: dict) -> dict[str, str]:
    s = v["storage"]
    if not any(volume.startswith("s3://") for volume in s["volumes"]):
        return {}
    return {"AWS_SHARED_CREDENTIALS_FILE": S3_CREDENTIALS, "AWS_REGION": s["s3Region"],
            **({"AWS_ENDPOINT_URL_S3": s["s3Endpoint"]} if s["s3Endpoint"] else {})}


def beside_host_paths(v: dict, service_name: str) -> dict:
    """The storage nodes' labels when the pod mounts a host path (a cache volume or the models), else none."""
    paths = [*(v["storage"]["volumes"] if service_name in ("engine", "kvstore") else []),
             *([v["model"]["volume"]] if mounts_model(v, service_name) else [])]
    return v["storage"]["nodeSelector"] if any(path.startswith("/") for path in paths) else {}


def wait_for_model(v: dict) -> dict:
    """compose's `depends_on: model-init`: the pod starts once the model's meta.json exists."""
    return {"name": "wait-for-model", "image": v["image"], "imagePullPolicy": v["imagePullPolicy"],
            "command": ["sh", "-c", f"until test -f {model_dir(v)}/meta.json; do sleep 5; done"],
            "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}


def model_dir(v: dict) -> str:
    return v["model"]["dir"] or f"/models/{v['model']['preset']}"


def redis_url(v: dict) -> str:
    return v["redis"]["url"] or REDIS_USER_URL
