"""Agora's dev kit: what the tests and benchmarks of every role share. Never shipped with a role."""
