#!/usr/bin/env python3
"""Shard rotation in a live run: ``agora-trainer rotate-shards``, under the name the README uses.

python tools/rotate_shards.py --run-dir runs/latest set --trainer trainer-0=4-7 --trainer trainer-1=0-3
python tools/rotate_shards.py --run-dir runs/latest show
"""

from agora_trainer.data.rotation_cli import rotate_shards

if __name__ == "__main__":
    rotate_shards()
