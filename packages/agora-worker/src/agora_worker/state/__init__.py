"""A replica's stage state: its named host tensors, and the checkpoints that keep them."""
