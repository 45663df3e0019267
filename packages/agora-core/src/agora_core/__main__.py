"""``python -m agora_core`` is the ``agora`` command."""

from agora_core.cli import main

main()
