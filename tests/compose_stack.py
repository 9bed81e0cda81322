"""The compose stack for real: `make compose-test` (CI runs it after `make test`).

Builds the image, brings compose.yaml up (tiny preset), and drives it with the official openai
client as a user would: a long system prompt twice (the second a hit with the same greedy answer),
two engine replicas each serving (pinned with the admin header), an engine replica killed in the
middle of a stream, `restart`, then `down` and `up` without -v (the prefix still hits), then
`down -v`. Everything it starts is removed at the end, also on failure: the compose project (its
containers, network and volumes), its secret files, and dockerd when this script started it.
Kept on purpose, as the cache of the next run: the images (the base image and the build's layers)
and the volume deepinfer-ci-jax-cache (compiled XLA programs).

Setup, as a new user would do it: Debian's docker.io and docker-compose (and debootstrap) are
installed when missing; dockerd is started when none answers; the base image is
python:3.11-slim when it is present or can be pulled, else a local one (docker/local_base.sh).
Compose is `docker compose` (v2) where it exists, else `docker-compose` (v1).

    python tests/compose_stack.py        (as root where it must install packages or start dockerd)
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESET = "tiny"
OFFICIAL_BASE = "python:3.11-slim"
LOCAL_BASE = "deepinfer-base:bookworm"
JAX_CACHE_VOLUME = "deepinfer-ci-jax-cache"  # kept between runs, like the images
PULL_TIMEOUT_S = 60
READY_TIMEOUT_S = 900  # a cold start compiles the model's programs on 2 cores
SYSTEM = ("You are DeepInfer's test assistant. Follow the house rules: be brief, cite sources, never "
          "invent numbers, answer in the user's language, and prefer tables for comparisons. ") * 12
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hello."}]
TOKEN_SCRIPT = "open('/run/secrets/admin_token').read().strip()"  # read inside a container


def say(message: str) -> None:
    print(f"[compose-test {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(*argv: str, check: bool = True, timeout: float = 1800, quiet: bool = False, **kw) -> subprocess.CompletedProcess:
    if not quiet:
        say("$ " + " ".join(argv))
    return subprocess.run(argv, check=check, timeout=timeout, text=True,
                          stdout=subprocess.PIPE if quiet else None, stderr=subprocess.PIPE if quiet else None, **kw)


# ---------------------------------------------------------------- Docker itself

def install_docker() -> None:
    missing = [package for program, package in (("docker", "docker.io"), ("dockerd", "docker.io"),
                                                  ("debootstrap", "debootstrap"))
               if shutil.which(program) is None]
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0 \
            and shutil.which("docker-compose") is None:
        missing.append("docker-compose")
    if missing:
        if os.geteuid() != 0:
            sys.exit(f"compose-test: {missing} must be installed: run as root (or install them)")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        run("apt-get", "update", "-q", env=env)
        run("apt-get", "install", "-y", "-q", "--no-install-recommends", *sorted(set(missing)), env=env)


def daemon_answers() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


def start_dockerd(cleanup: ExitStack, workdir: Path) -> None:
    if daemon_answers():
        return
    if os.geteuid() != 0:
        sys.exit("compose-test: no Docker daemon answers and only root can start one here")
    log = open(workdir / "dockerd.log", "w")
    say(f"starting dockerd (log {log.name})")
    daemon = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop() -> None:
        say("stopping the dockerd this test started")
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log.close()
    cleanup.callback(stop)
    deadline = time.monotonic() + 60
    while not daemon_answers():
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"dockerd did not start: {(workdir / 'dockerd.log').read_text()[-2000:]}")
        time.sleep(0.5)


def base_image() -> str:
    """The official image when it is here or can be pulled, else the local one (built once)."""
    if os.environ.get("DEEPINFER_BASE_IMAGE"):
        return os.environ["DEEPINFER_BASE_IMAGE"]
    for image in (OFFICIAL_BASE, LOCAL_BASE):
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode == 0:
            say(f"base image {image} is here")
            return image
    try:
        pulled = subprocess.run(["docker", "pull", OFFICIAL_BASE], capture_output=True, text=True,
                                timeout=PULL_TIMEOUT_S)
        if pulled.returncode == 0:
            return OFFICIAL_BASE
        reason = pulled.stderr.strip().splitlines()[-1:]
    except subprocess.TimeoutExpired:
        reason = [f"no answer in {PULL_TIMEOUT_S} s"]
    say(f"{OFFICIAL_BASE} cannot be pulled ({' '.join(reason)}); building {LOCAL_BASE} from the Debian mirror")
    run(str(ROOT / "docker/local_base.sh"), LOCAL_BASE)
    return LOCAL_BASE


def compose_command() -> list[str]:
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"]


def host_index_url() -> str | None:
    """The index the host's pip uses, when it names one the containers can reach (not a file://)."""
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        got = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                             capture_output=True, text=True)
        url = got.stdout.strip() if got.returncode == 0 else ""
    return url if url.startswith(("http://", "https://")) else None


# ---------------------------------------------------------------- the compose project

class Project:
    def __init__(self, workdir: Path, compose: list[str], base: str, port: int):
        self.name = f"deepinfer-ci-{os.getpid()}"
        secrets = workdir / "secrets"
        run(sys.executable, "-m", "services.cli", "secrets", "--dir", str(secrets), cwd=ROOT)
        for path in secrets.iterdir():
            os.chown(path, 10001, -1)  # the containers' user; the files stay 0600
        self.admin_token = (secrets / "admin_token").read_text().strip()
        # The secrets come from this run's directory, not ./secrets of the checkout. ("version":
        # compose v1 reads a file without one as the old v1 format; v2 ignores it.)
        override = workdir / "compose.override.yaml"
        # The JAX compilation cache outlives the project (`down -v` keeps an external volume), so
        # that the next run on this machine starts its engines without compiling again.
        run("docker", "volume", "create", JAX_CACHE_VOLUME, quiet=True)
        override.write_text(json.dumps({"version": "3.9", "secrets": {
            path.name: {"file": str(path)} for path in secrets.iterdir()},
            "volumes": {"jax-cache": {"external": True, "name": JAX_CACHE_VOLUME}}}))
        self.argv = [*compose, "-p", self.name, "-f", str(ROOT / "compose.yaml"), "-f", str(override)]
        self.env = dict(os.environ, DEEPINFER_PRESET=PRESET, DEEPINFER_BASE_IMAGE=base,
                        DEEPINFER_GATEWAY_PORT=str(port), DEEPINFER_OPEN_ACCESS="true")
        if index := host_index_url():
            self.env["DEEPINFER_PIP_INDEX_URL"] = index
        self.url = f"http://127.0.0.1:{port}"

    def __call__(self, *args: str, check: bool = True, quiet: bool = False, timeout: float = 1800):
        return run(*self.argv, *args, check=check, quiet=quiet, timeout=timeout, cwd=ROOT, env=self.env)

    def containers(self, service: str) -> list[str]:
        return self("ps", "-q", service, quiet=True).stdout.split()

    def engine_urls(self) -> dict[str, str]:
        """Engine replica URL (as the gateway resolves it) -> container id."""
        urls = {}
        for container in self.containers("engine"):
            networks = json.loads(run("docker", "inspect", "-f", "{{json .NetworkSettings.Networks}}", container,
                                      quiet=True).stdout)
            for network in networks.values():
                urls[f"http://{network['IPAddress']}:8200"] = container
        return urls

    def logs(self) -> None:
        self("logs", "--no-color", "--tail", "60", check=False, timeout=120)


def engine_stats(container: str) -> dict:
    """The engine's own /admin/stats, asked from inside its container (its port is not published)."""
    script = ("import json, urllib.request; print(urllib.request.urlopen(urllib.request.Request("
              "'http://127.0.0.1:8200/admin/stats', headers={'Authorization': 'Bearer ' + "
              f"{TOKEN_SCRIPT}}}), timeout=5).read().decode())")
    return json.loads(run("docker", "exec", container, "python", "-c", script, quiet=True).stdout)


def decode_serves(container: str) -> bool:
    """Whether the engine's CPU serves decode attention by our kernel (AVX-512, AMX, or AVX2 and FMA), asked in
    its container."""
    script = "from model import cpu_kernels; print(cpu_kernels.decode_serves())"
    return run("docker", "exec", container, "python", "-c", script, quiet=True).stdout.strip() == "True"


def engine_requests(container: str) -> float:
    script = ("import urllib.request; print(urllib.request.urlopen(urllib.request.Request("
              "'http://127.0.0.1:8200/metrics', headers={'Authorization': 'Bearer ' + "
              f"{TOKEN_SCRIPT}}}), timeout=5).read().decode())")
    text = run("docker", "exec", container, "python", "-c", script, quiet=True).stdout
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("deepinfer_engine_requests_total{"))


def gateway_stats(project: Project) -> dict:
    request = urllib.request.Request(project.url + "/admin/stats",
                                     headers={"Authorization": f"Bearer {project.admin_token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def wait_ready(project: Project, engines: int, timeout_s: float = READY_TIMEOUT_S) -> float:
    """Seconds until the gateway routes to `engines` distinct, ready replicas."""
    started = time.monotonic()
    while True:
        try:
            routable = {e["url"] for e in gateway_stats(project)["engines"] if e["routable"]}
            if len(routable) == engines:
                return time.monotonic() - started
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            pass
        if time.monotonic() - started > timeout_s:
            project.logs()
            raise TimeoutError(f"the gateway did not see {engines} ready engine(s) in {timeout_s:.0f} s")
        time.sleep(2)


def wait_for_saves(project: Project) -> None:
    deadline = time.monotonic() + 120
    while sum(engine_stats(c)["pending_saves"] for c in project.containers("engine")):
        if time.monotonic() > deadline:
            raise TimeoutError("engine saves still pending after 120 s")
        time.sleep(0.5)


# ---------------------------------------------------------------- what a user sees

def client(project: Project):
    from openai import OpenAI
    return OpenAI(base_url=project.url + "/v1", api_key="unused-in-open-access", max_retries=0, timeout=300)


def ask(project: Project, pin: str | None = None, max_tokens: int = 8) -> tuple[int, str]:
    headers = {"X-DeepInfer-Engine": pin, "X-DeepInfer-Admin-Token": project.admin_token} if pin else None
    reply = client(project).chat.completions.create(model="deepseek-chat", messages=MESSAGES, temperature=0,
                                                     max_tokens=max_tokens, extra_headers=headers)
    hits = reply.usage.prompt_cache_hit_tokens
    return hits, reply.choices[0].message.content


def check_miss_then_hit(project: Project) -> str:
    misses, first = ask(project)
    wait_for_saves(project)
    hits, again = ask(project)
    say(f"long system prompt: first {misses} hit tokens, second {hits} hit tokens; answers {first!r} {again!r}")
    assert misses == 0 and hits > 0, (misses, hits)
    assert again == first, (first, again)
    return first


def check_each_replica_serves(project: Project, answer: str) -> dict[str, str]:
    replicas = project.engine_urls()
    assert len(replicas) == 2, replicas
    for url, container in replicas.items():
        before = engine_requests(container)
        hits, text = ask(project, pin=url)
        served = engine_requests(container) - before
        attention = engine_stats(container)["attention_backend"]
        say(f"pinned to {url} ({container[:12]}): {hits} hit tokens, {served:.0f} request(s) counted there, "
            f"attention backend {attention}")
        assert served == 1 and hits > 0 and text == answer, (url, served, hits, text)
        assert attention == ("cpu" if decode_serves(container) else "xla"), "the image's g++ built it"
    return replicas


def check_replica_killed_mid_stream(project: Project, replicas: dict[str, str], answer: str) -> None:
    """`docker kill` of the replica serving a stream: what the client sees, then the survivor serves.
    Pinned to the victim, so that the request is on it whatever the router would choose."""
    victim_url, victim = next(iter(replicas.items()))
    headers = {"X-DeepInfer-Engine": victim_url, "X-DeepInfer-Admin-Token": project.admin_token}
    stream = client(project).chat.completions.create(
        model="deepseek-chat", messages=MESSAGES, temperature=0, max_tokens=6000, stream=True,
        extra_headers=headers)
    chunks, outcome = 0, "stream ended normally"
    killed_at = None
    try:
        for _ in stream:
            chunks += 1
            if chunks == 3:
                killed_at = time.monotonic()
                threading.Thread(target=run, args=("docker", "kill", victim), kwargs={"quiet": True}).start()
    except Exception as error:  # what the openai client raises is the thing measured
        outcome = f"{type(error).__name__}: {error}"
    seen_after = time.monotonic() - killed_at if killed_at else float("nan")
    say(f"killed {victim_url} after 3 chunks: the client got {chunks} chunks, then {outcome!r} "
        f"{seen_after:.2f} s after the kill")
    assert killed_at is not None and outcome != "stream ended normally", outcome
    started = time.monotonic()
    hits, text = ask(project)  # unpinned: the router must not send it to the dead replica
    say(f"next unpinned request: {hits} hit tokens, same answer: {text == answer}, "
        f"{time.monotonic() - started:.2f} s")
    assert hits > 0 and text == answer
    victim_state = [e for e in gateway_stats(project)["engines"] if e["url"] == victim_url]
    say(f"the gateway's view of the killed replica: {victim_state}")
    assert all(not e["routable"] for e in victim_state), victim_state
    # Docker counts `docker kill` as a manual stop: `restart: unless-stopped` does not bring it back
    # (a crash would be restarted). `up --scale` starts it again; the gateway routes to it once its
    # probe passes.
    state = run("docker", "inspect", "-f", "{{.State.Status}} exit={{.State.ExitCode}} restarts={{.RestartCount}}",
                victim, quiet=True).stdout.strip()
    mark = time.monotonic()
    project("up", "-d", "--no-build", "--scale", "engine=2")
    wait_ready(project, 2, timeout_s=300)
    say(f"the killed replica was {state!r}; after `up --scale engine=2` both replicas are routable "
        f"again in {time.monotonic() - mark:.0f} s")


def main() -> int:
    # SIGTERM (CI's timeout, a killed job) unwinds like Ctrl-C, so that the cleanup below runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    timings = {}
    with ExitStack() as cleanup:
        workdir = Path(tempfile.mkdtemp(prefix="deepinfer-compose-"))
        cleanup.callback(shutil.rmtree, workdir, ignore_errors=True)
        install_docker()
        start_dockerd(cleanup, workdir)
        base = base_image()
        project = Project(workdir, compose_command(), base, port=free_port())
        cleanup.callback(lambda: project("down", "-v", "--remove-orphans", "--timeout", "20", check=False))
        mark = time.monotonic()
        project("build", "engine")  # one build; every service runs the same image
        timings["build"] = time.monotonic() - mark
        try:
            mark = time.monotonic()
            project("up", "-d", "--no-build")
            wait_ready(project, 1)
            timings["up"] = time.monotonic() - mark
            answer = check_miss_then_hit(project)

            mark = time.monotonic()
            project("up", "-d", "--no-build", "--scale", "engine=2")
            wait_ready(project, 2)
            timings["scale to 2"] = time.monotonic() - mark
            replicas = check_each_replica_serves(project, answer)
            check_replica_killed_mid_stream(project, replicas, answer)

            mark = time.monotonic()
            project("restart")
            wait_ready(project, len(project.containers("engine")))
            timings["restart"] = time.monotonic() - mark
            hits, text = ask(project)
            say(f"after `restart`: {hits} hit tokens, same answer: {text == answer}")
            assert hits > 0 and text == answer

            mark = time.monotonic()
            project("down", "--timeout", "40")
            project("up", "-d", "--no-build")
            wait_ready(project, 1)
            timings["down + up"] = time.monotonic() - mark
            hits, text = ask(project)
            say(f"after `down` and `up` (volumes kept): {hits} hit tokens, same answer: {text == answer}")
            assert hits > 0 and text == answer
        except BaseException:
            project.logs()
            raise
    timings["total"] = time.monotonic() - started
    say("passed; seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()))
    return 0


def free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
