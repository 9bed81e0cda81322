"""The cache outlives restarts: a `deepinfer up` stack (tiny preset, the launcher's default mode:
engines mount the volumes) SIGKILLed whole, Valkey included, or restarted with its Valkey data
deleted, hits what it cached before, with the same greedy answers."""
from __future__ import annotations

import asyncio
import shutil
import time

import pytest
import redis

from services.launcher import Stack, StackConfig
from tests.conftest import free_port, free_ports
from tests.fault_stack import admin_json, admin_post, audit_index, chat, prompt, wait_for_saves

pytestmark = pytest.mark.timeout(600)


def config(data) -> StackConfig:
    return StackConfig(preset="tiny", data_dir=str(data), engines=1, gateway_port=free_port(),
                       kvstore_port=free_port(), engine_port=free_ports(1), redis_port=free_port(),
                       ready_timeout_s=400)


def kill_every_process(stack: Stack) -> None:
    """SIGKILL gateway, engines, kvstore and Valkey: nothing gets to flush or shut down."""
    for proc in stack.procs.values():
        proc.kill()
    stack.valkey.terminate()
    for proc in stack.procs.values():
        proc.wait(30)
    stack.procs.clear()
    stack.valkey = None


def reconciled(stack: Stack, timeout_s: float = 120.0) -> dict:
    """The report of the kvstore's pass at start, once it has reconciled every volume."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = admin_json(stack, stack.kvstore_url + "/admin/reconcile")
        if status["last"] is not None and not status["last"]["busy"]:
            return status["last"]
        assert time.monotonic() < deadline, f"no complete reconciliation after {timeout_s} s: {status}"
        time.sleep(0.2)


def test_a_sigkilled_stack_restarted_with_the_same_arguments_hits_what_it_cached(tmp_path):
    cfg = config(tmp_path)
    content = prompt("restart")
    stack = Stack(cfg, quiet=True).start()
    try:
        answer, usage = chat(stack, content)
        assert usage.prompt_cache_hit_tokens == 0
        wait_for_saves(stack)
        index = redis.Redis.from_url(stack.redis_url, password=stack.secrets.redis_password)
        index.set("test:marker", 1)  # WAITAOF: every write so far (the saves' too) is fsynced to the AOF
        assert index.execute_command("WAITAOF", 1, 0, 10_000)[0] == 1
        index.close()
        kill_every_process(stack)
    finally:
        stack.stop()

    stack = Stack(cfg, quiet=True).start()
    try:
        report = reconciled(stack)
        # The index came back from Valkey's append-only file: reconciliation found every segment known.
        assert report["outcomes"]["known"] > 0 and report["outcomes"]["republished"] == 0
        again, usage = chat(stack, content)
        assert usage.prompt_cache_hit_tokens > 0 and again == answer
    finally:
        stack.stop()


def test_a_deleted_index_is_rebuilt_from_the_volumes_after_a_restart(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_KVSTORE_RECONCILE_MIN_AGE_S", "0")  # the kvstore (a child) reads it
    cfg = config(tmp_path)
    contents = [prompt(f"lost-index-{i}") for i in range(2)]
    stack = Stack(cfg, quiet=True).start()
    try:
        answers = [chat(stack, content)[0] for content in contents]
        wait_for_saves(stack)
    finally:
        stack.stop()
    shutil.rmtree(tmp_path / "valkey")  # AOF, snapshot, everything

    stack = Stack(cfg, quiet=True).start()
    try:
        report = reconciled(stack)
        assert report["outcomes"]["republished"] > 0 and report["quarantined"] == []
        for content, answer in zip(contents, answers):
            text, usage = chat(stack, content)
            assert usage.prompt_cache_hit_tokens > 0 and text == answer
        assert asyncio.run(audit_index(stack, stack.volumes)) > 0  # every republished entry reads back verified
        again = admin_post(stack, stack.kvstore_url + "/admin/reconcile", {})
        assert again["outcomes"]["republished"] == 0  # nothing left to republish
    finally:
        stack.stop()
