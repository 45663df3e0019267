#!/usr/bin/env python3
"""Join benchmark: a stage's state downloaded over an emulated link, and time to full service.

    python benchmarks/join.py [--mb 200] [--link up=200M,down=200M,latency=40ms] [--skip-swarm] [--json]
                              [--smoke]

(a) State download. Real ``agora-worker`` processes serve a surrogate stage whose untrained
    tensor makes its state ``--mb`` MB. Three donors hold the same state (the second and third
    downloaded it from the first). A joiner behind the emulated link downloads it from one
    donor, then another joiner from three. Figure ``state_download_vs_link`` = bytes /
    (download time x the link's download rate), target >= 0.8; the download time runs from the
    first manifest request to the last tensor fetched and its digest checked (installing the
    state and reading it back is reported on its own).
(b) Time to serve. A local swarm of ``examples/tiny.toml`` trains; once its stages are past
    ``sync.stale_after_steps``, ``swarm.py add-worker`` starts a newcomer. Figures: seconds from
    the process start to its state installed, to the end of weight sync, to the end of
    optimizer sync, and to its first forward served after both; the baseline is the time the
    stage takes for the sync phases' steps (``weight_sync_steps + optimizer_sync_steps``) at
    the step rate measured meanwhile.
``--smoke``: (a) with a 1 MB state; (b) with one worker per stage and sync phases of a few steps.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _harness
from _churn_swarm import stop_up  # benchmarks/ is on sys.path when a benchmark runs as a script
from _report import Report
from agora_core.config import load_run_config
from agora_core.config.dump import dump_toml
from agora_core.contract import Method
from agora_core.dht import BlockingDht, DhtNode
from agora_core.errors import AgoraError
from agora_core.identity import NodeKey
from agora_core.observability.logs import configure_logging
from agora_core.rpc import RpcClient
from agora_core.rpc.linkemu import LinkConfig
from agora_devkit.processes import spawn_python
from agora_localswarm.processes import Member, SwarmFile
from agora_localswarm.status import light_member

ROOT = Path(__file__).resolve().parent.parent
SWARM = str(ROOT / "tools" / "swarm.py")

ENV = {"AGORA_LOG_LEVEL": "warning", "OMP_NUM_THREADS": "1"}
TINY = ROOT / "examples" / "tiny.toml"
DONOR_START_S = 300.0  # a donor serving (the second and third download the state first)
JOINER_S = 600.0  # a joiner behind the emulated link serving
SWARM_GOING_S = 600.0  # the tiny swarm's stages past the staleness bound
NEWCOMER_S = 600.0  # the newcomer's first forward after its sync phases
ADDER_S = 60.0  # `swarm.py add-worker` returning once its newcomer serves
# --smoke: sync phases of a few steps, so a newcomer serves within seconds
SMOKE_SYNC = {"weight_sync_steps": 2, "optimizer_sync_steps": 1, "stale_after_steps": 2}


def write_config(folder: Path, name: str, *, mb: float, donors: int) -> Path:
    path = folder / f"{name}.toml"
    path.write_text(
        f'name = "join"\n[model]\nkind = "surrogate"\nd_model = 64\nn_heads = 2\nsubspace_rank = 16\n'
        f"seq_len = 128\nvocab_size = 256\nstage_layers = [1, 1]\n"
        f"[model.surrogate]\ndummy_parameters = {int(mb * 1e6 / 4)}\n"
        "[averaging]\nenabled = false\n[optimizer]\ntarget_batch_size = 1000000\n"
        f"[join]\nmax_donors = {donors}\n"
        "[dht]\ngossip_period_s = 0.5\nprobe_timeout_s = 0.25\n"
    )
    return path


async def info(client: RpcClient, address: str) -> dict:
    return (await client.call(address, Method.WORKER_INFO, timeout_s=10)).meta


def worker_args(config: Path, seed: str, folder: Path, name: str, *extra: str) -> list[str]:
    args = ["-m", "agora_worker", "run", "--config", str(config), "--stage", "0", "--bootstrap", seed]
    return [*args, "--device", "cpu", "--key-file", str(folder / f"{name}.key"), *extra]


async def download_figures(report: Report, mb: float, link: str) -> None:
    rate = LinkConfig.parse(link).down_bits_per_s
    if rate is None:
        raise SystemExit("--link needs a down= rate")
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        folder = Path(tmp)
        one, three = (write_config(folder, f"d{n}", mb=mb, donors=n) for n in (1, 3))
        seed = DhtNode(key=NodeKey.generate(), config=load_run_config(three).dht)
        await seed.start()
        client = RpcClient()
        try:
            report.note(f"3 donors of a {mb:g} MB stage state")
            for index in range(3):
                extra = () if index == 0 else ("--download", "always", "--phase", "serving")
                child = stack.enter_context(
                    spawn_python(worker_args(three, seed.address, folder, f"donor{index}", *extra), env=ENV)
                )
                await asyncio.to_thread(child.read_until, "  serving    ", timeout_s=DONOR_START_S)
            for donors, config in ((1, one), (3, three)):
                report.note(f"a joiner behind {link} downloads from {donors} donor(s)")
                args = worker_args(config, seed.address, folder, f"joiner{donors}", "--download", "always")
                with spawn_python([*args, "--link", link], env=ENV) as joiner:
                    address = await asyncio.to_thread(joiner.read_until, "  serving    ", timeout_s=JOINER_S)
                    joined = (await info(client, address))["join"]
                bits = joined["download_bytes"] * 8
                seconds = joined["download_s"]
                report.add(f"donors={donors} state_mb", joined["download_bytes"] / 1e6, "MB")
                report.add(f"donors={donors} download_s", seconds, "s")
                report.add(f"donors={donors} install_and_check_s", joined["install_s"], "s")
                report.compare(
                    f"donors={donors} state_download_vs_link",
                    bits / seconds / 1e6,
                    rate / 1e6,
                    "Mbit/s",
                    target="ratio >= 0.8",
                )
                report.add(f"donors={donors} donors_used", len(joined["donors"]), "donors")
        finally:
            await client.close()
            await seed.stop()


def _stage_workers(run_dir: Path, stage: int) -> list[Member]:
    """The live workers of ``stage`` that serve at an address, in start order, as the swarm
    tool keeps them (RUN_DIR/swarm.json)."""
    if not (run_dir / "swarm.json").exists():
        return []
    members = SwarmFile.load(run_dir).members
    return [m for m in members if m.role == "worker" and m.stage == stage and m.alive and m.address]


class SwarmReader:
    """Reads workers' ``worker.info`` as a light member of the swarm in RUN_DIR (in an
    authorized swarm, with a monitor credential from its authorizer), as the swarm tool does."""

    def __init__(self, run_dir: Path):
        self._run_dir = run_dir
        self._dht: BlockingDht | None = None

    def info(self, address: str | None) -> dict | None:
        """``worker.info`` of ``address``; None when it is unknown or does not answer."""
        if not address:
            return None
        if self._dht is None:
            swarm = SwarmFile.load(self._run_dir)
            if not swarm.seed_address:
                return None
            self._dht = BlockingDht(run_node=light_member(swarm))
            self._dht.start()
        with contextlib.suppress(AgoraError, TimeoutError):
            return self._dht.submit(self._dht.client.call(address, Method.WORKER_INFO, timeout_s=5)).meta
        return None

    def close(self) -> None:
        if self._dht is not None:
            self._dht.stop()


def smoke_config(folder: Path) -> Path:
    """examples/tiny.toml with sync phases of a few steps (SMOKE_SYNC)."""
    tiny = load_run_config(TINY)
    path = folder / "tiny-smoke.toml"
    path.write_text(dump_toml(dataclasses.replace(tiny, sync=dataclasses.replace(tiny.sync, **SMOKE_SYNC))))
    return path


def time_to_serve(report: Report, smoke: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "up.log", "w") as log:
        config = smoke_config(Path(tmp)) if smoke else TINY
        sync = load_run_config(config).sync
        run_dir = Path(tmp) / "run"
        up_args = [
            "up",
            "--config",
            str(config),
            "--samples",
            "100000",
            "--run-dir",
            str(run_dir),
            "--no-export",
        ]
        up_args += ["--replicas", "1", "--no-monitor"] if smoke else []
        up = subprocess.Popen([sys.executable, SWARM, *up_args], stdout=log, stderr=subprocess.STDOUT)
        reader = SwarmReader(run_dir)
        adder = None
        try:
            report.note(f"a tiny swarm trains until its stages pass step {sync.stale_after_steps + 5}")
            deadline = time.monotonic() + SWARM_GOING_S
            while True:
                if time.monotonic() > deadline or up.poll() is not None:
                    raise SystemExit(f"the swarm did not get going:\n{Path(log.name).read_text()}")
                workers = _stage_workers(run_dir, 1)
                current = reader.info(workers[0].address) if workers else None
                if current and current["step"] > sync.stale_after_steps + 5:
                    break
                time.sleep(1.0)
            step_before, veteran = current["step"], workers[0]
            known = {m.name for m in SwarmFile.load(run_dir).members}
            started = time.monotonic()
            adder = subprocess.Popen(
                [sys.executable, SWARM, "add-worker", "1", "--run-dir", str(run_dir)],
                stdout=subprocess.DEVNULL,
            )
            seen: dict[str, float] = {}
            forwards_when_serving = None
            report.note("the newcomer on stage 1: its state installed, its sync phases, its first forward")
            while time.monotonic() < started + NEWCOMER_S and "first_forward" not in seen:
                newcomer = next((m for m in _stage_workers(run_dir, 1) if m.name not in known), None)
                state = reader.info(newcomer.address) if newcomer else None
                if state is not None:
                    now = time.monotonic() - started
                    seen.setdefault("answered", now)
                    seen.setdefault(state["phase"], now)
                    if state["phase"] != "downloading":
                        seen.setdefault("installed", now)
                    forwards = state["processed_by_op"].get("forward", 0)
                    if state["phase"] == "serving" and forwards_when_serving is None:
                        forwards_when_serving = forwards
                    if forwards_when_serving is not None and forwards > forwards_when_serving:
                        seen["first_forward"] = now
                time.sleep(0.2)
            report.note("`swarm.py add-worker` to return")
            adder.wait(timeout=ADDER_S)
            current = reader.info(veteran.address) or current
            step_rate = (current["step"] - step_before) / (time.monotonic() - started)
        finally:
            reader.close()
            if adder is not None and adder.poll() is None:
                adder.kill()  # its newcomer is a node of the swarm: stopped with it below
                adder.wait(timeout=10)
            stop_up(up, run_dir, down=True)  # `down`: the newcomer, should `up` not know of it
    if "first_forward" not in seen:
        raise SystemExit(f"the newcomer never served after syncing: phases seen {seen}")
    phases_s = (sync.weight_sync_steps + sync.optimizer_sync_steps) / step_rate
    report.note(f"the stage stepped {step_rate:.2f} steps/s meanwhile")
    report.add("newcomer rpc_up_s", seen["answered"], "s after its start")
    report.add("newcomer state_installed_s", seen["installed"], "s after its start")
    report.add(
        "newcomer weight_sync_done_s", seen.get("optimizer_sync", seen["serving"]), "s after its start"
    )
    report.add("newcomer optimizer_sync_done_s", seen["serving"], "s after its start")
    report.compare(
        "newcomer first_forward_after_sync_s", seen["first_forward"], phases_s, "s after its start"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200.0, help="State size of the stage, MB.")
    parser.add_argument(
        "--link", default="up=200M,down=200M,latency=40ms", help="The joiners' emulated link."
    )
    parser.add_argument("--skip-swarm", action="store_true", help="Only the download figures (a).")
    _harness.add_arguments(parser, deadline_s=2700)
    args = _harness.parse(parser, smoke={"mb": 1.0})
    configure_logging(fmt="console", level="warning")
    report = Report("join", as_json=args.json)
    asyncio.run(download_figures(report, args.mb, args.link))
    if not args.skip_swarm:
        time_to_serve(report, args.smoke)
    report.finish()


if __name__ == "__main__":
    main()
