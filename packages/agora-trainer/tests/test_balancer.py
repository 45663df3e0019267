"""The per-stage balancer: proportional to speed, fair to newcomers, wary of failures."""

from __future__ import annotations

import collections

import pytest

from agora_core.schema import WorkerAnnouncement
from agora_trainer.balancer import StageBalancer


def announce(
    node_id: str, *, phase: str = "serving", throughput: float = 0.0, stage: int = 1, max_batch: int = 8
):
    return WorkerAnnouncement(
        node_id=node_id,
        address=f"tcp://127.0.0.1:{abs(hash(node_id)) % 60000}",
        stage=stage,
        phase=phase,
        throughput=throughput,
        load=0,
        max_batch=max_batch,
        version="t",
    )


def simulate(
    balancer: StageBalancer, seconds_per_sample: dict[str, float], dispatches: int
) -> dict[str, int]:
    counts = dict.fromkeys(seconds_per_sample, 0)
    for _ in range(dispatches):
        ref = balancer.choose()
        counts[ref.node_id] += 1
        balancer.complete(balancer.begin(ref), 1, seconds_per_sample[ref.node_id])
    return counts


def test_work_is_shared_in_proportion_to_measured_speed():
    balancer = StageBalancer(1)
    balancer.update([announce("fast"), announce("slow")])
    counts = simulate(balancer, {"fast": 0.01, "slow": 0.03}, 4000)
    assert counts["fast"] / counts["slow"] == pytest.approx(3.0, rel=0.05)


def simulate_lanes(
    balancer: StageBalancer, seconds_per_sample: dict[str, float], *, lanes: int, waves: int
) -> dict[str, int]:
    """On a virtual clock, ``lanes`` calls in flight at once, in waves. Each worker merges the
    calls it got in a wave into one batch (as the worker runtime coalesces its queue), which
    takes its time per sample times the batch size; every call in it completes with it."""
    counts: collections.Counter[str] = collections.Counter()
    for _ in range(waves):
        calls = []
        for _ in range(lanes):
            ref = balancer.choose()
            calls.append((ref.node_id, balancer.begin(ref)))
        batch = collections.Counter(node_id for node_id, _ in calls)
        for node_id, token in calls:
            balancer.complete(token, 1, seconds_per_sample[node_id] * batch[node_id])
        counts.update(batch)
    return counts


def test_concurrent_lanes_share_work_in_proportion_to_speed():
    # The trainer's case (8 lanes, stage 1 workers at 50 and 150 ms per sample), exactly.
    balancer = StageBalancer(1)
    balancer.update([announce("fast"), announce("slow")])
    counts = simulate_lanes(balancer, {"fast": 0.05, "slow": 0.15}, lanes=8, waves=500)
    assert counts["fast"] + counts["slow"] == 4000
    assert counts["fast"] / counts["slow"] == pytest.approx(3.0, rel=0.01)
    throughput = {node_id: s["throughput"] for node_id, s in balancer.stats().items()}
    assert throughput == pytest.approx({"fast": 20.0, "slow": 20.0 / 3})  # samples/s, not per call


def test_throughput_counts_the_calls_a_worker_serves_at_once():
    balancer = StageBalancer(1)
    balancer.update([announce("batcher")])
    ref = balancer.choose()
    tokens = [balancer.begin(ref) for _ in range(4)]  # four calls, merged into one 0.4 s batch
    for token in tokens:
        balancer.complete(token, 1, 0.4)
    assert balancer.stats()["batcher"]["throughput"] == pytest.approx(10.0, rel=0.25)  # not 2.5/s


def test_a_new_worker_enters_level_with_the_most_loaded_not_at_zero():
    balancer = StageBalancer(1)
    balancer.update([announce("a"), announce("b")])
    simulate(balancer, {"a": 0.01, "b": 0.01}, 100)
    balancer.update([announce("a"), announce("b"), announce("new")])
    counts = simulate(balancer, {"a": 0.01, "b": 0.01, "new": 0.01}, 30)
    assert counts["new"] <= 12  # it shares the work, it is not flooded with it


def test_a_joiner_out_of_weight_sync_shares_the_work_instead_of_taking_all_of_it():
    # It was announced (invisible) long before it could serve; meanwhile the others were
    # charged for every sample. Level with the vruntime it had when first seen, it would take
    # every request until it caught up: the stage's batch, which its optimizer-sync samples do
    # not fill, would then never complete.
    balancer = StageBalancer(1)
    balancer.update([announce("a"), announce("b"), announce("joiner", phase="weight_sync")])
    simulate(balancer, {"a": 0.01, "b": 0.01}, 600)
    balancer.update([announce("a"), announce("b"), announce("joiner", phase="optimizer_sync")])
    counts = simulate(balancer, {"a": 0.01, "b": 0.01, "joiner": 0.01}, 60)
    assert 10 <= counts["joiner"] <= 30, counts


def test_a_worker_back_from_a_ban_shares_the_work_instead_of_taking_all_of_it(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("agora_core.world.monotonic", lambda: now[0])  # the world's clock seam
    balancer = StageBalancer(1, ban_s=5.0)
    balancer.update([announce("a"), announce("b"), announce("c")])
    simulate(balancer, {"a": 0.01, "b": 0.01, "c": 0.01}, 30)
    balancer.fail(balancer.begin(next(w for w in balancer.workers if w.node_id == "c")))
    simulate(balancer, {"a": 0.01, "b": 0.01}, 600)  # c sits out its ban
    now[0] += 10.0
    counts = simulate(balancer, {"a": 0.01, "b": 0.01, "c": 0.01}, 60)
    assert 10 <= counts["c"] <= 30, counts


def test_failed_workers_are_banned_and_weight_sync_workers_invisible():
    balancer = StageBalancer(1, ban_s=60)
    balancer.update([announce("a"), announce("b"), announce("syncing", phase="weight_sync")])
    a = next(w for w in balancer.workers if w.node_id == "a")
    balancer.fail(balancer.begin(a))
    assert {balancer.choose().node_id for _ in range(10)} == {"b"}
    assert balancer.bans == 1 and balancer.banned("a")
    balancer.update([announce("b")])  # a and syncing left the stage
    assert [w.node_id for w in balancer.workers] == ["b"]
    balancer.update([])
    assert balancer.choose() is None


def test_with_every_worker_banned_the_one_failed_longest_ago_is_probed_and_success_lifts_its_ban():
    dead: set[str] = set()
    balancer = StageBalancer(1, ban_s=3600, probe_s=0.0, gone=dead.__contains__)
    balancer.update([announce("a"), announce("b"), announce("c")])
    dead.add("c")  # the DHT declared it dead: never chosen, not even as a probe
    for node_id in ("a", "b"):  # the trainer's own link dropped: every call failed
        balancer.fail(balancer.begin(next(w for w in balancer.workers if w.node_id == node_id)))
    assert balancer.workers == []
    probes = [balancer.choose().node_id for _ in range(4)]
    assert probes == ["a", "b", "a", "b"]  # the oldest failure first; each probe counts as tried
    balancer.complete(balancer.begin(balancer.choose()), 1, 0.1)  # "a" answers: its ban is lifted
    assert [w.node_id for w in balancer.workers] == ["a"] and not balancer.banned("a")
    assert balancer.banned("b")
    patient = StageBalancer(1, ban_s=3600, probe_s=3600)
    patient.update([announce("a")])
    patient.fail(patient.begin(patient.workers[0]))
    assert patient.choose() is None  # probed no sooner than probe_s after its failure


def test_announcements_for_other_stages_are_ignored_and_moves_are_followed():
    balancer = StageBalancer(1)
    balancer.update([announce("a"), announce("x", stage=2)])
    assert [w.node_id for w in balancer.workers] == ["a"]
    moved = WorkerAnnouncement(**{**announce("a").to_value(), "address": "tcp://127.0.0.1:9"})
    balancer.update([moved])
    assert balancer.choose().address == "tcp://127.0.0.1:9"


def test_a_microbatch_goes_only_to_a_worker_that_takes_that_many_samples_at_once():
    balancer = StageBalancer(1)
    balancer.update([announce("small", max_batch=2), announce("large", max_batch=8)])
    assert balancer.largest_batch() == 8
    chosen = collections.Counter(balancer.choose(4).node_id for _ in range(20))
    assert chosen == {"large": 20}  # never the one whose input check would refuse 4 samples
    assert balancer.choose(2).node_id == "small"  # it takes 2, and it is the less loaded now
    assert balancer.choose(16) is None  # nobody takes 16: the trainer's lanes take fewer
    balancer.update([announce("small", max_batch=2), announce("large", max_batch=4)])  # restarted
    assert balancer.largest_batch() == 4 and balancer.choose(8) is None
    balancer.update([])
    assert balancer.largest_batch() is None


def test_a_distrusted_worker_gets_no_new_work_until_its_exclusion_lapses_then_shares_it(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("agora_core.world.monotonic", lambda: now[0])  # the world's clock seam
    balancer = StageBalancer(1)
    balancer.update([announce("a"), announce("b"), announce("c")])
    simulate(balancer, {"a": 0.01, "b": 0.01, "c": 0.01}, 30)
    c = next(w for w in balancer.workers if w.node_id == "c")
    balancer.distrust("c", 60.0)
    assert balancer.distrusted("c") and balancer.distrusts == 1
    assert not balancer.banned("c")  # no failure of its calls: a backward pinned to it may go
    balancer.complete(balancer.begin(c), 1, 0.01)  # such a backward succeeded: still distrusted
    assert [w.node_id for w in balancer.workers] == ["a", "b"]
    assert simulate(balancer, {"a": 0.01, "b": 0.01}, 600) == {"a": 300, "b": 300}
    now[0] += 59.0
    assert balancer.choose().node_id != "c"
    now[0] += 2.0
    assert not balancer.distrusted("c")
    counts = simulate(balancer, {"a": 0.01, "b": 0.01, "c": 0.01}, 60)
    assert 10 <= counts["c"] <= 30, counts  # back level with the most-loaded, not flooded
    with pytest.raises(ValueError, match="positive time"):
        balancer.distrust("a", 0.0)


def test_a_distrusted_worker_is_never_probed_and_stays_distrusted_through_a_worker_list_gap(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("agora_core.world.monotonic", lambda: now[0])
    balancer = StageBalancer(1, ban_s=5.0, probe_s=0.0)
    balancer.update([announce("a"), announce("b"), announce("c")])
    pinned = {w.node_id: w for w in balancer.workers}  # what lanes kept for their backwards
    balancer.distrust("c", 60.0)
    balancer.update([announce("a"), announce("b")])  # it drops out of one worker list ...
    balancer.update([announce("a"), announce("b"), announce("c")])  # ... and is back in the next
    assert balancer.distrusted("c")
    balancer.fail(balancer.begin(pinned["c"]))  # a backward pinned to it failed
    now[0] += 1.0
    for node_id in ("a", "b"):  # every worker is banned now, c the longest
        balancer.fail(balancer.begin(pinned[node_id]))
    assert balancer.workers == []
    assert balancer.choose().node_id == "a"  # the oldest failure of those that may be probed
    now[0] += 10.0  # the bans lapse, the exclusion does not
    assert simulate(balancer, {"a": 0.01, "b": 0.01}, 100)["a"] > 0
    assert all(balancer.choose().node_id != "c" for _ in range(100))
