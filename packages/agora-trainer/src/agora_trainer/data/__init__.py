"""A trainer's data, apart from routing: tokenizers, making and verifying shard sets, reading
samples in order, held-out samples, and the shard rotation an operator orders."""
