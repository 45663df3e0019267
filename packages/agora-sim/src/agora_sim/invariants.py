"""What must hold after a simulated DHT has lived through its scenario and settled.

* membership: every live member counts exactly the live members (checked by the run's settle);
* records: every value stored with an acknowledgement, while one of the live members still
  holds it, is readable from any live member;
* bounded memory: no member's table holds more members than ever existed, and no record store
  holds more records than were ever written.
"""

from __future__ import annotations

import random

from agora_core import world
from agora_sim.dht_swarm import SimDhtSwarm


def check_records(swarm: SimDhtSwarm, stored: list[str], rng: random.Random) -> list[str]:
    violations = []
    live = swarm.live_nodes()
    for key in stored:
        holders = [n for n in live if "v" in n.records.get(key, now=world.wall())]
        if not holders:
            continue  # every replica died: lost with them, as the replication factor allows
        reader = rng.choice(live)
        values = swarm.sim.run(swarm.on(reader, lambda reader=reader, key=key: reader.get(key)))
        if "v" not in values:
            violations.append(
                f"{key}: held by {len(holders)} live member(s) (e.g. {holders[0].node_id[:8]}), "
                f"a read from {reader.node_id[:8]} missed it"
            )
    return violations


def check_bounds(swarm: SimDhtSwarm, stored: list[str]) -> list[str]:
    violations = []
    ever = len(swarm.nodes)
    for node in swarm.live_nodes():
        if len(node.table.known()) > ever:
            violations.append(
                f"{node.node_id[:8]} knows {len(node.table.known())} members of {ever} that ever existed"
            )
        if len(node.records) > len(stored) + ever:  # the values, plus whatever the nodes themselves wrote
            violations.append(
                f"{node.node_id[:8]} holds {len(node.records)} records of {len(stored)} written"
            )
    return violations
