#!/usr/bin/env python3
"""The benchmarks' table of record: each benchmark's latest ``--json`` result, saved in
``benchmarks/results/<name>.json`` with the command, commit and date that made it, and the
README's benchmark table rendered from those files.

    python tools/benchmark_results.py record dht [-- --sizes 16 64]   # run it, save its result
    python tools/benchmark_results.py table                           # rewrite the README table
    python tools/benchmark_results.py table --check                   # exit 1 if it is stale

The table lists every figure that carries a target, and each benchmark with no saved result
yet, so a figure never shows a value older than its file.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
README = ROOT / "README.md"
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


def render_table() -> str:
    """The README's table: one row per targeted figure of every saved result."""
    rows = ["| figure | target | latest | recorded | command |", "|---|---|---|---|---|"]
    for name in benchmark_names():
        path = RESULTS / f"{name}.json"
        if not path.exists():
            rows.append(f"| `{name}`: no saved result yet | | | | `python benchmarks/{name}.py --json` |")
            continue
        result = json.loads(path.read_text())
        recorded = f"{result['recorded'][:10]}, {result['commit']}"
        for figure in result["figures"]:
            if figure.get("target"):
                rows.append(
                    f"| {name}: {figure['name']} | {figure['target']} | {_value(figure)} | {recorded} | "
                    f"`{result['command']}` |"
                )
    return "\n".join(rows)


def _value(figure: dict) -> str:
    """As the benchmark prints it: ``value unit (ratio x)``; its target says which it bounds."""
    value = f"{figure['value']:.4g} {figure['unit']}"
    return f"{value} ({figure['ratio']:.3g}x)" if figure.get("ratio") is not None else value


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
@click.option("--check", is_flag=True, help="only check that README.md shows the saved results")
def table_command(check: bool) -> None:
    """Write the README's benchmark table from benchmarks/results/."""
    text = README.read_text()
    updated = readme_with_table(text, render_table())
    if check:
        if updated != text:
            raise click.ClickException(
                "README.md's benchmark table is stale: run tools/benchmark_results.py table"
            )
        click.echo("README.md's benchmark table shows the saved results")
        return
    README.write_text(updated)
    click.echo("README.md's benchmark table rewritten from benchmarks/results/")


if __name__ == "__main__":
    cli()
