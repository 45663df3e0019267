"""Shard rotation: a seeded shuffle, assignments that take effect at a shard boundary, and
trainers that swap, hand over and adopt shards on a real DHT without a sample read twice or
skipped in an epoch.

The trainers' stages are stand-ins on real RPC servers (``agora_devkit.trainer``): the test
is about which samples a trainer reads, not what they compute.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections import Counter

import pytest

from agora_core.config import OperatorConfig
from agora_core.identity import NodeKey
from agora_devkit.processes import wait_until_async
from agora_devkit.trainer import StandInSwarm, stand_in_run
from agora_trainer.data.cursor import SampleCursor
from agora_trainer.data.rotation_record import (
    RotationError,
    format_ranges,
    new_assignment,
    parse_ranges,
    publish_assignment,
)
from agora_trainer.data.sharding import make_shards
from agora_trainer.data.shards import open_shards
from agora_trainer.data.tokenizer import ByteTokenizer
from agora_trainer.errors import ShardError
from agora_trainer.trainer import Trainer

SEQ = 8
K = 4
OPERATOR = NodeKey.generate()
RUN = stand_in_run(
    "rotation", K, operator=OperatorConfig(public_keys=[OPERATOR.public_key.hex()], injection_watch_s=0.2)
)


def shard_set(tmp_path, shards: int = 4, samples_per_shard: int = 300):
    """``shards`` shards of byte tokens, about ``samples_per_shard`` samples of SEQ each."""
    words = random.Random(0).choices(["alpha", "beta", "gamma", "delta", "pi", "rho"], k=20_000)
    src = tmp_path / "src"
    src.mkdir()
    per_doc = samples_per_shard * SEQ // 2  # two documents per shard
    text = " ".join(words)
    for i in range(shards * 2):
        (src / f"doc{i}.txt").write_text(f"{i} " + text[i * 7 : i * 7 + per_doc])
    make_shards(
        tmp_path / "shards", shards=shards, tokenizer=ByteTokenizer(), sources=[src], validation_fraction=0
    )
    return tmp_path / "shards"


def drain(cursor: SampleCursor, *, limit: int = 100_000) -> list[int]:
    ids = []
    while (sample := cursor.take()) is not None and len(ids) < limit:
        ids.append(sample.id)
        cursor.complete(sample.id, save=False)
    return ids


# --- the cursor alone -----------------------------------------------------------------------------


def test_every_sample_once_per_epoch_in_an_order_drawn_from_the_seed(tmp_path):
    shards = open_shards(shard_set(tmp_path))
    cursor = SampleCursor(shards, SEQ, shuffle_seed=3, epochs=2)
    ids = drain(cursor)
    total = cursor.total
    assert cursor.finished and len(ids) == 2 * total and len(set(ids)) == 2 * total
    first, second = ids[:total], ids[total:]
    assert sorted(first) == list(range(total)) and sorted(i - total for i in second) == list(range(total))
    assert first != sorted(first)  # shuffled within shards, shards in a drawn order
    assert [i - total for i in second] != first  # each epoch its own order
    assert drain(SampleCursor(shards, SEQ, shuffle_seed=3, epochs=2)) == ids  # the seed decides it
    assert drain(SampleCursor(shards, SEQ, shuffle_seed=4)) != first
    shard_runs = [cursor.locate(i)[1] for i in first]
    assert sum(a != b for a, b in itertools.pairwise(shard_runs)) == len(shards) - 1  # one shard at a time


def test_a_new_assignment_takes_effect_at_the_shard_boundary_after_its_handover(tmp_path):
    shards = open_shards(shard_set(tmp_path))
    now = [1000.0]
    state = tmp_path / "state.json"
    cursor = SampleCursor(shards, SEQ, state, assigned={0, 1}, clock=lambda: now[0])
    first = [cursor.take() for _ in range(5)]
    reading = cursor.locate(first[0].id)[1]
    assert reading in (0, 1)
    for sample in first:
        cursor.complete(sample.id)
    # a restart, then the operator's new assignment (as the trainer's rotation applies it):
    # the half-read shard is resumed to its end, though it is no longer assigned
    cursor = SampleCursor(shards, SEQ, state, assigned={0, 1}, clock=lambda: now[0])
    cursor.assign({2, 3}, usable_from=now[0] + 5)
    rest = drain(cursor)
    assert {cursor.locate(i)[1] for i in rest} == {reading}  # to the end of that shard only
    assert cursor.take() is None and not cursor.finished  # shards 2 and 3 are on their way
    now[0] += 6
    after = drain(cursor)
    assert {cursor.locate(i)[1] for i in after} == {2, 3} and cursor.finished
    read = [s.id for s in first] + rest + after
    assert len(read) == len(set(read))
    per_shard = Counter(cursor.locate(i)[1] for i in read)
    assert per_shard[reading] == shards[reading].sample_count(SEQ)
    assert set(per_shard) == {reading, 2, 3}  # the other of 0 and 1 is never opened


def test_ranges_and_assignments_refuse_what_they_cannot_mean(tmp_path):
    assert parse_ranges("0-3, 8,10-11") == {0, 1, 2, 3, 8, 10, 11} and parse_ranges("") == frozenset()
    assert format_ranges({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    for bad in ("3-1", "x", "-2", "1-b"):
        with pytest.raises(RotationError, match="shard range"):
            parse_ranges(bad)
    with pytest.raises(RotationError, match="would both read shards 2"):
        new_assignment({"aaaaaaaa": parse_ranges("0-2"), "bbbbbbbb": parse_ranges("2-3")})
    with pytest.raises(RotationError, match="8 or more hex digits"):
        new_assignment({"trainer-0": parse_ranges("0")})
    shards = open_shards(shard_set(tmp_path))
    with pytest.raises(ShardError, match=r"shards \[9\] are not in this shard set"):
        SampleCursor(shards, SEQ, assigned={0, 9})


# --- trainers on a real DHT ------------------------------------------------------------------------


def shards_read(trainer: Trainer) -> set[int]:
    return {trainer.cursor.locate(i)[1] for i in trainer.completed_ids}


async def test_trainers_swap_shards_mid_run_and_no_sample_is_read_twice_or_skipped(tmp_path):
    shards = shard_set(tmp_path)
    async with StandInSwarm(RUN, K) as swarm:
        a = swarm.trainer(shards, state_file=str(tmp_path / "a.json"), shard_ranges="0-1")
        b = swarm.trainer(shards, state_file=str(tmp_path / "b.json"), shard_ranges="2-3")
        await a.start()
        training_a = asyncio.ensure_future(a.train())
        await wait_until_async(lambda: a.counters.completed >= 5, what="trainer a under way")
        holding = a.cursor.holding()
        assert len(holding) == 1 and holding[0].shard_id in (0, 1)
        x = holding[0].shard_id
        # someone who is not the operator: ignored; then the operator swaps the two trainers' shards
        stranger = NodeKey.generate()
        await publish_assignment(
            swarm.seed, stranger, RUN.name, new_assignment({a.key.node_id: parse_ranges("3")})
        )
        swap = new_assignment(
            {a.key.node_id: parse_ranges("2-3"), b.key.node_id: parse_ranges("0-1")}, handover_s=0.5
        )
        await publish_assignment(swarm.seed, OPERATOR, RUN.name, swap)
        await wait_until_async(lambda: a.cursor.assigned == {2, 3}, what="a obeys the swap")
        # What it opened of 0-1 until then: x, and on a fast machine perhaps the other one too
        # (a shard of stand-in samples can run out before the record is read, a tick later).
        opened = shards_read(a) | {p.shard_id for p in a.cursor.holding()}
        assert x in opened <= {0, 1}
        assert a.rotation.record.id == swap.id and len(a.rotation.ignored) == 1
        await b.start()
        assert b.cursor.assigned == {0, 1}
        await asyncio.gather(training_a, b.train())
    total = a.cursor.total
    both = a.completed_ids + b.completed_ids
    assert len(both) == total and set(both) == set(range(total))  # every sample once
    assert shards_read(a) == opened | {2, 3}  # what it held read to the end, then its new ones
    assert shards_read(b) == {0, 1} - opened  # what a had not opened
    assert a.metrics.sample_value("agora_trainer_shards_assigned") == 2


@pytest.mark.parametrize("leaving", ["released", "silent"])
async def test_a_gone_trainers_half_read_shard_is_adopted_where_it_stopped(tmp_path, leaving):
    shards = shard_set(tmp_path, shards=3)
    async with StandInSwarm(RUN, K) as swarm:
        first = swarm.trainer(shards, state_file=str(tmp_path / "first.json"))
        await first.start()
        training = asyncio.ensure_future(first.train())
        await wait_until_async(lambda: first.counters.completed >= 20, what="the first trainer under way")
        first.request_stop()
        await training
        (held,) = first.cursor.holding()
        await first.rotation.publish()  # its last claim is exact: shard `held`, half read
        await first.close(release=leaving == "released")  # then it leaves: cleanly, or as a crash would
        swarm.trainers.remove(first)
        second = swarm.trainer(shards, state_file=str(tmp_path / "second.json"), shard_adopt_after_s=2.0)
        await second.start()
        assert second.rotation.others.state(0, held.shard_id)[0] == (
            "stale" if leaving == "released" else "held"
        )
        await second.train()
    total = second.cursor.total
    assert not set(first.completed_ids) & set(second.completed_ids)  # it went on where the first stopped
    assert set(first.completed_ids) | set(second.completed_ids) == set(range(total))
    assert held.shard_id in shards_read(second)
