"""The manual holds: README.md and BENCHMARKS.md within their line limits, every fenced shell command in README.md
and docs/ run by a named test (RUN_BY) or listed with its reason in docs/untested-commands, every relative link
and anchor resolving, the flag tables as argparse has them."""
from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

from services import flag_docs
from services.common.config import flag_rows

ROOT = Path(__file__).resolve().parents[1]
MANUAL = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [*MANUAL, ROOT / "BENCHMARKS.md", ROOT / "RELIABILITY.md", ROOT / "bench" / "lab" / "README.md"]
SHELL = ("sh", "bash", "shell")
MAX_LINES = {"README.md": 300, "BENCHMARKS.md": 250}
MAX_WIDTH = 160

# Each documented command -> the test that runs it ("tests/FILE.py::FUNCTION"); the command's flags must appear in
# that test's module. Commands no test can run (real checkpoints, GPUs, Docker Hub) are in docs/untested-commands.
RUN_BY = {
    "make up": "tests/test_quick_start.py::test_quick_start_as_written",
    "curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{\"model\": "
    "\"deepseek-chat\", \"max_tokens\": 16, \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}]}'":
        "tests/test_quick_start.py::test_quick_start_as_written",
    "deepinfer up --detach": "tests/test_operator_stack.py::test_detached_up_returns_once_ready_with_a_private_run_file",
    "deepinfer status": "tests/test_operator_stack.py::test_status_names_each_process_and_the_numbers",
    "deepinfer stop": "tests/test_operator_stack.py::test_stop_stops_every_process_and_frees_every_port",
    "deepinfer up --detach --preset tiny --data-dir data":
        "tests/test_operator_stack.py::test_detached_up_returns_once_ready_with_a_private_run_file",
    "deepinfer status --data-dir data": "tests/test_operator_stack.py::test_status_names_each_process_and_the_numbers",
    "deepinfer stop --data-dir data": "tests/test_operator_stack.py::test_stop_stops_every_process_and_frees_every_port",
    "deepinfer secrets --dir secrets": "tests/test_compose.py::test_deployment_secrets_are_shared_files_never_argv_or_environment",
    "deepinfer deploy k8s --values deploy/k8s/single-host.yaml --out deploy/k8s/rendered/single-host":
        "tests/test_deploy_k8s.py::test_the_committed_manifests_are_current",
    **{f"python -m services.{service} --help": "tests/test_docs.py::test_every_services_help_lists_its_table"
       for service in ("gateway", "kvstore", "engine")},
}


def fenced_blocks(path: Path) -> list[tuple[str, str, int]]:
    """(language, text, first line number) of every fenced block in a Markdown file."""
    blocks, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            lang, start = lines[i][3:].strip(), i + 1
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                i += 1
            blocks.append((lang, "\n".join(lines[start:i]), start + 1))
        i += 1
    return blocks


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced blocks."""
    out, inside = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            inside = not inside
        elif not inside:
            out.append((number, line))
    return out


def shell_commands(text: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments and blank lines dropped."""
    commands, pending = [], ""
    for line in text.splitlines():
        line = pending + line.strip()
        if line.endswith("\\"):
            pending = line[:-1].strip() + " "
            continue
        pending = ""
        words = shlex.split(line, comments=True)
        if words:
            cut = line.find(" #")  # a trailing comment: where the words before it are all the line's words
            while cut > 0 and shlex.split(line[:cut], comments=True) != words:
                cut = line.find(" #", cut + 1)
            commands.append(line[:cut].strip() if cut > 0 else line)
    return commands


def documented_commands() -> dict[str, str]:
    """Every shell command in README.md and docs/ -> where it is (file:line)."""
    found = {}
    for path in MANUAL:
        for lang, text, line in fenced_blocks(path):
            if lang in SHELL:
                for command in shell_commands(text):
                    found.setdefault(command, f"{path.relative_to(ROOT)}:{line}")
    return found


def untested_commands() -> dict[str, str]:
    """docs/untested-commands: `COMMAND ## REASON` per line (# lines are comments)."""
    entries = {}
    for line in (ROOT / "docs" / "untested-commands").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            command, sep, reason = line.partition(" ## ")
            assert sep and reason.strip(), f"docs/untested-commands: {line!r} gives no reason after ' ## '"
            entries[command.strip()] = reason.strip()
    return entries


def test_readme_and_benchmarks_stay_within_their_line_limits():
    for name, limit in MAX_LINES.items():
        count = len((ROOT / name).read_text().splitlines())
        assert count <= limit, f"{name} has {count} lines (at most {limit})"


def generated_lines(path: Path) -> set[int]:
    """Line numbers inside the flag tables' markers (docs/operations.md's rows carry each flag's whole help)."""
    inside, out = False, set()
    for number, line in enumerate(path.read_text().splitlines(), 1):
        inside = (inside or line.startswith("<!-- flags:")) and not line.startswith("<!-- /flags:")
        if inside:
            out.add(number)
    return out


def test_no_line_outside_code_blocks_is_wider_than_160_characters():
    """README.md and BENCHMARKS.md everywhere; docs/ except the generated flag tables of every service."""
    wide = [f"{path.relative_to(ROOT)}:{number}: {len(line)} characters"
            for path in [*MANUAL, ROOT / "BENCHMARKS.md"] for number, line in prose_lines(path)
            if len(line) > MAX_WIDTH and (path.name == "README.md" or number not in generated_lines(path))]
    assert not wide, "\n".join(wide)


def test_every_fenced_block_says_its_language():
    bare = [f"{path.relative_to(ROOT)}:{line}" for path in MANUAL for lang, _, line in fenced_blocks(path) if not lang]
    assert not bare, "fenced blocks without a language (sh, text, python, ...): " + ", ".join(bare)


def _test_source(name: str) -> tuple[str, bool]:
    """The module source of test `tests/FILE.py::FUNCTION`, and whether the function is defined in it."""
    file, _, function = name.partition("::")
    path = ROOT / file
    if not path.is_file():
        return "", False
    source = path.read_text()
    defined = any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function
                  for node in ast.walk(ast.parse(source)))
    return source, defined


def test_every_documented_command_is_run_by_a_named_test_or_listed_with_its_reason():
    documented, untested = documented_commands(), untested_commands()
    problems = [f"{where}: `{command}` is neither in RUN_BY (tests/test_docs.py) nor in docs/untested-commands"
                for command, where in documented.items() if command not in RUN_BY and command not in untested]
    for command, test in RUN_BY.items():
        source, defined = _test_source(test)
        if not defined:
            problems.append(f"RUN_BY: `{command}` names {test}, which does not exist")
        missing = [word for word in shlex.split(command) if word.startswith("--") and word.split("=")[0] not in source]
        if missing:
            problems.append(f"RUN_BY: {test} never mentions {missing} of `{command}`")
    problems += [f"`{command}` is listed but no longer documented" for command in [*RUN_BY, *untested]
                 if command not in documented]
    assert not problems, "\n".join(problems)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, links to their text, punctuation but `_` and `-` dropped, spaces
    to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path):
        match = re.match(r"#{1,6} (.+)", line)
        if match:
            base = slug(match.group(1))
            out.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return out


@pytest.mark.parametrize("path", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(path):
    if not path.exists():
        pytest.fail(f"{path.relative_to(ROOT)} is missing")
    broken = []
    for number, line in prose_lines(path):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            if not resolved.exists():
                broken.append(f"{path.relative_to(ROOT)}:{number}: {target}: no such file")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{path.relative_to(ROOT)}:{number}: {target}: no such heading")
    assert not broken, "\n".join(broken)


def test_the_flag_tables_are_what_argparse_accepts():
    assert flag_docs.main(["--check"]) == 0, "run: python -m services.flag_docs"


def test_every_services_help_lists_its_table():
    """`python -m services.X --help`, as docs/operations.md shows it, lists every flag of X's table there."""
    import subprocess
    import sys

    for service in ("gateway", "kvstore", "engine"):
        said = subprocess.run([sys.executable, "-m", f"services.{service}", "--help"], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert said.returncode == 0, said.stderr
        for flags, var, _, _ in flag_rows(*flag_docs._configs()[service]):
            shown = var.removesuffix("[_FILE]") if flags.startswith("(") else flags.split(", ")[0]
            assert shown in said.stdout, f"python -m services.{service} --help does not list {shown}"


def test_bench_holds_user_facing_benches_and_their_helpers_only():
    """At most 20 Python files outside bench/lab/; each is run (`python -m bench.X`) or imported by a bench or the
    CLI, never only by tests; each lab file has its line in bench/lab/README.md."""
    bench = ROOT / "bench"
    files = sorted(bench.glob("*.py"))
    assert len(files) <= 20, [f.name for f in files]
    users = {path: path.read_text() for path in [*files, *(bench / "lab").glob("*.py"), ROOT / "services" / "cli.py"]}
    for path in files:
        if path.name == "__init__.py":
            continue
        module = path.stem
        runnable = '__name__ == "__main__"' in path.read_text()
        imported = any(re.search(rf"\bbench(\.| import .*\b){module}\b|\"bench\.{module}\"", text)
                       for other, text in users.items() if other != path)
        assert runnable or imported, f"bench/{path.name} is neither run nor imported by a bench or the CLI"
    lab = (bench / "lab" / "README.md").read_text()
    missing = [p.name for p in (bench / "lab").glob("*.py") if p.name != "__init__.py" and f"`{p.name}`" not in lab]
    assert not missing, f"bench/lab/README.md has no line for {missing}"
