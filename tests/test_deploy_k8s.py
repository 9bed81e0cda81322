"""`deepinfer deploy k8s`: the values files in deploy/k8s/ render, every object validates against the Kubernetes
schemas of a pinned version (kubernetes-validate's offline copies, strict) or a schema vendored in
deploy/k8s/schemas/, the committed manifests are what the renderer makes, a bad values file is refused naming the
key, no secret reaches a command line, and the single-host stack is compose.yaml's. No cluster is needed.
"""
from __future__ import annotations

import dataclasses
import json
import socket
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from services.cli import main
from services.common.config import env_name, is_secret, load_config
from services.k8s import manifests
from services.k8s.render import render
from services.k8s.sizing import GIB, engine_memory
from services.k8s.values import ValuesError, check_values, load_values, values_table
from tests.test_compose import (KVSTORE_ENTRYPOINT, ROOT, SERVICE_CONFIGS, Launched, _routes, argv_of, compose,
                                environment_of, launched, load_kvstore_entrypoint, mounts_of, repo_path_of)
from tests.test_compose import mini_model_dir  # noqa: F401 (a fixture)

K8S = ROOT / "deploy" / "k8s"
VALUES_FILES = sorted(K8S.glob("*.yaml"))
K8S_VERSION = "1.33.0"  # the Kubernetes whose schemas the manifests must pass
CUSTOM_SCHEMAS = K8S / "schemas"  # KIND-GROUP-VERSION.json, kubernetes-validate's naming
SECRET_NAMES = {name for names in manifests.SECRETS.values() for name in names}
DEEPINFER_SERVICES = ("gateway", "kvstore", "engine")


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict[str, str]]:
    """Values file name -> its rendered files."""
    return {path.stem: render(path) for path in VALUES_FILES}


def objects_of(files: dict[str, str]) -> list[dict]:
    return [doc for text in files.values() for doc in yaml.safe_load_all(text)]


def containers_of(obj: dict) -> list[dict]:
    spec = obj["spec"].get("template", {}).get("spec", {})
    return spec.get("initContainers", []) + spec.get("containers", [])


def named(objects: list[dict], kind: str, name: str) -> dict:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


# ---------------------------------------------------------------- schemas

def validate(obj: dict) -> None:
    """Against the vendored schema of a custom kind, else kubernetes-validate's strict schema of K8S_VERSION;
    a kind with neither fails."""
    group, _, version = obj["apiVersion"].rpartition("/")
    vendored = CUSTOM_SCHEMAS / f"{obj['kind'].lower()}-{group.split('.')[0] or 'core'}-{version}.json"
    if vendored.exists():
        jsonschema.validate(obj, json.loads(vendored.read_text()))
        return
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError as error:
        pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {error.message}, and no {vendored.name} in "
                    f"{CUSTOM_SCHEMAS.relative_to(ROOT)}")


def test_the_values_files_are_the_three_layouts():
    assert [path.stem for path in VALUES_FILES] == ["prefill-decode", "s3", "single-host"]


@pytest.mark.parametrize("values", [path.stem for path in VALUES_FILES])
def test_every_rendered_object_passes_its_schema_offline(rendered, values, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("schema validation tried to reach the network")
    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    objects = objects_of(rendered[values])
    assert {o["kind"] for o in objects} >= {"Deployment", "StatefulSet", "DaemonSet", "Service", "PodDisruptionBudget",
                                            "HorizontalPodAutoscaler", "ServiceMonitor"}
    for obj in objects:
        validate(obj)


def test_the_validation_refuses_a_misspelled_field_and_a_kind_without_schema():
    """Strict schemas: a field Kubernetes does not know fails (the API server would drop it silently)."""
    statefulset = named(objects_of(render(K8S / "single-host.yaml")), "StatefulSet", "engine")
    statefulset["spec"]["replica"] = statefulset["spec"].pop("replicas")
    with pytest.raises(kubernetes_validate.ValidationError, match="replica"):
        validate(statefulset)
    monitor = named(objects_of(render(K8S / "single-host.yaml")), "ServiceMonitor", "deepinfer")
    monitor["spec"]["endpoints"][0]["bearerToken"] = "inline"
    with pytest.raises(jsonschema.ValidationError, match="bearerToken"):
        validate(monitor)
    with pytest.raises(pytest.fail.Exception, match="no widget-example-v1.json"):
        validate({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}})


@pytest.mark.parametrize("values", [path.stem for path in VALUES_FILES])
def test_the_committed_manifests_are_current(rendered, values):
    out = K8S / "rendered" / values
    command = (f"rm -rf deploy/k8s/rendered/{values} && "
               f"deepinfer deploy k8s --values deploy/k8s/{values}.yaml --out deploy/k8s/rendered/{values}")
    committed = {path.name: path.read_text() for path in sorted(out.glob("*.yaml"))}
    assert sorted(committed) == sorted(rendered[values]), f"stale files in {out}; regenerate: {command}"
    stale = [name for name, text in rendered[values].items() if committed[name] != text]
    assert not stale, f"{stale} in {out.relative_to(ROOT)} differ from the renderer's; regenerate: {command}"


# ---------------------------------------------------------------- refusals

def values_file(tmp_path: Path, **changes: Any) -> Path:
    document = yaml.safe_load((K8S / "single-host.yaml").read_text())
    for path, value in changes.items():
        *parents, last = path.split("__")
        node = document
        for key in parents:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    target = tmp_path / "values.yaml"
    target.write_text(yaml.safe_dump(document))
    return target


@pytest.mark.parametrize("changes, message", [
    ({"engine__replicas": {"both": 1, "prefil": 1}}, r"engine\.replicas\.prefil: unknown key"),
    ({"gateway__replicaz": 3}, r"gateway\.replicaz: unknown key"),
    ({"secrets": None}, r"secrets\.name is required"),
    ({"secrets__name": ""}, r"secrets\.name is required"),
    ({"image": None}, r"image is required"),
    ({"storage__volumes": ["s3://bucket/vol0"], "storage__budgetGiB": 100}, r"storage\.s3CredentialsSecret is required"),
    ({"storage__volumes": ["s3://bucket/vol0"], "storage__s3CredentialsSecret": "s3"}, r"storage\.budgetGiB must be > 0"),
    ({"storage__volumes": ["nvme0"]}, r"storage\.volumes\[0\]"),
    ({"gateway__replicas": "two"}, r"gateway\.replicas: expected int, got str"),
    ({"redis__url": "redis://deepinfer:pw@redis:6379/0"}, r"redis\.url: redis_url must not contain a password"),
    ({"engine__replicas": {"both": 0, "prefill": 1}}, r"engine\.replicas: prefill and decode engines come together"),
    ({"model__preset": "deepseek-v2-lite", "engine__gpuMemoryGiB": 16}, r"do not fit one GPU \(engine\.gpuMemoryGiB 16\)"),
])
def test_a_bad_values_file_is_refused_naming_the_key_and_nothing_is_written(tmp_path, capsys, changes, message):
    path, out = values_file(tmp_path, **changes), tmp_path / "out"
    with pytest.raises(ValuesError, match=message):
        render(path)
    assert main(["deploy", "k8s", "--values", str(path), "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("deepinfer: error: ") and error.count("\n") == 1, error
    assert not out.exists()


def test_the_cli_writes_one_file_per_component_or_prints_every_object(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["deploy", "k8s", "--values", str(K8S / "single-host.yaml"), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(render(K8S / "single-host.yaml"))
    capsys.readouterr()
    assert main(["deploy", "k8s", "--values", str(K8S / "single-host.yaml")]) == 0
    printed = list(yaml.safe_load_all(capsys.readouterr().out))
    assert printed == objects_of(render(K8S / "single-host.yaml"))


# ---------------------------------------------------------------- secrets

@pytest.mark.parametrize("values", [path.stem for path in VALUES_FILES])
def test_secrets_are_mounted_files_never_arguments_or_environment_values(rendered, values):
    """Every secret field a container's service has comes from DEEPINFER_<SERVICE>_<FIELD>_FILE naming a file of
    the Secret volume mounted at /run/secrets; no env var takes a Secret's value (valueFrom), no secret variable
    is set directly, no argument names a secret field or carries a password in a Redis URL."""
    secret_vars = {env_name(prefix, f.name): f.name for cls, prefix in SERVICE_CONFIGS.values()
                   for f in dataclasses.fields(cls) if is_secret(f)}
    for obj in objects_of(rendered[values]):
        pod = obj["spec"].get("template", {}).get("spec", {})
        mounted = {volume["name"]: {item["path"] for item in volume["secret"]["items"]}
                   for volume in pod.get("volumes", []) if "secret" in volume}
        for container in containers_of(obj):
            where = f"{values}: {obj['kind']} {obj['metadata']['name']} container {container['name']}"
            files = {f"{m['mountPath']}/{path}" for m in container.get("volumeMounts", []) if m["name"] in mounted
                     for path in mounted[m["name"]]}
            assert all(m.get("readOnly") for m in container.get("volumeMounts", []) if m["name"] in mounted), where
            for env in container.get("env", []):
                assert set(env) == {"name", "value"}, f"{where}: {env['name']} is not a plain value"
                assert env["name"] not in secret_vars, f"{where}: secret {env['name']} given as a value"
                if env["name"].removesuffix("_FILE") in secret_vars or env["name"] == "AWS_SHARED_CREDENTIALS_FILE":
                    assert env["value"] in files, f"{where}: {env['name']} names {env['value']}, not a mounted secret"
            for arg in container.get("command", []) + container.get("args", []):
                assert not any(f"--{field.replace('_', '-')}" in arg for field in secret_vars.values()), (where, arg)
                if "redis://" in arg:
                    assert urlsplit(arg.partition("=")[2]).password is None, f"{where}: a password in {arg}"
                assert "AWS_SECRET" not in arg and "AWS_ACCESS" not in arg, (where, arg)


# ---------------------------------------------------------------- the same stack as compose.yaml

# Fields whose value differs on purpose: service -> field -> why.
DIFFERENCES = {"engine": {"pool_gib": "a pod sees its node's memory, so the engine's default share of it (5%, at "
                                      "most 1 GiB) would not be the pod's: the pool is given, and sizes the pod"},
               "gateway": {"engines": "compose's gateway also names profile split's engines (a name that does not "
                                      "resolve is no engine); the rendered one names the roles rendered: compose's "
                                      "engines outside profiles"}}
COMPOSE_AS_IN_PRODUCTION = {"DEEPINFER_OPEN_ACCESS": "false"}  # compose's default is local mode (open access)


def k8s_launched(container: dict, model_dir: Path, secrets_dir: Path) -> Launched:
    """A rendered container's service config, read by the service's own loader as compose's are
    (tests/test_compose.py launched): /run/secrets/NAME is `secrets_dir`/NAME, the kvstore's entrypoint runs."""
    argv, environment = container["command"] + container["args"], {e["name"]: e["value"] for e in container["env"]}
    for key, value in environment.items():
        if PurePosixPath(value).parent == PurePosixPath(manifests.SECRETS_DIR):
            environment[key] = str(secrets_dir / PurePosixPath(value).name)
    entry_model_dir = None
    if argv[:2] == ["python", "-m"]:
        module, args = argv[2], argv[3:]
    else:
        assert argv[0] == "python" and repo_path_of(argv[1]) == ROOT / KVSTORE_ENTRYPOINT, argv
        module, entry_model_dir = "services.kvstore", argv[2]
        args = load_kvstore_entrypoint().kvstore_argv(str(model_dir), argv[3:], environment)
    cls, prefix = SERVICE_CONFIGS[module]
    return Launched(module, load_config(cls, prefix, args, environment), prefix, environment, entry_model_dir)


def test_the_single_host_stack_is_composes(rendered, mini_model_dir):
    """deploy/k8s/single-host.yaml renders compose.yaml's stack. "The same" means:
    - the same services: redis, model-init, kvstore, engine, gateway (compose's services outside profiles), each a
      workload of one container running compose's command (Valkey's script and healthcheck, model-init's script);
    - the same configuration: each DeepInfer service's flags and environment, read by its own config loader from
      the same secret files, give equal configs, field by field, except DIFFERENCES (each with its reason);
    - the same secrets: each service mounts the same secret names at /run/secrets/NAME and reads them through the
      same DEEPINFER_*_FILE variables;
    - the same ports and health endpoints: the port each service binds is its container's and its Service's port,
      compose's healthcheck path is the liveness probe's, and the readiness probe's /readyz is a route it serves;
    - the same mount points (models read-only, the cache volumes, the JAX cache) and the same drain time.
    Where Kubernetes differs by nature it is not compared: host names are Service names (equal here, since the
    Services are named as compose's services), `depends_on` becomes an init container that waits for the model and
    readiness probes, the engines' JAX cache is a volume per replica (ReadWriteOnce), the gateway is a Service
    rather than a published port, and compose is read with DEEPINFER_OPEN_ACCESS=false, as production runs it."""
    document = compose(COMPOSE_AS_IN_PRODUCTION)
    services = {name: s for name, s in document["services"].items() if not s.get("profiles")}
    objects = objects_of(rendered["single-host"])
    workloads = {o["metadata"]["name"]: o for o in objects if "template" in o["spec"]}
    assert set(workloads) == set(services)
    for name, service in services.items():
        (container,) = workloads[name]["spec"]["template"]["spec"]["containers"]
        pod = workloads[name]["spec"]["template"]["spec"]
        if name not in DEEPINFER_SERVICES:
            assert container["command"] + container["args"] == argv_of(service), name
        secret_volume = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "deepinfer-secrets"]
        mounted = {item["key"] for v in secret_volume for item in v["secret"]["items"]}
        assert mounted == set(service.get("secrets", [])), name
        targets = {(m.target, m.read_only) for m in mounts_of(service)}
        assert {(m["mountPath"], bool(m.get("readOnly"))) for m in container.get("volumeMounts", [])
                if m["mountPath"] != manifests.SECRETS_DIR} == targets, name
        grace = service.get("stop_grace_period")
        assert pod.get("terminationGracePeriodSeconds") == (int(grace.removesuffix("s")) if grace else None), name
    redis_probe = workloads["redis"]["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    assert ["CMD", *redis_probe["exec"]["command"]] == services["redis"]["healthcheck"]["test"]

    for name in DEEPINFER_SERVICES:
        theirs = launched(name, COMPOSE_AS_IN_PRODUCTION, mini_model_dir)
        secrets_dir = Path(next(v for k, v in theirs.environment.items() if k.endswith("_ADMIN_TOKEN_FILE"))).parent
        container = workloads[name]["spec"]["template"]["spec"]["containers"][-1]
        ours = k8s_launched(container, mini_model_dir, secrets_dir)
        compose_env = environment_of(services[name])
        assert {k: v for k, v in compose_env.items() if k.endswith("_FILE")} == \
            {e["name"]: e["value"] for e in container["env"] if e["name"].endswith("_FILE")}, name
        assert ours.model_dir == theirs.model_dir
        differing = {f.name for f in dataclasses.fields(ours.config)
                     if getattr(ours.config, f.name) != getattr(theirs.config, f.name)}
        assert differing == set(DIFFERENCES.get(name, {})), f"{name}: {differing} differ from compose's"
        if name == "gateway":
            assert ours.config.engines == [url for url in theirs.config.engines if urlsplit(url).hostname in services]
        port = ours.config.port
        service = named(objects, "Service", name)
        assert container["ports"] == [{"name": "http", "containerPort": port}]
        assert service["spec"]["ports"][0]["port"] == port and service["spec"]["ports"][0]["targetPort"] == port
        compose_check = argv_of({"command": services[name]["healthcheck"]["test"][1:]})[-1]
        assert f"http://127.0.0.1:{port}{container['livenessProbe']['httpGet']['path']}" in compose_check
        routes = _routes(ours)
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            assert ("GET", container[probe]["httpGet"]["path"]) in routes, (name, probe)
            assert container[probe]["httpGet"]["port"] == "http"


# ---------------------------------------------------------------- what Kubernetes adds

def test_the_gateway_is_given_every_role_and_each_engine_its_role(rendered):
    objects = objects_of(rendered["prefill-decode"])
    gateway = named(objects, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0]
    engines = sorted(arg.removeprefix("--engine=") for arg in gateway["args"] if arg.startswith("--engine="))
    assert engines == ["http://engine-decode:8200", "http://engine-prefill:8200"]
    assert "--model-dir=/models/v2-lite" in gateway["args"], "a converted model's tokenizer is in its directory"
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in gateway["volumeMounts"]
    for role in ("prefill", "decode"):
        statefulset = named(objects, "StatefulSet", f"engine-{role}")
        service = named(objects, "Service", f"engine-{role}")
        assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
        assert service["spec"]["clusterIP"] == "None", "headless: the gateway resolves it to every ready replica"
        assert service["spec"]["selector"] == statefulset["spec"]["selector"]["matchLabels"]
        container = statefulset["spec"]["template"]["spec"]["containers"][0]
        assert f"--role={role}" in container["args"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_engine_memory_is_weights_pool_and_staging(rendered):
    values = load_values(K8S / "prefill-decode.yaml")
    memory = engine_memory("deepseek-v2-lite", "bfloat16", "bf16", 16, values["engine"]["overheadGiB"])
    assert 29 * GIB < memory.weights < 30 * GIB  # DeepSeek-V2-Lite's 15.7 B parameters in bf16
    assert 16 * GIB <= memory.pool < 16.1 * GIB
    # 6 slots (read-ahead 4 + 2) of the longest hit (163,840 tokens -> 4,096 blocks of 64), 27 x 576 bf16 per token
    assert memory.staging == 6 * 4096 * 64 * 576 * 2
    container = named(objects_of(rendered["prefill-decode"]), "StatefulSet", "engine-decode")
    limits = container["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["memory"] == f"{-(-memory.total // GIB)}Gi"


def test_the_autoscaler_follows_the_gateways_in_flight_gauge(rendered):
    from services.gateway.gateway_metrics import GatewayMetrics

    gauges = {m.name for m in GatewayMetrics().registry.collect() if m.type == "gauge"}
    for values in rendered:
        hpa = named(objects_of(rendered[values]), "HorizontalPodAutoscaler", "gateway")
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] in gauges
        assert "replicas" not in named(objects_of(rendered[values]), "Deployment", "gateway")["spec"]


def test_the_service_monitor_scrapes_every_service_with_its_compose_job_name(rendered):
    jobs = {job["job_name"] for job in yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())["scrape_configs"]}
    for values in rendered:
        objects = objects_of(rendered[values])
        monitor = named(objects, "ServiceMonitor", "deepinfer")
        wanted = monitor["spec"]["selector"]["matchLabels"]
        scraped = {o["metadata"]["labels"][monitor["spec"]["jobLabel"]] for o in objects if o["kind"] == "Service"
                   and wanted.items() <= o["metadata"]["labels"].items()}
        assert scraped == jobs, values
        assert monitor["spec"]["endpoints"][0]["authorization"]["credentials"]["key"] == "admin_token"


def test_volumes_map_to_the_nodes_that_hold_them(rendered):
    """Host paths: the kvstore DaemonSet and the engines run on the storage nodes and mount the same paths at the
    same places; s3: nothing is mounted, the credentials file is."""
    single = objects_of(rendered["single-host"])
    kvstore_pod = named(single, "DaemonSet", "kvstore")["spec"]["template"]["spec"]
    engine_pod = named(single, "StatefulSet", "engine")["spec"]["template"]["spec"]
    assert kvstore_pod["nodeSelector"].items() <= engine_pod["nodeSelector"].items()
    host_paths = lambda pod: [v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v]
    assert host_paths(kvstore_pod) == host_paths(engine_pod)
    s3 = objects_of(rendered["s3"])
    for kind, name in (("DaemonSet", "kvstore"), ("StatefulSet", "engine")):
        container = named(s3, kind, name)["spec"]["template"]["spec"]["containers"][-1]
        assert [a for a in container["args"] if a.startswith("--volume=")] == \
            ["--volume=s3://deepinfer-cache/vol0", "--volume=s3://deepinfer-cache/vol1"]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["AWS_SHARED_CREDENTIALS_FILE"] == manifests.S3_CREDENTIALS
        assert env["AWS_ENDPOINT_URL_S3"] == "http://minio.storage.svc:9000"
    assert not any(o["metadata"]["name"] == "redis" for o in s3), "an external Redis: no Valkey StatefulSet"


def test_the_documented_values_are_the_renderers():
    text = (ROOT / "docs" / "deployment.md").read_text()
    start, end = "<!-- values -->\n", "\n<!-- /values -->"
    assert start in text and end in text, "docs/deployment.md has no values table markers"
    assert text.split(start, 1)[1].split(end, 1)[0] == values_table(), \
        "docs/deployment.md's values table is stale: paste services.k8s.values.values_table()"
    assert check_values({"image": "i", "secrets": {"name": "s"}, "storage": {"volumes": ["/v"]}})
