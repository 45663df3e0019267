#!/usr/bin/env python3
"""``agora-model evaluate`` (packages/agora-model), under the name the README uses."""

from agora_model.evaluate import main

if __name__ == "__main__":
    main()
