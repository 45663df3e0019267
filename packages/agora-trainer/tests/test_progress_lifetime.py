"""A trainer's progress report lives the run's ``dht.record_ttl_s``; a progress interval too
long to keep it alive through two missed refreshes is refused before anything starts."""

from __future__ import annotations

import time

import pytest

from agora_core.errors import ConfigError
from agora_core.identity import NodeKey
from agora_core.schema import trainer_progress_key
from agora_devkit.runs import tiny_run
from agora_trainer.data.sharding import make_shards
from agora_trainer.data.tokenizer import ByteTokenizer
from agora_trainer.trainer import Trainer, TrainerSettings

RUN = tiny_run(
    "ttl",
    seq_len=16,
    stages=2,
    fast_dht=False,
    dht={"record_ttl_s": 9.0},
    averaging={"matchmaking_window_s": 2.0},
)


@pytest.fixture
def shards(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "doc.txt").write_text("some text to train on " * 50)
    make_shards(tmp_path / "shards", shards=1, tokenizer=ByteTokenizer(), sources=[source])
    return tmp_path / "shards"


async def test_the_progress_report_lives_the_record_ttl(shards):
    trainer = Trainer(run=RUN, shards_dir=shards, key=NodeKey.generate(), settings=TrainerSettings())
    await trainer.node.start()  # no bootstrap: a DHT of its own
    try:
        now = time.time()
        await trainer.publish_progress()
        (entry,) = (await trainer.dht.get(trainer_progress_key(RUN.name))).values()
        assert 9.0 <= entry.expiration - now <= 9.0 + (time.time() - now)
    finally:
        await trainer.node.stop()


def test_a_progress_interval_over_a_third_of_the_record_ttl_is_refused(shards):
    with pytest.raises(ConfigError, match="refresh at most every 3 s") as info:
        Trainer(
            run=RUN,
            shards_dir=shards,
            key=NodeKey.generate(),
            settings=TrainerSettings(progress_interval_s=5),
        )
    assert info.value.key == "progress_interval_s"
