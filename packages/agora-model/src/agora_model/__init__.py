"""A run's model outside the run: exported from checkpoints or live workers, evaluated on the
held-out split, and compared with the same model trained centralized."""
