"""The membership updates a node still has to gossip, least-sent first, in O(taken) a message.

Each update goes out a fixed number of times (the caller's budget) and is then retired. The
queue keeps one insertion-ordered bucket per times-sent count: a message takes from the lowest
buckets, and an update taken moves to the end of the next bucket. A node that has just seen a
mass join holds one pending update per joiner and attaches updates to every probe it sends, so
a scan of the whole queue per message (a heap selection) was the join's largest CPU cost.
"""

from __future__ import annotations


class GossipQueue:
    def __init__(self) -> None:
        self._sent: dict[str, int] = {}  # node id -> times its update was sent
        self._updates: dict[str, list] = {}  # node id -> its wire update
        self._buckets: dict[int, dict[str, None]] = {}  # times sent -> node ids, oldest first

    def __len__(self) -> int:
        return len(self._sent)

    def __bool__(self) -> bool:
        return bool(self._sent)

    def put(self, node_id: str, update: list) -> None:
        """Queue ``update`` as news (sent 0 times), replacing what was pending for the node."""
        self.discard(node_id)
        self._sent[node_id] = 0
        self._updates[node_id] = update
        self._buckets.setdefault(0, {})[node_id] = None

    def discard(self, node_id: str) -> None:
        sent = self._sent.pop(node_id, None)
        if sent is None:
            return
        del self._updates[node_id]
        bucket = self._buckets[sent]
        del bucket[node_id]
        if not bucket:
            del self._buckets[sent]

    def take(self, limit: int, budget: int) -> list[list]:
        """Up to ``limit`` updates, least-sent first; each counts as sent once more and is
        retired once sent ``budget`` times."""
        chosen: list[tuple[str, int]] = []
        for sent in sorted(self._buckets):
            for node_id in self._buckets[sent]:
                if len(chosen) == limit:
                    break
                chosen.append((node_id, sent))
            if len(chosen) == limit:
                break
        updates = []
        for node_id, sent in chosen:
            update = self._updates[node_id]
            updates.append(update)
            self.discard(node_id)
            if sent + 1 < budget:
                self._sent[node_id] = sent + 1
                self._updates[node_id] = update
                self._buckets.setdefault(sent + 1, {})[node_id] = None
        return updates
