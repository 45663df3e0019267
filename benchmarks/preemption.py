#!/usr/bin/env python3
"""The report's preemption table at small scale: senders preempted mid averaging send.

    python benchmarks/preemption.py [--json] [--replicas 6] [--preempt 1,3,5] [--megabytes 8] [--smoke]

A stage of ``--replicas`` worker processes (surrogate stages whose untrained dummy parameters
start at each replica's own random values, so averaging has something to do) averages its
whole parameter vector in one round. Before the round, the operator writes one injection
record into the run's DHT (``agora_core.injection``: trigger ``averaging_send``, action
``exit``, the victims' node ids): each victim dies, as a crash would, as it is about to stream
its second averaging chunk. Nothing else tells anyone. Per number of preempted senders:

  completeness   of each survivor's segment, the fraction whose average came back (its round
                 report's averaging_success), mean and min over survivors; vs the same
                 replicas' clean round (no preemption) just before
  diverged       survivors whose weights are not finite or moved away from the survivors'
                 mean (their distance to it after the round exceeds the one before): target 0
  spread         the survivors' mean distance to their mean after the round / before it
                 (averaging pulls them together: < 1; a diverged survivor would push it up)
  round seconds  the survivors' slowest round vs the clean round (a dead sender costs one
                 chunk timeout before it is banned)

Two layouts: ``reducers = all`` (the run's default: every replica reduces a slice, so a
preempted reducer's slice does not come back) and ``one reliable reducer`` (only replica 0
reduces, as in the report's setup with reliable reducers; the preempted are senders only).
Every row starts from --replicas fresh processes (the victims come back with their keys), so
no row inherits the agreement an earlier round left among its survivors. ``--smoke``: 2 replicas
of 0.1 MB, one preempted, in both layouts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import _harness
from _report import Report  # benchmarks/ is on sys.path when a benchmark runs as a script
from agora_core.config import OperatorConfig, RunConfig, SurrogateConfig
from agora_core.config.dump import dump_toml
from agora_core.config.run import AveragingConfig, DhtConfig, ModelConfig, TransportConfig
from agora_core.contract import Method
from agora_core.dht import DhtNode
from agora_core.identity import NodeKey
from agora_core.injection import INJECTED_EXIT_CODE, Targets
from agora_core.injection.publish import clear, new_injection, publish
from agora_core.observability.logs import configure_logging
from agora_core.rpc import RpcClient
from agora_devkit.processes import ChildProcess, poll_until, spawn_python

STAGE = 1
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "AGORA_LOG_LEVEL": "warning"}
CHUNK_TIMEOUT_S = 3.0
VICTIM_EXIT_S = 30.0  # a victim's exit once the round it was told to die in is over


def run_config(megabytes: float, reducers: str, reducer_ids: list[str], operator: NodeKey) -> RunConfig:
    return RunConfig(
        name="preemption",
        model=ModelConfig(
            kind="surrogate",
            d_model=32,
            n_heads=2,
            subspace_rank=4,
            vocab_size=256,
            seq_len=8,
            stage_layers=(1, 1),
            surrogate=SurrogateConfig(dummy_parameters=int(megabytes * 1e6 / 4)),
        ),
        dht=DhtConfig(gossip_period_s=0.5, probe_timeout_s=0.3, suspicion_timeout_s=3.0, record_ttl_s=15.0),
        averaging=AveragingConfig(
            segments=1,  # the whole vector in each round
            cadence_steps=1_000_000,  # rounds start by hand (averaging.start) only
            matchmaking_window_s=8.0,
            round_timeout_s=60.0,
            chunk_timeout_s=CHUNK_TIMEOUT_S,
            reducers=reducers,
            reducer_ids=tuple(reducer_ids),
        ),
        transport=TransportConfig(chunk_bytes=64 * 1024),
        operator=OperatorConfig(public_keys=[operator.public_key.hex()], injection_watch_s=0.2),
    )


@dataclass
class Replica:
    key_file: Path
    node_id: str
    child: ChildProcess | None = None
    address: str = ""


class Stage:
    """The replicas' processes, the benchmark's DHT seed (the operator writes through it) and
    a client to call them."""

    def __init__(self, stack: contextlib.ExitStack, seed: DhtNode, client: RpcClient, config: Path, keys):
        self.stack, self.seed, self.client, self.config = stack, seed, client, config
        self.replicas = [Replica(path, node_id) for path, node_id in keys]
        self.round = 0

    async def start(self, replica: Replica) -> None:
        command = ["-m", "agora_worker", "run", "--config", str(self.config), "--stage", str(STAGE)]
        command += ["--bootstrap", self.seed.address, "--device", "cpu", "--key-file", str(replica.key_file)]
        command += ["--progress-interval", "0.2", "--announce-interval", "0.5"]
        replica.child = self.stack.enter_context(spawn_python(command, env=CHILD_ENV))
        replica.address = await asyncio.to_thread(replica.child.read_until, "  serving    ", timeout_s=180)

    async def restart(self) -> None:
        """Every replica afresh (each draws new dummy values): a row never inherits the
        agreement an earlier row's round left among its survivors."""
        running = [r for r in self.replicas if r.child is not None and r.child.proc.poll() is None]
        await asyncio.gather(*(asyncio.to_thread(r.child.stop) for r in running))
        await asyncio.gather(*(self.start(r) for r in self.replicas))
        live = {r.node_id: r.address for r in self.replicas}

        async def all_announced() -> bool:  # matchmaking expects exactly the announced replicas
            found = await self.seed.get(f"preemption/stage/{STAGE}/workers")
            announced = {v.value.get("node_id"): v.value.get("address") for v in found.values()}
            return all(announced.get(node_id) == address for node_id, address in live.items())

        await poll_until(all_announced, timeout_s=60, what="every replica announced")

    async def values(self, replica: Replica) -> np.ndarray:
        reply = await self.client.call(replica.address, Method.WORKER_PARAMETERS, timeout_s=60)
        return np.array(reply.tensors["values"], dtype=np.float64)

    async def preempt_round(self, operator: NodeKey, victims: list[Replica]) -> dict:
        """One round with ``victims`` told, through the DHT, to exit mid send."""
        self.round += 1
        before = {r.node_id: await self.values(r) for r in self.replicas}
        if victims:
            injection = new_injection(
                trigger="averaging_send",
                action="exit",
                at_chunk=1,
                targets=Targets(nodes=tuple(v.node_id for v in victims)),
            )
            await publish(self.seed, operator, "preemption", injection)

            async def armed() -> bool:
                for victim in victims:
                    info = await self.client.call(victim.address, Method.WORKER_INFO, timeout_s=10)
                    if injection.id not in info.meta["injections"]["armed"]:
                        return False
                return True

            await poll_until(armed, timeout_s=30, what="every victim to arm the record")
        calls = [
            self.client.call(r.address, Method.AVERAGING_START, {"round": self.round}, timeout_s=120)
            for r in self.replicas
        ]
        answers = await asyncio.gather(*calls, return_exceptions=True)
        survivors = [r for r in self.replicas if r not in victims]
        reports = [a.meta for r, a in zip(self.replicas, answers, strict=True) if r in survivors]
        for victim in victims:
            await asyncio.to_thread(wait_exit, victim)
        exited = sum(v.child.proc.returncode == INJECTED_EXIT_CODE for v in victims)
        if victims:
            await clear(self.seed, operator, "preemption")
        after = {r.node_id: await self.values(r) for r in survivors}
        return {"reports": reports, "before": before, "after": after, "exited": exited}


def wait_exit(victim: Replica) -> None:
    try:
        victim.child.proc.wait(VICTIM_EXIT_S)
    except subprocess.TimeoutExpired:
        raise TimeoutError(
            f"victim {victim.node_id[:12]} to exit mid send, within {VICTIM_EXIT_S:g} s"
        ) from None


def divergence(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> tuple[int, float]:
    """(survivors that diverged, the survivors' mean distance to their mean after / before)."""
    ids = list(after)
    mean_before = np.mean([before[i] for i in ids], axis=0)
    mean_after = np.mean([after[i] for i in ids], axis=0)
    dist_before = {i: float(np.linalg.norm(before[i] - mean_before)) for i in ids}
    dist_after = {i: float(np.linalg.norm(after[i] - mean_after)) for i in ids}
    diverged = sum(
        1
        for i in ids
        if not np.isfinite(after[i]).all() or dist_after[i] > dist_before[i] * (1 + 1e-6) + 1e-9
    )
    spread = statistics.mean(dist_after.values()) / max(statistics.mean(dist_before.values()), 1e-12)
    return diverged, spread


async def layout(report: Report, label: str, reducers: str, args, keys, tmp: Path, operator: NodeKey) -> None:
    reducer_ids = [keys[0][1]] if reducers == "listed" else []
    config = tmp / f"{label}.toml"
    config.write_text(dump_toml(run_config(args.megabytes, reducers, reducer_ids, operator)))
    seed = DhtNode(key=NodeKey.generate(), config=DhtConfig(gossip_period_s=0.5, probe_timeout_s=0.3))
    await seed.start()
    client = RpcClient()
    try:
        with contextlib.ExitStack() as stack:
            stage = Stage(stack, seed, client, config, keys)
            report.note(f"{label}: starting {len(keys)} replicas ...")
            await stage.restart()
            report.note(f"{label}: a clean round ...")
            clean = await stage.preempt_round(operator, [])
            clean_completeness = statistics.mean(r["averaging_success"] for r in clean["reports"])
            clean_seconds = max(r["seconds"] for r in clean["reports"])
            report.note(f"{label}: clean round, completeness {clean_completeness:.3f}, {clean_seconds:.2f} s")
            for k in args.preempt:
                report.note(f"{label}: restarting {len(keys)} replicas, then a round with {k} preempted ...")
                await stage.restart()
                candidates = stage.replicas[1:] if reducers == "listed" else stage.replicas
                victims = candidates[-k:]
                result = await stage.preempt_round(operator, victims)
                completeness = [r["averaging_success"] for r in result["reports"]]
                diverged, spread = divergence(result["before"], result["after"])
                seconds = max(r["seconds"] for r in result["reports"])
                name = f"{label}_preempt{k}"
                report.note(
                    f"{name}: {result['exited']}/{k} victims exited ({INJECTED_EXIT_CODE}); "
                    f"{len(completeness)} survivors, completeness min {min(completeness):.3f}"
                )
                report.compare(
                    f"{name}_completeness",
                    statistics.mean(completeness),
                    clean_completeness,
                    f"of the segment averaged, mean over {len(completeness)} survivors "
                    f"(min {min(completeness):.3f}; vs the clean round)",
                )
                report.add(f"{name}_diverged", diverged, "survivors diverged", target="== 0")
                report.add(
                    f"{name}_spread",
                    spread,
                    "survivors' distance to their mean, after / before",
                    target="< 1",
                )
                report.compare(f"{name}_round_seconds", seconds, clean_seconds, "s (vs the clean round)")
                report.add(f"{name}_victims_exited", result["exited"], f"of {k} told to exit mid send")
    finally:
        await client.close()
        await seed.stop()


async def main_async(args) -> None:
    report = Report("preemption", as_json=args.json)
    operator = NodeKey.generate()
    report.note(f"{args.replicas} replicas, {args.megabytes:g} MB averaged per round, chunks of 64 KiB")
    with tempfile.TemporaryDirectory(prefix="agora-preemption-") as tmp:
        tmp = Path(tmp)
        keys = []
        for i in range(args.replicas):
            key = NodeKey.generate()
            keys.append((key.save(tmp / f"replica{i}.key"), key.node_id))
        for label, reducers in (("all_reduce", "all"), ("one_reducer", "listed")):
            if label in args.layouts:
                await layout(report, label, reducers, args, keys, tmp, operator)
    report.finish()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=6)
    parser.add_argument(
        "--preempt", type=lambda s: [int(x) for x in s.split(",")], default=[1, 3, 5], help="e.g. 1,3,5"
    )
    parser.add_argument(
        "--megabytes", type=float, default=8.0, help="parameters averaged per round (10^6 bytes)"
    )
    parser.add_argument(
        "--layouts",
        type=lambda s: s.split(","),
        default=["all_reduce", "one_reducer"],
        help="all_reduce,one_reducer",
    )
    _harness.add_arguments(parser, deadline_s=1200)
    args = _harness.parse(parser, smoke={"replicas": 2, "preempt": [1], "megabytes": 0.1})
    if any(not 0 < k < args.replicas for k in args.preempt):
        sys.exit("--preempt: each count must leave at least one survivor")
    configure_logging(fmt="console", level="warning")  # this process's seed and client: quiet
    started = time.monotonic()
    asyncio.run(main_async(args))
    print(f"# done in {time.monotonic() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
