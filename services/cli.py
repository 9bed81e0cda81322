"""`deepinfer` command line: model weights (`model init|convert`), the stack (`up`, `status`, `stop`),
deployment secrets (`secrets`), Kubernetes manifests (`deploy k8s`), benchmarks (`bench`)."""
from __future__ import annotations

import argparse
import sys


BENCHES = {"ttft": "bench.ttft_bench", "trace": "bench.trace_bench", "serve": "bench.serve_bench",
           "headline": "bench.headline", "kv": "bench.kv_bench"}


def _model_init(args: argparse.Namespace) -> int:
    from model.config import preset
    from model.weights import init_model, save_model

    cfg = preset(args.preset, **({"init_seed": args.seed} if args.seed is not None else {}))
    saved = save_model(init_model(cfg, progress=True), cfg, args.out)
    print(f"saved {cfg.name} to {args.out} (fingerprint {saved.fingerprint})")
    return 0


def _model_convert(args: argparse.Namespace) -> int:
    from model.convert import convert

    saved = convert(args.hf, args.out, name=args.name)
    print(f"converted {args.hf} -> {args.out} (fingerprint {saved.fingerprint})")
    return 0


def _secrets(args: argparse.Namespace) -> int:
    from pathlib import Path

    from services.deployment_secrets import load_or_create
    from services.valkey_process import write_private

    directory = Path(args.dir)
    load_or_create(directory, {})
    if not (directory / "api_keys").exists():  # KEY:TENANT,... for the gateway; empty: no keys
        write_private(directory / "api_keys", "")
    print(f"deployment secrets in {directory} (mode 0600; existing ones kept)")
    return 0


def _deploy_k8s(args: argparse.Namespace) -> int:
    from pathlib import Path

    from services.k8s.render import render, write

    files = render(args.values)  # every check passes before anything is written
    if args.out is None:
        print("---\n".join(files.values()), end="")
    else:
        write(files, Path(args.out))
        print(f"{len(files)} files in {args.out}: {', '.join(files)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    model = commands.add_parser("model", help="create or convert model weights").add_subparsers(
        dest="model_command", required=True)
    init = model.add_parser("init", help="deterministic random weights for a preset, saved with orbax")
    init.add_argument("--preset", default="mini", help="tiny, mini, deepseek-v2-lite, deepseek-v3")
    init.add_argument("--out", required=True, help="directory to create")
    init.add_argument("--seed", type=int, default=None, help="override the preset's init seed")
    init.set_defaults(run=_model_init)
    conv = model.add_parser("convert", help="Hugging Face DeepSeek-V2/V3 safetensors -> DeepInfer model")
    conv.add_argument("--hf", required=True, help="directory with config.json and *.safetensors")
    conv.add_argument("--out", required=True, help="directory to create")
    conv.add_argument("--name", default=None, help="model name (default: the HF directory's name)")
    conv.set_defaults(run=_model_convert)
    commands.add_parser("up", help="start the whole stack on this machine (see `deepinfer up --help`)")
    commands.add_parser("status", help="what the stack from a data dir is doing (`deepinfer status --help`)")
    commands.add_parser("stop", help="stop the stack started from a data dir (`deepinfer stop --help`)")
    secrets = commands.add_parser("secrets", help="create the deployment's secret files (for compose): "
                                                  "service_token, salt_key, mac_key, admin_token, redis_password, "
                                                  "api_keys; existing files are kept")
    secrets.add_argument("--dir", default="secrets", help="directory to write them to (default: ./secrets)")
    secrets.set_defaults(run=_secrets)
    deploy = commands.add_parser("deploy", help="deployment manifests: `deepinfer deploy k8s --help`").add_subparsers(
        dest="deploy_command", required=True)
    k8s = deploy.add_parser("k8s", help="Kubernetes manifests of the stack, from a values file (docs/deployment.md)")
    k8s.add_argument("--values", required=True, help="the values file (YAML; deploy/k8s/*.yaml are examples)")
    k8s.add_argument("--out", default=None, help="directory to write one YAML file per component to "
                                                 "(default: every object to stdout, for `kubectl apply -f -`)")
    k8s.set_defaults(run=_deploy_k8s)
    bench = commands.add_parser("bench", help="benchmarks: `deepinfer bench ttft|trace|serve|headline|kv --help`")
    bench.add_argument("which", choices=sorted(BENCHES))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["up"]:  # the stack has its own flags (services.launcher.StackConfig)
        from services.launcher import up

        return up(argv[1:])
    if argv[:1] == ["status"]:
        from services.stack_status import status

        return status(argv[1:])
    if argv[:1] == ["stop"]:
        from services.stack_stop import stop

        return stop(argv[1:])
    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in BENCHES:  # each benchmark parses its own flags
        import importlib

        return importlib.import_module(BENCHES[argv[1]]).main(argv[2:])
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError, TimeoutError) as error:
        print(f"deepinfer: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
