"""The benchmarks' record: each benchmark's latest ``--json`` result, saved in
``benchmarks/results/<name>.json`` with the command, commit and date that made it, and the
README's benchmark table and docs/benchmarks.md rendered from those files.

    python tools/benchmark_results.py record dht [-- --sizes 16 64]   # run it, save its result
    python tools/benchmark_results.py table          # rewrite the README table and docs/benchmarks.md
    python tools/benchmark_results.py table --check  # exit 1 if either is stale

The README's table has one row per benchmark (how many targets its saved result meets, and
the first figure short of one); docs/benchmarks.md lists every saved figure with its target
and verdict. A benchmark with no saved result yet says so, so a figure never shows a value
older than its file.
"""

from __future__ import annotations

import ast
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import click

from agora_localswarm import checkout

ROOT = checkout.root()
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
README = ROOT / "README.md"
RECORD = ROOT / "docs" / "benchmarks.md"
BEGIN = "<!-- benchmark table: written by tools/benchmark_results.py table -->"
END = "<!-- end of benchmark table -->"


def benchmark_names() -> list[str]:
    return sorted(p.stem for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))


def record(name: str, args: list[str]) -> Path:
    """Run ``benchmarks/<name>.py --json args``; save its result with where it came from."""
    if name not in benchmark_names():
        raise click.ClickException(f"no benchmark {name!r}; there are: {', '.join(benchmark_names())}")
    command = [sys.executable, str(BENCHMARKS / f"{name}.py"), "--json", *args]
    click.echo(f"running {' '.join(['benchmarks/' + name + '.py', '--json', *args])} ...", err=True)
    done = subprocess.run(
        command, cwd=ROOT, stdout=subprocess.PIPE, text=True
    )  # the benchmark's deadline bounds it
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise click.ClickException(f"{name} exited {done.returncode} without a result; nothing saved")
    result = json.loads(lines[-1])
    result["command"] = " ".join(["python", f"benchmarks/{name}.py", "--json", *args])
    result["recorded"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    result["commit"] = _commit()
    result["machine"] = f"{os.cpu_count()} cores, {platform.system()} {platform.machine()}"
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "packages"], cwd=ROOT, capture_output=True, text=True
    )
    return done.stdout.strip() + ("+changes" if dirty.stdout.strip() else "") if done.returncode == 0 else "?"


TARGET = re.compile(r"^(?P<ratio>ratio )?(?P<op><=|>=|==|<|>)?\s*(?P<bound>-?[0-9][0-9.]*)(?:\s|:|$)")
COMPARE = {
    "<=": lambda a, b: a <= b,
    ">=": lambda a, b: a >= b,
    "<": lambda a, b: a < b,
    ">": lambda a, b: a > b,
    "==": lambda a, b: abs(a - b) <= 1e-9 * max(1.0, abs(b)),
}


def met(figure: dict) -> bool | None:
    """Whether a figure meets its target: a target that starts ``[ratio] OP NUMBER`` bounds the
    figure's ratio (with ``ratio``) or its value (a bare number means ``==``). None where the
    target is words only (``report: held``): it is judged by reading."""
    match = TARGET.match(figure.get("target") or "")
    if match is None:
        return None
    measured = figure.get("ratio") if match["ratio"] else figure.get("value")
    if measured is None:
        return None
    return COMPARE[match["op"] or "=="](float(measured), float(match["bound"]))


def _value(figure: dict) -> str:
    """As the benchmark prints it: ``value unit (ratio x)``; its target says which it bounds."""
    value = f"{figure['value']:.4g} {figure['unit']}"
    return f"{value} ({figure['ratio']:.3g}x)" if figure.get("ratio") is not None else value


def _mark(verdict: bool | None) -> str:
    return {True: "met", False: "**short**", None: "by reading"}[verdict]


def what_it_measures(name: str) -> str:
    """The first paragraph of the benchmark's docstring, on one line."""
    doc = ast.get_docstring(ast.parse((BENCHMARKS / f"{name}.py").read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split())


def _saved(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def render_summary() -> str:
    """The README's table: one row per benchmark. The figure shown is the first one short of its
    target, else the first with a target."""
    rows = [
        "| benchmark | targets met | figure (target) | recorded | command |",
        "|---|---|---|---|---|",
    ]
    for name in benchmark_names():
        result = _saved(name)
        if result is None:
            rows.append(f"| `{name}` | no saved result yet | | | `python benchmarks/{name}.py --json` |")
            continue
        targeted = [f for f in result["figures"] if f.get("target")]
        verdicts = [met(f) for f in targeted]
        judged = [v for v in verdicts if v is not None]
        shown = next((f for f, v in zip(targeted, verdicts, strict=True) if v is False), None)
        shown = shown or (targeted[0] if targeted else None)
        by_reading = len(targeted) - len(judged)
        if not targeted:
            counted = "no targets"
        elif not judged:
            counted = f"{by_reading} by reading"
        else:
            counted = f"{sum(judged)} of {len(judged)}" + (
                f" (+{by_reading} by reading)" if by_reading else ""
            )
        figure = f"{shown['name']}: {_value(shown)}; target {shown['target']}" if shown else ""
        rows.append(
            f"| [`{name}`](docs/benchmarks.md#{name}) | {counted} | {figure} | "
            f"{result['recorded'][:10]}, {result['commit']} | `{result['command']}` |"
        )
    return "\n".join(rows)


def render_record() -> str:
    """docs/benchmarks.md: every saved figure of every benchmark, with its target and verdict."""
    parts = [
        "# Benchmarks: the saved results",
        "",
        "Written by `python3 tools/benchmark_results.py table` from `benchmarks/results/*.json`; do",
        "not edit by hand. Each section is one benchmark's latest `--json` result: the command that",
        "made it, the commit and the machine. A ratio is against a baseline measured in the same run.",
        "A target that starts with a comparison is judged here (`ratio` bounds the ratio, otherwise the",
        "value); one in words is judged by reading. Figures go stale openly: rerun the command and",
        "`python3 tools/benchmark_results.py record NAME` to refresh one.",
    ]
    for name in benchmark_names():
        parts += ["", f"## {name}", "", what_it_measures(name), ""]
        result = _saved(name)
        if result is None:
            parts.append(f"No saved result yet: `python3 tools/benchmark_results.py record {name}`.")
            continue
        parts += [
            f"`{result['command']}`, recorded {result['recorded']} at {result['commit']} "
            f"({result['machine']}).",
            "",
            "| figure | value | target | verdict |",
            "|---|---|---|---|",
        ]
        for figure in result["figures"]:
            target = figure.get("target")
            verdict = _mark(met(figure)) if target else ""
            parts.append(f"| {figure['name']} | {_value(figure)} | {target or ''} | {verdict} |")
    return "\n".join(parts) + "\n"


def readme_with_table(text: str, table: str) -> str:
    if BEGIN not in text or END not in text:
        raise click.ClickException(f"README.md has no {BEGIN!r} ... {END!r} block to write the table into")
    head, rest = text.split(BEGIN, 1)
    _old, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


@click.group()
def cli() -> None:
    """The benchmarks' saved results and the README table made from them."""


@cli.command("record")
@click.argument("name")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def record_command(name: str, args: tuple[str, ...]) -> None:
    """Run benchmark NAME with --json (and ARGS); save its result in benchmarks/results/."""
    click.echo(f"saved {record(name, list(args)).relative_to(ROOT)}")


@cli.command("table")
@click.option("--check", is_flag=True, help="only check that both show the saved results")
def table_command(check: bool) -> None:
    """Write the README's benchmark table and docs/benchmarks.md from benchmarks/results/."""
    outputs = {README: readme_with_table(README.read_text(), render_summary()), RECORD: render_record()}
    stale = [path for path, text in outputs.items() if not path.exists() or path.read_text() != text]
    if check:
        if stale:
            names = " and ".join(str(path.relative_to(ROOT)) for path in stale)
            raise click.ClickException(f"{names}: stale; run python3 tools/benchmark_results.py table")
        click.echo("README.md and docs/benchmarks.md show the saved results")
        return
    for path, text in outputs.items():
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    click.echo("README.md's table and docs/benchmarks.md rewritten from benchmarks/results/")
