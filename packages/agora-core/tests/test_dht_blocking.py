"""The DHT from plain threads: BlockingDht runs each node on its own event-loop thread."""

from __future__ import annotations

import threading
import time

from agora_core.config.run import DhtConfig
from agora_core.dht import BlockingDht, owned_subkey
from agora_core.identity import NodeKey
from agora_devkit.processes import wait_until

CONFIG = DhtConfig(gossip_period_s=0.2, probe_timeout_s=0.1, suspicion_timeout_s=1.0, op_timeout_s=2.0)


def test_blocking_nodes_serve_callers_on_other_threads():
    key = NodeKey.generate()
    with BlockingDht(key=NodeKey.generate(), config=CONFIG) as seed:
        with BlockingDht(key=key, config=CONFIG, bootstrap=[seed.address]) as other:
            wait_until(lambda: len(seed.members()) == 2, what="the two nodes to meet")
            subkey = owned_subkey(key.public_key)
            assert other.store("stage/0/workers", subkey, {"address": "w"}, time.time() + 30, signer=key) >= 1
            results = []

            def reader():  # several threads at once, none of them the node's loop
                results.append(seed.get("stage/0/workers")[subkey].value)

            threads = [threading.Thread(target=reader) for _ in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=30)
            assert results == [{"address": "w"}] * 4
            other_id = other.node.node_id
        wait_until(lambda: other_id not in {m.node_id for m in seed.members()}, what="the graceful leave")
