#!/usr/bin/env python3
"""``agora-trainer make-shards`` (packages/agora-trainer), under the name the README uses."""

import sys

from agora_trainer.data.shards_cli import main

if __name__ == "__main__":
    sys.exit(main())
