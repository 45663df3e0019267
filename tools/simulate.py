#!/usr/bin/env python3
"""The simulator's command, ``agora-sim`` (packages/agora-sim), under the name the README uses.

python tools/simulate.py run examples/sim/swarm.toml
python tools/simulate.py search --seeds 100
"""

from agora_sim.cli import main

if __name__ == "__main__":
    main()
