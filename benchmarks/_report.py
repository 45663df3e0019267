"""Figures printed by every benchmark: ``name: value unit (ratio x)``, or one JSON object.

Benchmarks measure against a baseline taken in the same run and never fail on a time; a
target, when one is set, is printed next to the figure for the reader to judge.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field

from _harness import waiting_for


@dataclass
class Figure:
    name: str
    value: float
    unit: str
    baseline: float | None = None  # the same quantity measured for the baseline
    ratio: float | None = None  # value / baseline, or as the benchmark defines it
    target: str | None = None  # e.g. ">= 0.8"


@dataclass
class Report:
    title: str
    figures: list[Figure] = field(default_factory=list)
    as_json: bool = False

    def add(self, name: str, value: float, unit: str, *, baseline=None, ratio=None, target=None) -> Figure:
        figure = Figure(name, float(value), unit, baseline, ratio, target)
        self.figures.append(figure)
        if not self.as_json:
            text = f"{name}: {value:.4g} {unit}"
            if ratio is not None:
                text += f" ({ratio:.3g} x)"
            if target is not None:
                text += f"   [target: {target}]"
            print(text, flush=True)
        return figure

    def compare(self, name: str, value: float, baseline: float, unit: str, *, target=None) -> Figure:
        """A figure with its same-run baseline; the ratio is value / baseline."""
        return self.add(name, value, unit, baseline=baseline, ratio=value / baseline, target=target)

    def note(self, text: str) -> None:
        """Progress and context for humans; silent in --json mode. Also what the benchmark
        waits for, should its deadline pass."""
        waiting_for(text)
        if not self.as_json:
            print(f"# {text}", file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self.as_json:
            print(json.dumps({"benchmark": self.title, "figures": [asdict(f) for f in self.figures]}))
