"""Scenarios: a TOML file that says what to simulate, and what running it measured.

    [run]
    seed = 1
    duration_s = 300.0       # virtual seconds after the swarm is up
    sample_s = 5.0           # timeline resolution

    [dht]
    members = 200
    authorized = false       # true: an authorized run (credentials, CURVE on every connection)

    [links]                  # each host's link, drawn uniformly (the report's consumer links)
    bandwidth_mbit = [100, 1000]
    one_way_ms = [2.5, 37.5]  # a path's round trip is 2 x (a + b): 10-150 ms
    jitter_ms = 2.0
    loss = 0.0
    # window_kb = 64         # each connection's TCP window (absent: unlimited)

    [churn]                  # Poisson processes, per minute of virtual time
    joins_per_min = 2.0
    departures_per_min = 2.0

    [ops]
    per_s = 1.0              # store + read-back pairs measured per virtual second

    [faults]                 # Poisson too; each heals by itself
    partitions_per_min = 0.0 # the live hosts split in two groups that cannot reach each other
    partition_s = 10.0
    silences_per_min = 0.0   # one host's link cut (nothing in or out, nobody told)
    silence_s = 10.0
    max_clock_skew_s = 0.0   # each host's wall clock off by up to this (the run allows 30 s)

What it covers: the DHT (membership, storage, one-hop reads) under links, churn and faults.
Workers and trainers need their packages: ``agora_sim/swarm.py`` runs a ``[swarm]`` table.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from agora_core.config.run import DhtConfig
from agora_sim.dht_swarm import LinkRange

_NOT_YET = ("stages", "workers", "trainers", "averaging")


class ScenarioError(ValueError):
    """A scenario file is malformed or asks for what the simulator cannot run yet."""


@dataclass(kw_only=True, frozen=True)
class Churn:
    joins_per_min: float = 0.0
    departures_per_min: float = 0.0


@dataclass(kw_only=True, frozen=True)
class Faults:
    partitions_per_min: float = 0.0  # the live hosts cut in two groups, one partition at a time
    partition_s: float = 10.0  # how long each lasts
    silences_per_min: float = 0.0  # one host's link cut, nobody told
    silence_s: float = 10.0
    max_clock_skew_s: float = 0.0  # each host's wall clock off by a uniform draw within +-this

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ScenarioError(f"faults.{f.name} must be >= 0")
        limit = DhtConfig().max_clock_skew_s
        if self.max_clock_skew_s > limit:
            raise ScenarioError(
                f"faults.max_clock_skew_s must be <= {limit:g}: a run refuses records from clocks further off"
            )


@dataclass(kw_only=True, frozen=True)
class Scenario:
    seed: int = 1
    duration_s: float = 120.0
    sample_s: float = 5.0
    members: int = 64
    authorized: bool = False
    links: LinkRange = field(default_factory=LinkRange)
    churn: Churn = field(default_factory=Churn)
    ops_per_s: float = 1.0
    faults: Faults = field(default_factory=Faults)

    def __post_init__(self) -> None:
        if self.members < 2:
            raise ScenarioError("dht.members must be at least 2")
        if self.duration_s <= 0 or self.sample_s <= 0:
            raise ScenarioError("run.duration_s and run.sample_s must be positive")
        if self.ops_per_s < 0 or self.churn.joins_per_min < 0 or self.churn.departures_per_min < 0:
            raise ScenarioError("rates (ops.per_s, churn.*_per_min) must be >= 0")

    def with_seed(self, seed: int) -> Scenario:
        return Scenario(**{f.name: getattr(self, f.name) for f in fields(self)} | {"seed": seed})


def _table(data: dict, name: str, allowed: set[str]) -> dict[str, Any]:
    table = data.get(name, {})
    if not isinstance(table, dict):
        raise ScenarioError(f"[{name}] must be a table")
    unknown = set(table) - allowed
    if unknown:
        raise ScenarioError(f"[{name}] has unknown keys: {', '.join(sorted(unknown))}")
    return table


def parse_scenario(data: dict) -> Scenario:
    """A :class:`Scenario` from a parsed TOML document; every key checked."""
    for name in _NOT_YET:
        if name in data:
            raise ScenarioError(
                f"[{name}]: a DHT scenario has no workers or trainers; they go in a [swarm] table "
                "(agora_sim.swarm)"
            )
    unknown = set(data) - {"run", "dht", "links", "churn", "ops", "faults"}
    if unknown:
        raise ScenarioError(f"unknown tables: {', '.join(sorted(unknown))}")
    run = _table(data, "run", {"seed", "duration_s", "sample_s"})
    dht = _table(data, "dht", {"members", "authorized"})
    if not isinstance(dht.get("authorized", False), bool):
        raise ScenarioError("dht.authorized must be true or false")
    links = _table(data, "links", {"bandwidth_mbit", "one_way_ms", "jitter_ms", "loss", "window_kb"})
    churn = _table(data, "churn", {"joins_per_min", "departures_per_min"})
    ops = _table(data, "ops", {"per_s"})
    faults = _table(data, "faults", {f.name for f in fields(Faults)})
    try:
        link_range = LinkRange(
            **{k: tuple(v) if isinstance(v, list) else float(v) for k, v in links.items()},
        )
        return Scenario(
            seed=int(run.get("seed", 1)),
            duration_s=float(run.get("duration_s", 120.0)),
            sample_s=float(run.get("sample_s", 5.0)),
            members=int(dht.get("members", 64)),
            authorized=dht.get("authorized", False),
            links=link_range,
            churn=Churn(**{k: float(v) for k, v in churn.items()}),
            ops_per_s=float(ops.get("per_s", 1.0)),
            faults=Faults(**{k: float(v) for k, v in faults.items()}),
        )
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ScenarioError):
            raise
        raise ScenarioError(str(exc)) from None


def load_scenario(path: Path) -> Scenario:
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ScenarioError(f"cannot read scenario {path}: {exc}") from None
    return parse_scenario(data)
