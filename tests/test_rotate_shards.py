"""tools/rotate_shards.py against a live trainer: set, show and clear through the run's DHT.

A seed DHT node, two stand-in stages and a trainer run in this process on 127.0.0.1; the tool
runs as its own process, as an operator would run it, knowing only a bootstrap address, the
run config and its key.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from agora_core.config import load_run_config
from agora_core.identity import NodeKey
from agora_devkit.processes import wait_until_async
from agora_devkit.runs import tiny_run_toml
from agora_devkit.trainer import StandInSwarm
from agora_trainer.data.sharding import make_shards
from agora_trainer.data.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "rotate_shards.py"


def config_text(operator: str) -> str:
    """The run: its operator key, whose orders the trainer obeys."""
    return tiny_run_toml(
        "rotate-tool", stages=2, dht={"op_timeout_s": 2.0}, operator={"public_keys": [operator]}
    )


async def tool(*args: str, seed: str, config: Path, key: Path, code: int = 0) -> str:
    """Run the tool (off the event loop, which serves the seed it talks to); its stdout, or
    its stderr where it is expected to fail with ``code``."""
    command = [
        sys.executable,
        str(TOOL),
        "--bootstrap",
        seed,
        "--config",
        str(config),
        "--key",
        str(key),
        *args,
    ]
    done = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stderr
    return done.stdout if code == 0 else done.stderr


async def test_the_operator_moves_a_live_trainers_shards_shows_them_and_clears_the_order(tmp_path):
    operator_key = tmp_path / "operator.key"
    operator = NodeKey.load_or_create(operator_key)
    config = tmp_path / "run.toml"
    config.write_text(config_text(operator.public_key.hex()))
    run = load_run_config(config)
    make_shards(tmp_path / "shards", shards=4, tokenizer=ByteTokenizer(), sources=[Path(__file__)])
    async with StandInSwarm(run, 4) as swarm:
        trainer = swarm.trainer(tmp_path / "shards", lanes=1, shard_ranges="0-1")
        given = dict(seed=swarm.seed.address, config=config, key=operator_key)
        await trainer.start()
        assert trainer.cursor.assigned == {0, 1}
        out = await tool(
            "set", "--trainer", f"{trainer.key.node_id[:12]}=2-3", "--others", "0", "--handover", "0", **given
        )
        assert out.startswith("id shards-") and f"{trainer.key.node_id[:12]}=2-3 others=0" in out
        await wait_until_async(lambda: trainer.cursor.assigned == {2, 3}, what="the trainer obeys the tool")
        shown = await tool("show", **given)
        record_id = out.split()[1]
        assert f"{record_id}  " in shown and "(in force)" in shown
        assert f"epoch 0  trainer {trainer.key.node_id[:12]}" in shown  # its claim, read back
        cleared = await tool("clear", **given)
        assert "every trainer back to its own --shard-ranges" in cleared and record_id in cleared
        await wait_until_async(lambda: trainer.cursor.assigned == {0, 1}, what="back to its own ranges")
        refused = await tool("set", "--trainer", "nothex=0", code=2, **given)
        assert "8 or more hex digits" in refused
