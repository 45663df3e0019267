#!/usr/bin/env python3
"""The benchmarks' saved results and the tables made from them (``agora_devkit.benchmark_results``).

python tools/benchmark_results.py record NAME [-- ARGS]   # run benchmarks/NAME.py --json, save it
python tools/benchmark_results.py table [--check]         # the README table, docs/benchmarks.md
"""

from agora_devkit.benchmark_results import cli

if __name__ == "__main__":
    cli()
