"""agora-worker: serves one pipeline stage of an Agora run and trains it."""

__version__ = "0.1.0"
