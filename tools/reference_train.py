#!/usr/bin/env python3
"""``agora-model reference`` (packages/agora-model), under the name the README uses."""

import sys

from agora_model.reference import main

if __name__ == "__main__":
    sys.exit(main())
