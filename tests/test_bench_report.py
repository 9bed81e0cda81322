"""bench.report: the one section format every benchmark writes, replace-or-append, and bench/'s size."""
from bench import report


def test_a_section_is_command_machine_one_table_figure_and_notes():
    body = report.section_body("python -m bench.x --a 1", report.machine(),
                               report.markdown_table(["n", "s"], [[1, "0.5"]]), "x.png", ["ratio 2.00x"])
    head, table, figure, notes = body.split("\n\n")
    command, machine = head.split("\n")
    assert command == "`python -m bench.x --a 1`\\"  # a hard line break before the machine line
    assert machine.startswith("Machine: ") and "cores" in machine and "(1/5/15 min) at the start" in machine
    assert table.splitlines() == ["| n | s |", "|---|---|", "| 1 | 0.5 |"]
    assert figure == "![x](bench/results/x.png)" and notes == "- ratio 2.00x"
    long = report.section_body("python -m bench.x " + "--flag value " * 12, "Machine line", "| t |", None,
                               ["word " * 40])
    assert long.startswith("```sh\npython -m bench.x --flag value") and "\n```\n\nMachine: Machine line" in long
    assert max(len(line) for line in long.split("```")[-1].splitlines()) <= report.NOTE_WIDTH  # notes wrapped


def test_update_section_replaces_its_own_section_and_appends_a_new_one(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# Benchmarks\n\n## A\n\nold\n\n## B\n\nkept\n")
    report.update_section("A", "new", path)
    report.update_section("C", "added", path)
    assert path.read_text() == "# Benchmarks\n\n## A\n\nnew\n\n## B\n\nkept\n\n## C\n\nadded\n"


def test_the_command_shown_leaves_out_what_only_chooses_the_output():
    argv = ["--lengths", "2K", "--no-report", "--name", "smoke", "--report-from=x.json"]
    assert report.command_line("python -m bench.x", argv) == "python -m bench.x --lengths 2K"


def test_bench_holds_at_most_20_python_files_outside_the_lab():
    assert len(list((report.ROOT / "bench").glob("*.py"))) <= 20
    assert (report.ROOT / "bench" / "lab" / "__init__.py").exists()
