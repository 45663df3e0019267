"""Every entry a worker publishes lives the run's ``dht.record_ttl_s``, and refreshes that
could not keep an entry alive through two missed ones are refused up front."""

from __future__ import annotations

import time

import pytest

from agora_core.config.run import DhtConfig
from agora_core.contract import Phase
from agora_core.dht import DhtNode
from agora_core.errors import ConfigError
from agora_core.identity import NodeKey
from agora_core.schema import WorkerAnnouncement, averaging_round_key, stage_progress_key, stage_workers_key
from agora_worker.announce import Announcer
from agora_worker.averaging.matchmaking import Matchmaker, Peer
from agora_worker.progress.tracker import StageProgressTracker

TTL_S = 9.0  # none of the old lifetimes (3 x interval, 10 x interval, 3 x window, ...)


@pytest.fixture
async def dht():
    node = DhtNode(key=NodeKey.generate(), config=DhtConfig(record_ttl_s=TTL_S))
    await node.start()
    yield node
    await node.stop()


def announcer(dht: DhtNode, key: NodeKey, *, interval_s: float = 1.0) -> Announcer:
    def describe() -> WorkerAnnouncement:
        return WorkerAnnouncement(
            node_id=key.node_id,
            address="127.0.0.1:1",
            stage=0,
            phase=Phase.SERVING,
            throughput=0.0,
            load=0,
            max_batch=1,
            version="test",
        )

    return Announcer(
        dht=dht, key=key, run_name="t", stage=0, interval_s=interval_s, ttl_s=TTL_S, describe=describe
    )


def tracker(dht: DhtNode, key: NodeKey, *, interval_s: float = 1.0) -> StageProgressTracker:
    async def take_step() -> None:
        pass

    return StageProgressTracker(
        dht=dht,
        key=key,
        run_name="t",
        stage=0,
        target_batch_size=8,
        interval_s=interval_s,
        ttl_s=TTL_S,
        local=lambda: (0, 3),
        take_step=take_step,
    )


async def lifetime_s(dht: DhtNode, dht_key: str, published_at: float) -> float:
    (entry,) = (await dht.get(dht_key)).values()
    return entry.expiration - published_at


async def test_announcement_progress_and_matchmaking_entries_live_the_record_ttl(dht):
    key = NodeKey.generate()
    now = time.time()
    await announcer(dht, key).announce()
    await tracker(dht, key).publish()
    me = Peer(node_id=key.node_id, address="127.0.0.1:1", weight=1.0, reducer=True, phase=Phase.SERVING)
    matchmaker = Matchmaker(dht=dht, key=key, run_name="t", stage=0, ttl_s=TTL_S)
    group = await matchmaker.form_group(0, me, expected={key.node_id}, window_s=1.0)
    assert group.members == (me,)
    for dht_key in (stage_workers_key("t", 0), stage_progress_key("t", 0), averaging_round_key("t", 0, 0)):
        assert TTL_S <= await lifetime_s(dht, dht_key, now) <= TTL_S + (time.time() - now), dht_key


async def test_a_refresh_interval_over_a_third_of_the_record_ttl_is_refused_naming_the_setting(dht):
    key = NodeKey.generate()
    announcer(dht, key, interval_s=TTL_S / 3)  # exactly a third: survives two missed refreshes
    with pytest.raises(ConfigError, match="record_ttl_s = 9 s") as info:
        announcer(dht, key, interval_s=3.5)
    assert info.value.key == "announce_interval_s"
    with pytest.raises(ConfigError) as info:
        tracker(dht, key, interval_s=4.0)
    assert info.value.key == "progress_interval_s"
