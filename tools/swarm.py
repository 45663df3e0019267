#!/usr/bin/env python3
"""The local swarm's command, ``agora-localswarm`` (packages/agora-localswarm), under the name the
README uses.

    python tools/swarm.py up [--config examples/tiny.toml] [--replicas 2] ...
    python tools/swarm.py status | kill-worker STAGE | add-worker STAGE | down | dashboard
"""

from agora_localswarm.cli import main

if __name__ == "__main__":
    main()
