"""agora-trainer: drives samples through an Agora swarm's pipeline. Needs neither torch nor a GPU."""

__version__ = "0.1.0"
