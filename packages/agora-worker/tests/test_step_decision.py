"""The step decision on exact numbers: when a worker steps, and what it counts of its peers."""

from __future__ import annotations

from agora_core.schema import StageProgress
from agora_worker.progress.decision import MAX_STEP_LEAD, decide_step, known_reports


def report(node: str, step: int, samples: int) -> StageProgress:
    return StageProgress(
        node_id=node, step=step, samples=samples, address=f"tcp://127.0.0.1:{9000 + ord(node)}"
    )


def test_a_worker_steps_once_the_workers_at_its_step_hold_the_batch():
    peers = [report("a", 5, 6), report("b", 5, 7)]
    short = decide_step(5, 2, peers, target=16)
    assert not short.step_now and short.stage_samples == 15 and short.others == 13 and short.peers == 2
    full = decide_step(5, 3, peers, target=16)
    assert full.step_now and not full.behind and full.stage_samples == 16


def test_samples_at_other_steps_do_not_count_toward_this_one():
    peers = [report("a", 4, 100), report("b", 5, 1)]  # a lags behind: its samples are another step's
    decision = decide_step(5, 2, peers, target=16)
    assert not decision.step_now and decision.stage_samples == 3 and decision.peers == 1
    assert decision.stage_step == 5


def test_a_worker_behind_a_peer_steps_at_once_even_with_nothing_held():
    decision = decide_step(5, 0, [report("a", 7, 0)], target=16)
    assert decision.step_now and decision.behind and decision.stage_step == 7 and decision.stage_samples == 0


def test_the_collector_steps_on_its_peers_counts_alone():
    decision = decide_step(5, 0, [report("a", 5, 9), report("b", 5, 7)], target=16)
    assert decision.step_now and not decision.behind and decision.stage_samples == 16


def test_alone_a_worker_steps_on_its_own_batch():
    assert not decide_step(0, 15, [], target=16).step_now
    assert decide_step(0, 16, [], target=16).step_now


def test_a_fresh_push_raises_a_report_and_a_stale_or_lower_one_does_not():
    reports = [report("a", 5, 2), report("b", 5, 8), report("c", 5, 3)]
    pushes = {
        "a": (5, 6, 99.0),  # fresh and ahead: counts
        "b": (5, 4, 99.5),  # behind the signed report: never lowers it
        "c": (6, 0, 80.0),  # ahead but stale (received 20 s before now)
        "z": (9, 9, 99.9),  # a push from a peer with no report is not counted
    }
    known = {r.node_id: (r.step, r.samples) for r in known_reports(reports, pushes, now=100.0, fresh_s=10.0)}
    assert known == {"a": (5, 6), "b": (5, 8), "c": (5, 3)}


def test_a_pushed_new_step_makes_the_worker_behind():
    reports = [report("a", 5, 10)]
    known = known_reports(reports, {"a": (6, 0, 100.0)}, now=100.5, fresh_s=10.0)
    decision = decide_step(5, 3, known, target=16)
    assert decision.step_now and decision.behind and decision.stage_step == 6


def test_a_claim_far_past_the_quorum_step_is_not_heard():
    peers = [report("a", 5, 6), report("z", 5000, 0)]  # z: a minority claiming to be far ahead
    decision = decide_step(5, 2, peers, target=16)
    assert not decision.step_now and not decision.behind and decision.stage_step == 5
    assert decision.quorum_step == 5 and decision.ignored == ("z",)
    assert decision.stage_samples == 8  # a's samples still count


def test_a_leader_some_steps_ahead_is_followed():
    one_ahead = decide_step(5, 2, [report("a", 6, 0), report("z", 5, 0)], target=16)
    assert one_ahead.step_now and one_ahead.behind and one_ahead.ignored == ()
    lead = MAX_STEP_LEAD  # a leader that stepped on alone while its peers paused
    far = decide_step(5, 2, [report("a", 5 + lead, 0), report("b", 5, 0), report("c", 5, 0)], target=16)
    assert far.behind and far.stage_step == 5 + lead
    past = decide_step(5, 2, [report("a", 6 + lead, 0), report("b", 5, 0), report("c", 5, 0)], target=16)
    assert not past.behind and past.ignored == ("a",)


def test_a_laggard_follows_the_majority_however_far_behind():
    far = 5 + 10 * MAX_STEP_LEAD
    decision = decide_step(5, 0, [report("a", far, 1), report("b", far, 2)], target=16)
    assert decision.quorum_step == far and decision.behind and decision.stage_step == far
    pair = decide_step(5, 0, [report("a", far, 1)], target=16)  # of two, the one ahead
    assert pair.behind and pair.ignored == ()
