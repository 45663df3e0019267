"""The monitor's own settings: how often it snapshots, and the thresholds its flags and
alerts use. The run's settings (stages, batch size, DHT timings) come from the run config."""

from __future__ import annotations

from dataclasses import dataclass

from agora_core.errors import ConfigError


@dataclass(kw_only=True, frozen=True)
class MonitorSettings:
    period_s: float = 5.0  # between snapshots of the DHT (and the dashboard's polls)
    # alerts
    stall_after_s: float = 300.0  # a stage whose step has not moved this long is stalled
    min_workers: int = 2  # a stage with fewer live (serving) workers has no redundancy left
    alert_window_s: float = 900.0  # departures, lost workers and flags stay firing this long
    # loss_spike: the latest loss above this times the run's recent level (see alerts.py);
    # pretraining loss falls, so a rise by half is a fault, not noise
    loss_spike_ratio: float = 1.5
    # snapshots per median when taking that level: one noisy snapshot cannot set it
    loss_spike_window: int = 5
    # flags
    # a worker's samples/s above its announced throughput times this is impossible; slack
    # for the throughput estimate lagging a burst, and for snapshot timing
    rate_slack: float = 3.0
    # stage samples and trainer samples may differ by this fraction of the trainers' total
    # (missed steps are counted at the target batch size; steps overshoot it) ...
    reconcile_tolerance: float = 0.5
    # ... plus this many target batches (steps in flight, lanes not yet reported)
    reconcile_batches: int = 4

    def __post_init__(self) -> None:
        for name in ("period_s", "stall_after_s", "alert_window_s", "rate_slack"):
            if not getattr(self, name) > 0:
                raise ConfigError(
                    f"--{name.replace('_', '-')}", f"must be positive, got {getattr(self, name)}"
                )
        if self.min_workers < 1:
            raise ConfigError("--min-workers", f"must be >= 1, got {self.min_workers}")
        if not self.loss_spike_ratio > 1:
            raise ConfigError(
                "--loss-spike-ratio", f"must be > 1 (a steady loss would fire), got {self.loss_spike_ratio}"
            )
        if self.loss_spike_window < 1:
            raise ConfigError("--loss-spike-window", f"must be >= 1, got {self.loss_spike_window}")
        if self.reconcile_tolerance < 0 or self.reconcile_batches < 0:
            raise ConfigError("--reconcile-tolerance", "the reconciliation tolerances must be >= 0")
