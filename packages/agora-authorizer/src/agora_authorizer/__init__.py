"""agora-authorizer: decides who may join a run, where they serve, and signs their credentials."""

__version__ = "0.1.0"
