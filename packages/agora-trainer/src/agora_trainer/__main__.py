"""``python -m agora_trainer`` is the ``agora-trainer`` command."""

from agora_trainer.cli import main

main()
