"""Judging accusations: a node accused by enough independent accusers is banned and revoked.

Workers that keep clipping a peer's averaging contributions, and trainers whose spot checks
caught a worker's output standing apart, accuse it in the DHT
(:mod:`agora_core.admission.accusations`). :class:`AccusationJudge` reads those entries every
few seconds, records every accusation in the database (the operator lists them with
``agora-authorizer accusations``), and counts each accused node's *independent accusers*:

* the accuser holds a live, unrevoked credential of the role that sees what it accuses of:
  a worker on the stage of the accused's newest credential for averaging, a trainer for
  compute (an accused that holds no stage is not judged);
* it counts once per account: many nodes of one account are one accuser, and an account
  does not accuse its own nodes; except that every node of an anchor account (the run's
  ``admission.anchor_accounts``: the operator's own) counts on its own, against any node;
* its accusation was made after the accused's latest pardon (``agora-authorizer pardon``).

At ``admission.revoke_after_accusers`` of them (0: never) the node is banned, its
credentials revoked, and the revocation list republished at once, so the accused is dropped
by its peers within seconds. One account, however many nodes it runs, never bans anyone;
except the operator's own trainers: with ``admission.revoke_on_anchor_spot_check``, one
anchor trainer's spot-check accusation is enough.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from agora_authorizer.revocation_publisher import RevocationPublisher
from agora_authorizer.store import Docket, IssuedCredential, RecordedAccusation, Store
from agora_core import world
from agora_core.admission.accusations import TRAINER_KINDS, accusations_key, parse_accusations
from agora_core.config import RunConfig
from agora_core.dht import DhtNode
from agora_core.errors import AgoraError
from agora_core.observability.logs import get_logger
from agora_core.observability.metrics import NodeMetrics

log = get_logger("authorizer.accusations")
MAX_PERIOD_S = 5.0  # a revocation follows the accusations that earn it within about this long


def discount(
    accusation: RecordedAccusation,
    credentials: Mapping[str, IssuedCredential],
    pardons: Mapping[str, float],
    *,
    anchors: Collection[str],
    now: float,
) -> str | None:
    """Why ``accusation`` does not count against its accused; None when it does.
    ``credentials``: the newest credential of each node; ``pardons``: each node's latest."""
    accused = credentials.get(accusation.accused)
    if accused is None or accused.stage is None:
        return "the accused holds no credential for a stage"
    accuser = credentials.get(accusation.accuser)
    if accuser is None or not accuser.live(now):
        return "the accuser holds no live credential"
    if accusation.kind in TRAINER_KINDS:
        if accuser.role != "trainer":
            return f"only a trainer spot-checks compute; the accuser is a {accuser.role}"
    elif accuser.role != "worker" or accuser.stage != accused.stage:
        return f"the accuser serves stage {accuser.stage}, the accused stage {accused.stage}"
    if accuser.account == accused.account and accuser.account not in anchors:
        return f"the accuser is of the accused's own account {accused.account!r}"
    pardoned = pardons.get(accusation.accused)
    if pardoned is not None and accusation.made <= pardoned:
        return "made before the accused was pardoned"
    return None


def witness(credential: IssuedCredential, anchors: Collection[str]) -> str:
    """Who an accuser counts as: its account, or itself in an anchor account."""
    if credential.account in anchors:
        return f"{credential.account}/{credential.node_id}"
    return credential.account


@dataclass
class Charge:
    """The counted accusations against one node."""

    accused: str
    stage: int
    account: str  # the accused's
    witnesses: set[str] = field(default_factory=set)  # independent accusers (see witness())
    accusers: set[str] = field(default_factory=set)  # their node ids
    kinds: set[str] = field(default_factory=set)
    anchor_checked: bool = False  # an anchor trainer's spot checks accuse it

    def convicts(self, revoke_after: int, *, anchor_checks: bool) -> bool:
        """Whether the charge bans its node, ``revoke_after`` (0: never) independent accusers
        needed, or one anchor trainer's spot checks where ``anchor_checks``."""
        if revoke_after <= 0:
            return False
        return len(self.witnesses) >= revoke_after or (anchor_checks and self.anchor_checked)

    def named(self) -> list[str]:
        """The independent accusers for people to read: an anchor's node by its id's first 12
        digits (so that the accused is the only node a ban's log line names in full)."""
        return sorted(w if "/" not in w else w[: w.index("/") + 13] for w in self.witnesses)

    def reason(self) -> str:
        """The ban's reason: the kinds and the independent accusers."""
        return (
            f"accused of {', '.join(sorted(self.kinds))} by {len(self.witnesses)} independent "
            f"accusers ({', '.join(self.named())})"
        )


def charges(docket: Docket, *, anchors: Collection[str], now: float) -> dict[str, Charge]:
    """Accused node id -> the accusations that count against it (nodes none counts against
    are left out)."""
    found: dict[str, Charge] = {}
    credentials = docket.credentials
    for accusation in docket.accusations:
        if discount(accusation, credentials, docket.pardons, anchors=anchors, now=now) is not None:
            continue
        accused, accuser = credentials[accusation.accused], credentials[accusation.accuser]
        charge = found.get(accusation.accused)
        if charge is None:
            charge = found[accusation.accused] = Charge(accusation.accused, accused.stage, accused.account)
        charge.witnesses.add(witness(accuser, anchors))
        charge.accusers.add(accusation.accuser)
        charge.kinds.add(accusation.kind)
        if accusation.kind in TRAINER_KINDS and accuser.account in anchors:
            charge.anchor_checked = True
    return found


class AccusationJudge:
    """Reads ``<run>/accusations`` every :attr:`period_s`, records it, bans whom it convicts."""

    def __init__(
        self,
        *,
        run: RunConfig,
        store: Store,
        dht: DhtNode,
        db: Callable[..., Awaitable[Any]],
        revocations: RevocationPublisher,
        metrics: NodeMetrics,
    ):
        self.store = store
        self.dht = dht
        self.db = db
        self.revocations = revocations
        self.key = accusations_key(run.name)
        self.revoke_after = run.admission.revoke_after_accusers  # 0: never
        self.anchors = frozenset(run.admission.anchor_accounts)
        self.anchor_checks = run.admission.revoke_on_anchor_spot_check
        self.period_s = min(revocations.period_s, MAX_PERIOD_S)
        self._m_recorded = metrics.counter(
            "agora_authorizer_accusations_total", "Accusations recorded (accuser, accused, kind).", ["kind"]
        )
        self._m_revoked = metrics.counter(
            "agora_authorizer_accusation_revocations_total", "Nodes banned on independent accusations."
        )
        self._m_accused = metrics.gauge(
            "agora_authorizer_accused_nodes", "Unbanned nodes with at least one independent accuser."
        )

    async def judge(self) -> list[Charge]:
        """One period: read, record, count, ban. Returns the charges that banned a node."""
        records = parse_accusations(await self.dht.get(self.key))
        now = world.wall()
        if records:
            for new in await self.db(self.store.record_accusations, records, now=now):
                self._m_recorded.labels(kind=new.kind).inc()
                log.info(
                    "accusation_recorded",
                    accuser=new.accuser[:12],
                    accused=new.accused[:12],
                    kind=new.kind,
                    rounds=new.rounds,
                )
        docket = await self.db(self.store.docket, live_at=now)
        found = charges(docket, anchors=self.anchors, now=now)
        self._m_accused.set(len(found))
        convicted = []
        for charge in sorted(found.values(), key=lambda c: c.accused):
            if charge.convicts(self.revoke_after, anchor_checks=self.anchor_checks) and await self._ban(
                charge, docket
            ):
                convicted.append(charge)
        if convicted:
            await self.revocations.publish()  # at once: its peers drop it within a DHT read
        return convicted

    async def _ban(self, charge: Charge, docket: Docket) -> bool:
        pardoned = docket.pardons.get(charge.accused)
        revoked = await self.db(
            self.store.ban_accused,
            charge.accused,
            reason=charge.reason(),
            pardoned=pardoned,
            now=world.wall(),
        )
        if revoked is None:  # banned, or pardoned, since the docket was read
            return False
        self._m_revoked.inc()
        log.warning(
            "node_revoked_by_accusations",
            node=charge.accused,
            stage=charge.stage,
            account=charge.account,
            accusers=len(charge.witnesses),
            witnesses=charge.named(),
            kinds=sorted(charge.kinds),
            credentials_revoked=revoked,
        )
        return True

    async def run(self) -> None:
        while True:
            try:
                await self.judge()
            except AgoraError as exc:  # no DHT replica or no database right now: next period
                log.warning("accusations_judge_failed", error=str(exc))
            except Exception:  # a bug: said loudly, and the judge goes on
                log.exception("accusations_judge_error")
            await asyncio.sleep(self.period_s)
