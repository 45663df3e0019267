"""``python -m agora_worker`` is the ``agora-worker`` command."""

from agora_worker.cli import main

main()
