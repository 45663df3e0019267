"""The ``agora-model`` command: export a run's model, evaluate it, train the centralized reference."""

from __future__ import annotations

import sys

import click

from agora_model import evaluate, export, reference


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """A run's model outside the run: export, evaluate, and the centralized reference."""


main.add_command(export.main, name="export")
main.add_command(evaluate.main, name="evaluate")


@main.command(
    "reference",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
    add_help_option=False,
)
@click.pass_context
def reference_command(ctx: click.Context) -> None:
    """Train the swarm's model in one process on the same samples (--help for its options)."""
    sys.exit(reference.main(["--help"] if not ctx.args else ctx.args))
