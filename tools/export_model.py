#!/usr/bin/env python3
"""``agora-model export`` (packages/agora-model), under the name the README uses."""

from agora_model.export import main

if __name__ == "__main__":
    main()
