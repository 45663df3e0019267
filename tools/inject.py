#!/usr/bin/env python3
"""Failure injection in a live run: ``agora inject`` (agora-core), under the name the README uses.

python tools/inject.py --run-dir runs/latest add --action exit --role worker --stage 1
python tools/inject.py --run-dir runs/latest list
"""

from agora_core.injection.cli import inject

if __name__ == "__main__":
    inject()
