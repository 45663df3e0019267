"""Gossip DHT: full membership by SWIM, one-hop replicated storage of signed, expiring records."""

from agora_core.dht.blocking import BlockingDht
from agora_core.dht.membership import Member, Status
from agora_core.dht.node import DhtNode
from agora_core.dht.records import DhtError, Record, RecordRejected, owned_subkey
from agora_core.dht.storage import Validators
from agora_core.dht.values import DhtValue

__all__ = [
    "BlockingDht",
    "DhtError",
    "DhtNode",
    "DhtValue",
    "Member",
    "Record",
    "RecordRejected",
    "Status",
    "Validators",
    "owned_subkey",
]
