"""The flag tables of README.md (`deepinfer up`) and docs/operations.md (every service), rendered from the
config dataclasses' argparse parsers (services.common.config.flag_rows) between marker comments:

    <!-- flags:up -->
    ...generated...
    <!-- /flags:up -->

    python -m services.flag_docs           # rewrites the tables in place
    python -m services.flag_docs --check   # exit 1 naming each stale table (tests/test_docs.py runs it)
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from services.common.config import flag_rows

ROOT = Path(__file__).resolve().parent.parent


def _configs() -> dict[str, tuple[type, str]]:
    """Table name -> (config dataclass, environment prefix), imported here so `--help` paths stay light."""
    from services.engine.config import EngineConfig
    from services.gateway.config import ENV_PREFIX, GatewayConfig
    from services.kvstore.config import KvstoreConfig
    from services.launcher import StackConfig

    return {"up": (StackConfig, "up"), "gateway": (GatewayConfig, ENV_PREFIX),
            "kvstore": (KvstoreConfig, "kvstore"), "engine": (EngineConfig, "engine")}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(name: str) -> str:
    cls, prefix = _configs()[name]
    lines = ["| flag | variable | default | meaning |", "|---|---|---|---|"]
    for flags, var, default, meaning in flag_rows(cls, prefix):
        shown = flags if flags.startswith("(") else ", ".join(f"`{flag}`" for flag in flags.split(", "))
        if ", `--no-" in shown:  # a BooleanOptionalAction: --x and --no-x
            shown = "`--[no-]" + shown.split(",")[0][3:]
        lines.append(f"| {shown} | `{var}` | {_cell(default)} | {_cell(meaning)} |")
    return "\n".join(lines)


FILES = {ROOT / "README.md": ("up",), ROOT / "docs" / "operations.md": ("up", "gateway", "kvstore", "engine")}


def updated(text: str, names: tuple[str, ...], where: Path) -> str:
    for name in names:
        pattern = re.compile(rf"(<!-- flags:{name} -->\n).*?(<!-- /flags:{name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"{where}: no <!-- flags:{name} --> ... <!-- /flags:{name} --> markers")
        text = pattern.sub(lambda m: m.group(1) + render(name) + "\n" + m.group(2), text, count=1)
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    check = argv == ["--check"]
    if argv not in ([], ["--check"]):
        print("usage: python -m services.flag_docs [--check]", file=sys.stderr)
        return 2
    stale = []
    for path, names in FILES.items():
        text = path.read_text()
        new = updated(text, names, path)
        if new != text:
            stale.append(path)
            if not check:
                path.write_text(new)
    for path in stale:
        print(f"{path.relative_to(ROOT)}: flag tables {'are stale (run python -m services.flag_docs)' if check else 'rewritten'}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
