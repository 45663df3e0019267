"""Membership traffic of a DHT node: joining, SWIM probes with piggybacked updates, push-pull.

This is the glue between the member table, the failure detector and the RPC layer: the
``dht.join``, ``dht.ping``, ``dht.ping_req``, ``dht.sync`` and ``dht.members`` methods, and the
calls that reach them on other nodes.

What a request carries is checked within a budget: at most ``MAX_CHECKS_PER_REQUEST`` claims
per message have their signatures and credentials checked (a flood of made-up members costs
its sender more than it costs us); replies to this node's own calls are from members it chose.
A ping counts as answered only when the reply comes from the member pinged.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from typing import Any

from agora_core import world
from agora_core.config.run import DhtConfig
from agora_core.contract import Method
from agora_core.dht import member_list
from agora_core.dht.claims import Claims
from agora_core.dht.detector import FailureDetector
from agora_core.dht.membership import Budget, Member, MemberTable, Status, parse_update
from agora_core.dht.records import DhtError
from agora_core.errors import BadRequest, RpcError
from agora_core.observability.logs import get_logger
from agora_core.observability.metrics import NodeMetrics
from agora_core.rpc import Payload, Request, RpcClient, RpcServer

log = get_logger("dht")

MAX_CHECKS_PER_REQUEST = 16  # claims whose signatures one incoming message may have checked
REJOIN_TARGETS = 3  # addresses a cut-off node tries per period
OUTRANKED = "outranked_by"  # a join's answer: what the joiner's id is held at, above its claim


def _outranked_by(reply: Payload) -> Member | None:
    """What a join's answer says this node's id is held at, above its claim (None: joined)."""
    return parse_update(reply.meta.get(OUTRANKED)) if isinstance(reply.meta, dict) else None


class Gossip:
    def __init__(
        self,
        me: Member,
        *,
        config: DhtConfig,
        server: RpcServer,
        client: RpcClient,
        metrics: NodeMetrics,
        rng: random.Random,
        claims: Claims,
        on_change: Callable[[], None],
        on_address: Callable[[Member], None] | None = None,
        on_dead: Callable[[Member], None] | None = None,
    ):
        self.config = config
        self.client = client
        self._rng = rng
        self._cut_off = False  # every other member is dead here: rejoining (rejoin_if_cut_off)
        self.table = MemberTable(
            me,
            claims=claims,
            suspicion_timeout_s=config.suspicion_timeout_s,
            tombstone_s=config.tombstone_s,
            on_change=on_change,
            on_new_member=lambda node_id: self.detector.member_added(node_id),
            on_hint=lambda member: self.detector.probe_now(member),
            on_address=on_address,
            on_dead=on_dead,
        )
        self.detector = FailureDetector(
            self.table,
            period_s=config.gossip_period_s,
            probe_timeout_s=config.probe_timeout_s,
            indirect_probes=config.indirect_probes,
            ping=self.ping,
            ping_through=self.ping_through,
            rng=rng,
        )
        self._m_sent = metrics.counter(
            "agora_dht_gossip_messages_total", "Membership messages sent.", ["kind"]
        )
        # plain functions where the answer is at hand: the server runs them on its receive
        # path, without a task per request
        for method, handler in (
            (Method.DHT_JOIN, self._on_join),
            (Method.DHT_PING, self._on_ping),
            (Method.DHT_PING_REQ, self._on_ping_req),
            (Method.DHT_SYNC, self._on_sync),
            (Method.DHT_MEMBERS, self._on_members),
        ):
            server.register(method, handler)

    async def spread(self) -> None:
        """While there is news, push it to ``gossip_fanout`` random members twice a period:
        news then reaches everyone in about log_4(N) half periods instead of riding only on
        the probes. Quiet swarms send nothing extra."""
        interval = self.config.gossip_period_s / 2
        while True:
            if not self.table.pending_gossip:  # quiet: no timer at all until news comes
                self.table.news.clear()
                await self.table.news.wait()
            await asyncio.sleep(interval)
            others = self.table.others() if self.table.pending_gossip else None
            if others:
                targets = self._rng.sample(others, min(self.config.gossip_fanout, len(others)))
                await asyncio.gather(*(self.ping(m, interval) for m in targets))

    def connection_lost(self, address: str) -> None:
        """A hint from the RPC client: probe the member at ``address`` now."""
        for member in self.table.others():
            if member.address == address:
                self.detector.probe_now(member)
                return

    async def leave(self) -> None:
        """Announce our departure directly to a few members, then let gossip carry it."""
        self.table.leave()
        others = self.table.others()
        targets = self._rng.sample(others, min(len(others), max(3, self.config.indirect_probes)))
        await asyncio.gather(*(self.ping(m, self.config.probe_timeout_s * 2) for m in targets))

    async def join(self, bootstrap: Sequence[str]) -> None:
        """Get the member list from the first bootstrap address that answers."""
        targets = [a for a in bootstrap if a != self.table.me.address]
        if not targets:
            return  # the first node of a swarm
        deadline = world.monotonic() + self.config.join_timeout_s
        errors: dict[str, str] = {}
        while world.monotonic() < deadline:
            if await self._join_once(targets, self.config.op_timeout_s, errors):
                return
            await asyncio.sleep(min(self.config.gossip_period_s, max(0.0, deadline - world.monotonic())))
        raise DhtError(f"could not join through any of {targets}: {errors}")

    async def _join_once(self, targets: Sequence[str], timeout_s: float, errors: dict[str, str]) -> bool:
        """Ask each of ``targets`` in turn for the member list; True once one answered."""
        for address in targets:
            try:
                reply = await self._ask_to_join(address, timeout_s)
                held = _outranked_by(reply)
                if held is not None and self.table.outrank(held):  # a previous life's: claim above it
                    reply = await self._ask_to_join(address, timeout_s)
                    held = _outranked_by(reply)
            except RpcError as exc:
                errors[address] = str(exc)
                continue
            if held is not None:
                errors[address] = f"this node's id is held at incarnation {held.incarnation}, above its claim"
                continue
            self.table.apply_all(member_list.unpack(reply.meta, reply.tensors), limit=member_list.MAX_LISTED)
            return True
        return False

    async def _ask_to_join(self, address: str, timeout_s: float) -> Payload:
        return await self.client.call(
            address, Method.DHT_JOIN, {"member": self.table.me.to_wire()}, timeout_s=timeout_s
        )

    async def heal(self, bootstrap: Sequence[str]) -> None:
        """Every period, rejoin if this node was cut off (:meth:`rejoin_if_cut_off`), else
        revisit a few of the members it holds dead (:meth:`revisit_dead`). On a task of its
        own: the maintenance loop can sit out a 5 s call to a member whose link just went (a
        sync), and a node back from a cut should not wait for it."""
        while True:
            await asyncio.sleep(self.config.gossip_period_s)
            try:
                if await self.rejoin_if_cut_off(bootstrap):
                    log.info("dht_rejoined", node=self.table.me.node_id[:12], members=len(self.table.live()))
                elif self.table.others():
                    await self.revisit_dead()
            except Exception:  # healing must outlive any one bad attempt
                log.exception("dht_rejoin_failed", node=self.table.me.node_id[:12])

    async def revisit_dead(self) -> int:
        """Ping up to ``gossip_fanout`` members held dead (not those that left), telling each
        so; returns how many answered. A member wrongly declared dead (its link, or this
        node's, dropped for a while) refutes in its reply and is alive here at once. Without
        this, nobody probes the dead: a trainer whose own link dropped would hold its workers
        dead until their tombstones expire (``tombstone_s``), though they never left."""
        dead = self.table.dead()
        if not dead:
            return 0
        chosen = self._rng.sample(dead, min(len(dead), self.config.gossip_fanout))
        answers = await asyncio.gather(*(self.ping(m, self.config.probe_timeout_s) for m in chosen))
        return sum(answers)

    async def rejoin_if_cut_off(self, bootstrap: Sequence[str]) -> bool:
        """Rejoin when every other member is dead in this node's eyes: it was cut off (its link
        dropped for longer than the suspicion timeout), the others declared it dead too, and
        since nobody probes the dead, neither side would ever look again. Its verdicts become
        hearsay, it claims again above the incarnation they hold it dead at, and joins through
        its bootstrap addresses or the dead members' own. True once it is back."""
        if self.table.leaving or self.table.others():
            self._cut_off = False
            return False
        dead = self.table.doubt_own_verdicts()
        me = self.table.me.address
        targets = [a for a in dict.fromkeys([*bootstrap, *(m.address for m in dead)]) if a != me]
        if not targets:
            return False  # alone from the start: the first node of a swarm
        if not self._cut_off:
            self._cut_off = True
            self.table.reclaim()
        timeout_s = min(self.config.op_timeout_s, 4 * self.config.probe_timeout_s)
        return await self._join_once(targets[:REJOIN_TARGETS], timeout_s, {})

    def _meta(self, to: Member | None = None) -> dict:
        updates = self.table.piggyback(self.config.piggyback_updates)
        if to is not None and to.status in (Status.SUSPECT, Status.DEAD):
            updates.append(to.to_wire())  # tell a suspect (or the dead, revisited) so: it can refute
        return {"from": self.table.me.to_wire(), "updates": updates}

    def _absorb(self, meta: Any, budget: Budget | None = None) -> Member | None:
        """Merge a message's sender and updates; returns the sender's update, if well formed."""
        if not isinstance(meta, dict):
            return None
        sender = parse_update(meta.get("from"))
        if sender is not None:
            self.table.apply(sender, budget=budget)
        self.table.apply_all(meta.get("updates"), budget=budget)
        return sender

    def introduce(self, raw: Any) -> None:
        """Merge the claim of a request's sender (say, a store from a node that just joined)."""
        update = parse_update(raw)
        if update is not None:
            self.table.apply(update, budget=Budget(1))

    @staticmethod
    def _request_budget() -> Budget:
        return Budget(MAX_CHECKS_PER_REQUEST)

    async def ping(self, member: Member, timeout_s: float) -> bool:
        self._m_sent.labels(kind="ping").inc()
        try:
            reply = await self.client.call(
                member.address, Method.DHT_PING, self._meta(member), timeout_s=timeout_s
            )
        except RpcError:
            return False
        sender = self._absorb(reply.meta)
        return sender is not None and sender.node_id == member.node_id  # not whoever took the address

    async def ping_through(self, helper: Member, target: Member, timeout_s: float) -> bool:
        self._m_sent.labels(kind="ping_req").inc()
        meta = {**self._meta(), "target": target.to_wire()}
        try:
            reply = await self.client.call(helper.address, Method.DHT_PING_REQ, meta, timeout_s=timeout_s)
        except RpcError:
            return False
        self._absorb(reply.meta)
        return bool(reply.meta.get("ok")) if isinstance(reply.meta, dict) else False

    def _snapshot(self) -> dict:
        """Every member this node knows of, tombstones included, as a payload's tensors."""
        return member_list.pack(self.table.snapshot())

    def _on_join(self, request: Request) -> Payload:
        joiner = parse_update(request.meta.get("member") if isinstance(request.meta, dict) else None)
        if joiner is None or joiner.status != Status.ALIVE:
            raise BadRequest(
                "join needs {'member': [id, address, public key, incarnation, 0, signature, credential]}"
            )
        self.table.apply(joiner, budget=self._request_budget())
        known = self.table.get(joiner.node_id)
        if known is None or known.incarnation < joiner.incarnation:  # the claim was not taken
            raise BadRequest("join refused: the member's signed claim or its credential does not verify")
        if known.incarnation > joiner.incarnation or known.status != Status.ALIVE:
            # Held (alive, dead or left) at an incarnation its claim does not outrank: a previous
            # life whose clock ran ahead of this one's. Its own signed claim says which, and the
            # joiner claims above it.
            return Payload({OUTRANKED: known.to_wire()})
        return Payload({}, self._snapshot())

    def _reply(self, **fields: Any) -> Payload:
        return Payload(
            {
                "from": self.table.me.to_wire(),
                "updates": self.table.piggyback(self.config.piggyback_updates),
                **fields,
            }
        )

    def _on_ping(self, request: Request) -> Payload:
        self._absorb(request.meta, self._request_budget())
        return self._reply()

    async def _on_ping_req(self, request: Request) -> Payload:
        self._absorb(request.meta, self._request_budget())
        wanted = parse_update(request.meta.get("target") if isinstance(request.meta, dict) else None)
        if wanted is None:
            raise BadRequest("ping_req needs a 'target' member")
        target = self.table.get(wanted.node_id)  # pinged where its own claim says, not the asker
        timeout_s = min(request.remaining_s * 0.9, self.config.probe_timeout_s)
        ok = target is not None and target is not self.table.me and timeout_s > 0
        ok = ok and await self.ping(target, timeout_s)
        return self._reply(ok=ok)

    def _on_sync(self, request: Request) -> Payload:
        meta = request.meta if isinstance(request.meta, dict) else {}
        listed = member_list.unpack(meta, request.tensors)
        self.table.apply_all(listed, budget=self._request_budget(), limit=member_list.MAX_LISTED)
        digest = self.table.digest()
        if meta.get("digest") == digest:
            return Payload({"digest": digest})
        return Payload({"digest": digest}, self._snapshot())

    async def sync(self) -> None:
        """Push-pull with one random member; only digests travel when both agree."""
        others = self.table.others()
        if not others:
            return
        peer = self._rng.choice(others)
        self._m_sent.labels(kind="sync").inc()
        try:
            reply = await self.client.call(
                peer.address,
                Method.DHT_SYNC,
                {"digest": self.table.digest()},
                timeout_s=self.config.op_timeout_s,
            )
            meta = reply.meta if isinstance(reply.meta, dict) else {}
            listed = member_list.unpack(meta, reply.tensors)
            if listed is not None:
                self.table.apply_all(listed, limit=member_list.MAX_LISTED)
                if meta.get("digest") != self.table.digest():
                    await self.client.call(
                        peer.address,
                        Method.DHT_SYNC,
                        {},
                        self._snapshot(),
                        timeout_s=self.config.op_timeout_s,
                    )
        except RpcError:
            pass

    def _on_members(self, request: Request) -> Payload:
        live = [m.to_wire() for m in self.table.live()]
        return Payload({"digest": self.table.digest()}, member_list.pack(live))
