"""Serving a stage: the pipeline methods, the request queues and their coalescing, the compute
thread and the backend that runs a microbatch on the device."""
