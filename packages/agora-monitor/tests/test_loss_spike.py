"""The ``loss_spike`` alert: trainers' losses folded snapshot by snapshot into a real SQLite
file, the alerts judged from it after each, as the monitor does."""

from __future__ import annotations

import pytest

from agora_core.config import load_run_config
from agora_core.errors import ConfigError
from agora_devkit.monitor import snapshot, trainer
from agora_monitor.alerts import current_alerts
from agora_monitor.ingest import Ingest
from agora_monitor.settings import MonitorSettings
from agora_monitor.store import MonitorStore

T0 = 1_800_000_000.0
PERIOD_S = 5.0
SETTINGS = MonitorSettings(period_s=PERIOD_S)  # ratio 1.5, medians of 5, a 900 s window
STEADY = [3.8, 3.9, 3.7, 3.8, 3.85, 3.75, 3.8]  # every median of 5 consecutive ones is 3.8


class Run:
    """A run watched by a monitor on a SQLite file: :meth:`snapshot` folds the trainers'
    next losses in and returns the ``loss_spike`` alerts firing after it."""

    def __init__(self, path: str, config, settings: MonitorSettings = SETTINGS):
        self.config, self.settings = config, settings
        self.store = MonitorStore(path)
        self.store.ensure_run(config, T0)
        self.ingest = Ingest(config, settings, *self.store.restore(config.name))
        self.i = 0

    def t(self, i: int) -> float:
        return T0 + PERIOD_S * i

    def snapshot(self, *losses: float) -> list[dict]:
        samples = 10 * (self.i + 1)
        trainers = [trainer(f"t{k}", samples, loss=loss) for k, loss in enumerate(losses)]
        self.store.write(self.ingest.apply(snapshot(self.t(self.i), trainers=trainers)))
        self.i += 1
        with self.store.transaction() as connection:
            alerts = current_alerts(connection, self.config.name, self.settings, now=self.t(self.i - 1))
        return [a for a in alerts if a["name"] == "loss_spike"]

    def losses(self, losses: list[float]) -> list[list[dict]]:
        return [self.snapshot(loss) for loss in losses]


@pytest.fixture
def config(request):
    return load_run_config(request.config.rootpath / "examples" / "tiny.toml")


@pytest.fixture
def run(tmp_path, config):
    watched = Run(str(tmp_path / "monitor.db"), config)
    yield watched
    watched.store.close()


def test_a_loss_jumping_tenfold_fires_a_critical_alert_naming_the_numbers_from_its_first_high_snapshot(run):
    assert run.losses(STEADY) == [[]] * len(STEADY)
    assert run.snapshot(5.0) == []  # 1.3x: not yet
    (alert,) = run.snapshot(12.0)
    assert (alert["severity"], alert["subject"], alert["since"]) == ("critical", "tiny", run.t(8))
    (alert,) = run.snapshot(38.1)
    assert alert["message"] == (
        "loss 38.10 vs 3.80, the lowest median of 5 snapshots in the previous 900 s (10.0x)"
    )
    assert alert["since"] == run.t(8)  # the spike began at 12.0, not at 5.0


def test_the_trainers_mean_is_judged_so_one_broken_trainer_among_many_moves_it_less(run):
    # the loss of the trainers together: four at 3.8 and one at 10 is a mean of 5.04 (1.3x)
    assert [run.snapshot(3.8, 3.8, 3.8, 3.8, 3.8) for _ in range(6)] == [[]] * 6
    assert run.snapshot(3.8, 3.8, 3.8, 3.8, 10.0) == []
    (alert,) = run.snapshot(38.0, 38.0, 38.0, 38.0, 38.0)
    assert alert["message"].startswith("loss 38.00 vs 3.80,")


def test_a_noisy_falling_loss_a_lone_dip_and_a_lone_blip_do_not_fire(run):
    # from 10.8 down to ~3.5 over 120 snapshots, each +-8% around the trend ...
    falling = [3.5 + 7.3 * 0.96**i for i in range(120)]
    noisy = [loss * (1.08 if i % 3 == 0 else 0.92 if i % 3 == 1 else 1.0) for i, loss in enumerate(falling)]
    # ... one snapshot at half the trend (a low outlier must not set the level: 1 / 0.5 > 1.5)
    # and one at 1.4x
    noisy[60] *= 0.5
    noisy[91] *= 1.4
    fired = [i for i, alerts in enumerate(run.losses(noisy)) if alerts]
    assert fired == []


def test_too_little_history_does_not_fire_and_a_full_window_does(run):
    # a run's first snapshots: the spike has 4 snapshots before it, not the 5 of a median
    assert run.losses([3.8, 3.8, 3.8, 3.8, 38.0]) == [[]] * 5
    (alert,) = run.snapshot(38.0)  # now 5 before it, their median 3.8
    assert alert["since"] == run.t(4)


def test_the_alert_lasts_as_long_as_the_spike_and_stops_once_the_loss_is_back_down(run):
    run.losses(STEADY)
    # high for longer than a median's window: the level stays the one before the spike
    assert all(len(alerts) == 1 for alerts in run.losses([30.0] * 12))
    assert run.snapshot(5.5) == []  # 1.45x the level: back down
    assert run.losses([3.9, 3.8]) == [[], []]


def test_a_spike_that_outlasts_the_alert_window_becomes_the_level(tmp_path, config):
    settings = MonitorSettings(period_s=PERIOD_S, alert_window_s=60.0)  # 12 periods
    run = Run(str(tmp_path / "monitor.db"), config, settings)
    run.losses(STEADY)
    firing = [bool(alerts) for alerts in run.losses([30.0] * 14)]
    # fires while at least 3 of a median's 5 snapshots in the window are from before it
    assert firing == [True] * 10 + [False] * 4
    run.store.close()


def test_a_spike_that_turns_nonfinite_is_left_to_loss_nonfinite(run):
    run.losses(STEADY)
    assert len(run.snapshot(38.0)) == 1
    assert run.snapshot(float("nan")) == []  # no finite loss now: not judged on the last one
    with run.store.transaction() as connection:
        alerts = current_alerts(connection, "tiny", SETTINGS, now=run.t(run.i - 1))
    assert [a["name"] for a in alerts if a["name"].startswith("loss_")] == ["loss_nonfinite"]


@pytest.mark.parametrize(
    ("knobs", "flag"),
    [
        ({"loss_spike_ratio": 1.0}, "--loss-spike-ratio"),
        ({"loss_spike_window": 0}, "--loss-spike-window"),
    ],
)
def test_settings_that_would_always_fire_or_judge_nothing_are_refused_naming_the_flag(knobs, flag):
    with pytest.raises(ConfigError) as refused:
        MonitorSettings(**knobs)
    assert flag in str(refused.value)
