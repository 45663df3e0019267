"""What a node tells its operator: Prometheus metrics (served and pushed) and structured logs."""
