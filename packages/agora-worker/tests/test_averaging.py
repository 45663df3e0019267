"""AsyncSPARTA rounds among real worker processes on 127.0.0.1 (surrogate stages).

Four replicas of stage 1 (five in one test) train on different samples so their weights differ (their dummy
parameters start at each replica's own random values), then average one segment. Rounds are
started by hand (``averaging.start``) so each test controls when they run; every wait is on a
condition with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import numpy as np
import pytest

from agora_core.admission.accusations import accusations_key, parse_accusations
from agora_core.config import load_run_config
from agora_core.dht import DhtNode
from agora_core.identity import NodeKey
from agora_core.rpc import RpcClient
from agora_devkit.processes import ChildProcess, poll_until, spawn_python
from agora_devkit.runs import tiny_run_toml
from agora_worker.averaging.allreduce import slice_bounds
from agora_worker.averaging.robust import MIN_HISTORY_ROUNDS
from agora_worker.averaging.segments import SegmentLayout

pytestmark = pytest.mark.slow
STAGE = 1
DUMMY = 400_000


def run_toml(
    *, window: float, reducers: str, reducer_ids: list[str], chunk_bytes: int, segments: int = 4
) -> str:
    """The averaging tests' run: slower gossip than the default tests' (rounds span seconds)."""
    return tiny_run_toml(
        "avg-test",
        seed=5,
        fast_dht=False,
        dht={
            "gossip_period_s": 0.5,
            "probe_timeout_s": 0.45,
            "suspicion_timeout_s": 5.0,
            "op_timeout_s": 3.0,
        },
        optimizer={"target_batch_size": 8, "warmup_steps": 0, "lr": 0.01},
        averaging={
            "segments": segments,
            "cadence_steps": 100000,
            "matchmaking_window_s": window,
            "round_timeout_s": 20.0,
            "chunk_timeout_s": 4.0,
            "reducers": reducers,
            "reducer_ids": reducer_ids,
            # one clipped round is an accusation: the liar test lies for one round
            "accuse_after_rounds": 1,
            "accuse_window_rounds": 1,
        },
        transport={"chunk_bytes": chunk_bytes},
        **{"model.surrogate": {"dummy_parameters": DUMMY}},
    )


@dataclass
class Replica:
    child: ChildProcess
    node_id: str
    address: str


class Cluster:
    def __init__(self, tmp, seed: DhtNode, client: RpcClient, stack: contextlib.ExitStack, config_path):
        self.tmp, self.seed, self.client, self.stack, self.config_path = tmp, seed, client, stack, config_path
        self.replicas: list[Replica] = []
        run = load_run_config(config_path)
        self.layout = SegmentLayout(
            [16, 4, DUMMY], segments=run.averaging.segments, run_seed=run.seed, stage=STAGE
        )

    async def start(
        self, key_files: list[str], extra: list[list[str]], attacks: dict[int, str] | None = None
    ) -> None:
        """Start replicas (after any already started); ``attacks``: index in ``key_files`` ->
        the lie that replica tells (``agora_devkit.attacker``)."""
        attacks = attacks or {}

        async def one(index: int, key_file: str, args: list[str]) -> Replica:
            program = ["agora_devkit.attacker", attacks[index]] if index in attacks else ["agora_worker"]
            command = [
                "-m",
                *program,
                "run",
                "--config",
                str(self.config_path),
                "--stage",
                str(STAGE),
                "--bootstrap",
                self.seed.address,
                "--device",
                "cpu",
                "--key-file",
                key_file,
                "--progress-interval",
                "0.05",
                "--announce-interval",
                "0.2",
                *args,
            ]
            child = self.stack.enter_context(spawn_python(command, env={"AGORA_LOG_LEVEL": "warning"}))
            node_id = await asyncio.to_thread(child.read_until, "  node id    ")
            address = await asyncio.to_thread(child.read_until, "  serving    ")
            return Replica(child, node_id, address)

        self.replicas += await asyncio.gather(
            *(one(i, k, a) for i, (k, a) in enumerate(zip(key_files, extra, strict=True)))
        )

    async def call(self, replica: Replica, method: str, meta=None, tensors=None, timeout_s: float = 30):
        return await self.client.call(replica.address, method, meta, tensors, timeout_s=timeout_s)

    async def train(self, replica: Replica, samples: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(samples):
            tensors = {
                "tokens": rng.integers(0, 256, (1, 8), dtype=np.int64),
                "boundary": rng.standard_normal((1, 8, 4), dtype=np.float32),
                "grad": rng.standard_normal((1, 8, 4), dtype=np.float32),
            }
            await self.call(replica, "backward", {"stage": STAGE}, tensors)

    async def wait(self, predicate, what: str, timeout_s: float = 30) -> None:
        await poll_until(predicate, timeout_s=timeout_s, what=what)

    async def infos(self, replicas: list[Replica] | None = None) -> list[dict]:
        return [await self.info(r) for r in replicas or self.replicas]

    async def info(self, replica: Replica) -> dict:
        return (await self.call(replica, "worker.info")).meta

    async def params(self, replica: Replica) -> tuple[np.ndarray, int]:
        reply = await self.call(replica, "worker.parameters")
        return np.array(reply.tensors["values"]), reply.meta["total_samples"]

    async def train_to_first_step(self, samples: list[int], *, step: int = 1, seed: int = 0) -> None:
        """Each replica trains on its own samples; the stage steps (to ``step``) when they add up."""
        await asyncio.gather(
            *(
                self.train(r, n, seed=seed + i)
                for i, (r, n) in enumerate(zip(self.replicas, samples, strict=True))
            )
        )

        async def stepped():
            return all(info["step"] >= step for info in await self.infos())

        await self.wait(stepped, f"the stage's step {step}")

    async def ready(self, key_files: list[str], extra: list[list[str]], samples: list[int]) -> list:
        """Start the replicas, train them to the stage's first step; their (values, samples)."""
        await self.start(key_files, extra)
        await self.train_to_first_step(samples)
        return [await self.params(r) for r in self.replicas]

    def segment_mask(self, segment: int) -> np.ndarray:
        mask = np.zeros(self.layout.total, bool)
        for start, stop in self.layout.ranges(segment):
            mask[start:stop] = True
        return mask

    @property
    def trained_segment(self) -> int:
        """The segment holding flat index 0, where the trained weights are."""
        return next(s for s in range(self.layout.segments) if self.layout.ranges(s)[0][0] == 0)

    async def round(self, replicas: list[Replica], index: int) -> list[dict]:
        replies = await asyncio.gather(
            *(self.call(r, "averaging.start", {"round": index}, timeout_s=30) for r in replicas)
        )
        return [reply.meta for reply in replies]


@contextlib.asynccontextmanager
async def cluster(
    tmp_path,
    *,
    window: float = 3.0,
    reducers: str = "all",
    reducer_ids: list[str] = (),
    chunk_bytes: int = 8192,
    segments: int = 4,
):
    config = tmp_path / "run.toml"
    config.write_text(
        run_toml(
            window=window,
            reducers=reducers,
            reducer_ids=[str(i) for i in reducer_ids],
            chunk_bytes=chunk_bytes,
            segments=segments,
        )
    )
    run = load_run_config(config)
    seed = DhtNode(key=NodeKey.generate(), config=run.dht)
    await seed.start()
    stack = contextlib.ExitStack()
    client = RpcClient()
    c = Cluster(tmp_path, seed, client, stack, config)
    try:
        yield c
    finally:
        await client.close()
        for replica in c.replicas:  # all stop at once; the stack then waits for each
            replica.child.begin_stop()
        stack.close()
        await seed.stop()


def keys(tmp_path, count: int) -> tuple[list[str], list[str]]:
    """Key files made ahead, so the node ids can go into the run config."""
    paths, ids = [], []
    for i in range(count):
        key = NodeKey.generate()
        paths.append(str(key.save(tmp_path / f"replica{i}.key")))
        ids.append(key.node_id)
    return paths, ids


def weighted_mean(values: list[np.ndarray], weights: list[float]) -> np.ndarray:
    return sum(w * v.astype(np.float64) for w, v in zip(weights, values, strict=True)) / sum(weights)


async def test_a_clean_round_gives_every_replica_the_sample_weighted_mean_of_one_segment(tmp_path):
    # four replicas that trained, and a fifth still syncing its weights: it brings no samples
    # (weight zero), takes the average, and does not move it
    async with cluster(tmp_path) as c:
        paths, _ids = keys(tmp_path, 5)
        before = await c.ready(paths, [[]] * 4 + [["--phase", "weight_sync"]], [1, 2, 3, 4, 0])
        values, weights = [v for v, _ in before], [float(n) for _, n in before]
        assert weights == [1.0, 2.0, 3.0, 4.0, 0.0]
        assert not np.allclose(values[0][:20], values[1][:20])  # training made them differ
        segment = c.trained_segment
        reports = await c.round(c.replicas, segment)
        mask = c.segment_mask(segment)
        expected = weighted_mean(values[:4], weights[:4])  # the syncing peer moves nothing
        assert not np.allclose(values[4][mask], expected[mask])  # ... though it started elsewhere
        for (old, _), replica, report in zip(before, c.replicas, reports, strict=True):
            new, _ = await c.params(replica)
            np.testing.assert_allclose(new[mask], expected[mask], rtol=1e-5, atol=1e-6)
            assert np.array_equal(new[~mask], old[~mask])  # untouched coordinates unchanged
            assert report["group_size"] == 5 and report["averaging_success"] == 1.0
            assert report["reduce_success"] == 1.0 and not report["excluded"]
            # how far it stood from the group: what a joiner's probation holds against its peers'
            apart = np.linalg.norm(expected[mask] - old[mask]) / np.linalg.norm(old[mask])
            assert report["distance"] == pytest.approx(apart, rel=1e-3)
        assert reports[4]["distance"] > max(r["distance"] for r in reports[:4])  # it started elsewhere


async def test_steps_taken_during_a_round_are_kept_by_the_delta_rule(tmp_path):
    async with cluster(tmp_path, window=12.0) as c:
        paths, _ids = keys(tmp_path, 4)
        before = await c.ready(paths, [[]] * 4, [2, 2, 2, 2])
        segment = c.trained_segment
        # Three replicas snapshot their segment and wait in matchmaking for the fourth ...
        first = asyncio.gather(*(c.round([r], segment) for r in c.replicas[:3]))

        async def waiting():
            infos = await c.infos(c.replicas[:3])
            return all(i["averaging"]["active_round"] == segment for i in infos)

        await c.wait(waiting, "three replicas to be in the round")
        # ... while replica 0 trains a whole batch by itself: the stage steps, only replica 0 moves
        await c.train(c.replicas[0], 8, seed=99)

        async def stepped():
            return (await c.info(c.replicas[0]))["step"] >= 2

        await c.wait(stepped, "replica 0's second step")
        last = await c.round([c.replicas[3]], segment)
        reports = [r for [r] in await first] + last
        assert reports[0]["steps_during"] >= 1 and reports[0]["averaging_success"] == 1.0
        mask = c.segment_mask(segment)
        average = weighted_mean([v for v, _ in before], [2.0] * 4)
        new = [(await c.params(r))[0] for r in c.replicas]
        for other in new[1:]:
            np.testing.assert_allclose(other[mask], average[mask], rtol=1e-5, atol=1e-6)
        kept = new[0][mask] - average[mask]  # replica 0 = the average plus its own step
        assert np.abs(kept[:20]).max() > 1e-4  # its trained weights kept the step ...
        np.testing.assert_allclose(kept[20:], 0.0, atol=1e-6)  # ... dummy weights do not train


def agree(values: list[np.ndarray], mask: np.ndarray) -> None:
    for other in values[1:]:
        np.testing.assert_allclose(other[mask], values[0][mask], rtol=1e-5, atol=1e-6)


async def test_a_sender_killed_mid_send_leaves_the_survivors_averaged_among_themselves(tmp_path):
    paths, ids = keys(tmp_path, 4)
    async with cluster(tmp_path, window=6.0, reducers="listed", reducer_ids=ids[:2], chunk_bytes=4096) as c:
        # replica 3 only sends, over a 100 ms link: stream credit paces its ~100 chunks over seconds
        before = await c.ready(paths, [[], [], [], ["--link", "latency=100ms"]], [2, 2, 2, 2])
        segment = c.trained_segment
        victim = c.replicas[3]
        rounds = [asyncio.create_task(c.round([r], segment)) for r in c.replicas]

        async def victim_heard():
            infos = await c.infos(c.replicas[:2])
            return any(victim.node_id in i["averaging"]["heard_from"] for i in infos)

        await c.wait(victim_heard, "a reducer to have the victim's first chunk")
        victim.child.kill()  # the rest of its chunks are still on its slow uplink
        results = [report for [report] in await asyncio.gather(*rounds[:3])]
        await asyncio.gather(rounds[3], return_exceptions=True)
        mask = c.segment_mask(segment)
        new = [(await c.params(r))[0] for r in c.replicas[:3]]
        agree(new, mask)
        among_survivors = weighted_mean([v for v, _ in before[:3]], [2.0] * 3)
        with_victim = weighted_mean([v for v, _ in before], [2.0] * 4)
        three = np.isclose(new[0], among_survivors, rtol=1e-5, atol=1e-6)
        four = np.isclose(new[0], with_victim, rtol=1e-5, atol=1e-6)
        # chunks completed before the kill include the victim; every later one is the survivors'
        assert (three | four)[mask].all()
        assert three[mask].mean() > 0.25, three[mask].mean()
        for report in results:
            assert report["averaging_success"] == 1.0 and report["seconds"] < 20.0
        assert min(report["reduce_success"] for report in results[:2]) < 1.0  # reducers missed some


async def test_a_reducer_killed_mid_round_leaves_its_slice_local_and_the_next_round_completes(tmp_path):
    paths, ids = keys(tmp_path, 4)
    async with cluster(tmp_path, window=4.0, reducers="listed", reducer_ids=ids[:2], chunk_bytes=4096) as c:
        # reducer 1 is 100 ms away: stream credit paces the others' chunks to it over seconds
        before = await c.ready(paths, [[], ["--link", "latency=100ms"], [], []], [2, 2, 2, 2])
        segment = c.trained_segment
        victim = c.replicas[1]
        survivors = [c.replicas[i] for i in (0, 2, 3)]
        rounds = [asyncio.create_task(c.round([r], segment)) for r in c.replicas]

        async def group_formed():
            infos = await c.infos(survivors)
            return all(i["averaging"]["group_size"] == 4 for i in infos)

        await c.wait(group_formed, "the survivors to form the group of four")
        victim.child.kill()
        results = [report for [report] in await asyncio.gather(*(rounds[i] for i in (0, 2, 3)))]
        await asyncio.gather(rounds[1], return_exceptions=True)
        mask = c.segment_mask(segment)
        for replica, (old, _), report in zip(survivors, [before[i] for i in (0, 2, 3)], results, strict=True):
            assert 0.0 < report["averaging_success"] < 1.0, report  # reducer 0's slice came back only
            new, _ = await c.params(replica)
            changed = ~np.isclose(new, old, rtol=0, atol=1e-7)
            assert changed[mask].any() and not changed[~mask].any()
        # the next round, among the three survivors, completes
        nxt = [report for [report] in await asyncio.gather(*(c.round([r], segment + 4) for r in survivors))]
        assert all(r["group_size"] == 3 and r["averaging_success"] == 1.0 for r in nxt), nxt


async def test_a_peer_that_comes_late_is_excluded_and_keeps_its_weights(tmp_path):
    async with cluster(tmp_path, window=1.5) as c:
        paths, _ids = keys(tmp_path, 4)
        before = await c.ready(paths, [[]] * 4, [2, 2, 2, 2])
        segment = c.trained_segment
        early = await c.round(c.replicas[:3], segment)  # they wait the window for the 4th, then go
        late = (await c.round(c.replicas[3:], segment))[0]
        assert [r["group_size"] for r in early] == [3, 3, 3]
        assert late["excluded"] and late["averaging_success"] == 0.0
        new_late, _ = await c.params(c.replicas[3])
        assert np.array_equal(new_late, before[3][0])
        mask = c.segment_mask(segment)
        expected = weighted_mean([v for v, _ in before[:3]], [2.0] * 3)
        np.testing.assert_allclose(
            (await c.params(c.replicas[0]))[0][mask], expected[mask], rtol=1e-5, atol=1e-6
        )


def slice_owners(c: Cluster, segment: int, ids: list[str]) -> list[tuple[np.ndarray, str]]:
    """The flat indices of each slice of ``segment`` and the node id that reduces it (every
    replica reduces: one slice each, in node-id order)."""
    indices = np.concatenate([np.arange(start, stop) for start, stop in c.layout.ranges(segment)])
    owners = sorted(ids)
    bounds = slice_bounds(len(indices), len(owners))
    return [(indices[lo:hi], owner) for (lo, hi), owner in zip(bounds, owners, strict=True)]


def rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a.astype(np.float64) - b) ** 2)))


async def accused_in_dht(c: Cluster, liar: str, honest: set[str]) -> bool:
    """Every honest replica's signed entry is in the DHT and accuses the liar, and only it."""
    records = parse_accusations(await c.seed.get(accusations_key("avg-test")))
    by_accuser = {r.accuser: {a.accused for a in r.accusations} for r in records}
    return all(by_accuser.get(node) == {liar} for node in honest)


@pytest.mark.parametrize("attack", ["scaled", "sign_flip", "noise", "weight"])
async def test_a_replica_that_turns_liar_moves_the_honest_ones_no_further_than_the_clip(tmp_path, attack):
    """Four replicas train apart a little (each steps on its own gradients) and average their
    weights (one segment) honestly, round after round, until each block has a history; then
    replica 3 lies (agora_devkit.attacker): its values scaled, flipped or noisy, or its weight
    inflated. The honest three end near their own mean, with the liar named in their evidence
    and no honest peer in it, and each accuses it (alone) in a signed DHT entry; an inflated
    weight counts as the cap, 4x the reducer's own."""
    async with cluster(tmp_path, segments=1) as c:
        paths, ids = keys(tmp_path, 4)
        await c.start(paths, [[]] * 4, attacks={3: f"{attack}@{MIN_HISTORY_ROUNDS}"})
        for index in range(MIN_HISTORY_ROUNDS + 1):
            await c.train_to_first_step([2, 2, 2, 2], step=index + 1, seed=10 * index)
            if index < MIN_HISTORY_ROUNDS:  # honest rounds: every block seen this often
                await c.round(c.replicas, index)
        values = [(await c.params(r))[0] for r in c.replicas]
        segment = 0
        reports = await c.round(c.replicas, MIN_HISTORY_ROUNDS)
        mask = c.segment_mask(segment)
        honest_mean = weighted_mean(values[:3], [2.0] * 3)
        spread = max(rms(v[mask], honest_mean[mask]) for v in values[:3])
        assert spread > 0  # they trained apart
        liar, honest_ids = ids[3], set(ids[:3])
        for replica, report in zip(c.replicas[:3], reports[:3], strict=True):
            new, _ = await c.params(replica)
            # its own distance, plus at most clip_multiplier (4) typical differences where the
            # liar reduces and a clipped share elsewhere; a lie taken whole moves it ~|w| (~1)
            assert rms(new[mask], honest_mean[mask]) <= 6 * spread, attack
            clipped = (await c.info(replica))["averaging"]["clipped"]
            assert not honest_ids & clipped.keys(), clipped  # no honest peer is clipped
            assert liar in clipped and report["clipped"] > 0, (attack, clipped)  # evidence
        await c.wait(
            lambda: accused_in_dht(c, liar, honest_ids), "the honest replicas' accusations in the DHT"
        )
        for replica in c.replicas[:3]:  # each accuses the liar alone
            assert set((await c.info(replica))["averaging"]["accused"]) == {liar}, attack
        if attack == "weight":  # an honest reducer's slice: the liar's weight counts as 4 x 2
            for indices, owner in slice_owners(c, segment, ids):
                if owner != liar:
                    expected = weighted_mean([v[indices] for v in values], [2.0, 2.0, 2.0, 8.0])
                    new, _ = await c.params(c.replicas[ids.index(owner)])
                    np.testing.assert_allclose(new[indices], expected, rtol=1e-5, atol=1e-6)


async def test_a_replica_claiming_a_far_step_makes_no_honest_one_step(tmp_path):
    """Three honest replicas train to their first step; then a fourth joins and claims 1000
    steps more than it took, in its signed progress report and its pushes
    (agora_devkit.attacker's ``progress``). Its claim stands far past the quorum step of the
    four, so the honest three ignore it, name it, and step only on a batch they hold. (This
    uses the averaging cluster: real replicas of one stage.)"""
    async with cluster(tmp_path) as c:
        paths, ids = keys(tmp_path, 4)
        await c.start(paths[:3], [[]] * 3)
        await c.train_to_first_step([3, 3, 3])
        await c.start(paths[3:], [[]], attacks={0: "progress"})
        liar, honest = ids[3], c.replicas[:3]

        async def all_ignore() -> bool:
            return all(liar in info["ignored_step_claims"] for info in await c.infos(honest))

        await c.wait(all_ignore, "the honest replicas ignoring the liar's step")
        assert [info["step"] for info in await c.infos(honest)] == [1, 1, 1]  # nothing held: no step
        await c.train_to_first_step([3, 3, 3, 0], step=2)  # 9 samples of a batch of 8: the stage steps
        assert [info["step"] for info in await c.infos(honest)] == [2, 2, 2]
