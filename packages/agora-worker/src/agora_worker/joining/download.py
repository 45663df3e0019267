"""The joiner side of state transfer: download a stage's state from several donors at once.

Each donor's manifest lists its snapshot's tensors and their digests. A tensor is fetched in
pieces (byte ranges) from every donor whose snapshot holds the same bytes for it (equal
digests: untrained tensors, or replicas that have not diverged), otherwise whole from one
donor, spread so that every donor carries a similar share. Each donor keeps
``pieces_in_flight`` requests outstanding, so a link stays busy across its round trip.

A weight's AdamW state (``adam/<name>/exp_avg``, ``exp_avg_sq`` and ``step``) is one bundle:
its three tensors come from donors that agree on all three, one replica's moments. Replicas
average their weights but never their moments, so one replica's first moment over another's
second is no state AdamW could reach: where the second replica's variance is small (a token
its recent batches lacked) the update m / sqrt(v) is many times the learning rate, and the
joiner's first applied step with such moments can wreck its replica.

When a donor fails (an error, or no answer within ``piece_timeout_s``) it is dropped and its
outstanding pieces go back to the queue: another donor with the same digest carries on where
it stopped; a tensor no remaining donor holds identically starts over from a donor that has
it. Finished tensors are never fetched again. A finished tensor whose bytes do not hash to
the digest announced for it is fetched again, whole from one donor at a time, and a donor
whose bytes alone failed the digest is not asked for that tensor again.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from agora_core import world
from agora_core.config.lifecycle import JoinConfig
from agora_core.contract import Method
from agora_core.errors import AgoraError, RpcError
from agora_core.injection import NO_INJECTIONS, InjectionPoints, Trigger
from agora_core.observability.logs import get_logger
from agora_core.rpc import RpcClient
from agora_worker.state.snapshot import PARAM_PREFIX, StateSnapshot, TensorSpec, tensor_digest

log = get_logger("worker.download")


class StateDownloadFailed(AgoraError):
    """No donor could supply the stage's state (all failed, or none held a needed tensor)."""


@dataclass(frozen=True)
class DownloadProgress:
    done_bytes: int
    total_bytes: int
    elapsed_s: float
    donors: int  # donors still in use

    @property
    def rate_bytes_per_s(self) -> float:
        return self.done_bytes / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        rate = self.rate_bytes_per_s
        return (self.total_bytes - self.done_bytes) / rate if rate > 0 else None


@dataclass
class Donor:
    address: str
    node_id: str
    snapshot: str
    step: int
    specs: dict[str, TensorSpec]
    digests: dict[str, bytes]
    alive: bool = True
    assigned_bytes: int = 0  # of tensors only it serves: balances the whole-tensor choice
    fetched_bytes: int = 0


def bundle_of(name: str) -> str:
    """The bundle a tensor is fetched with: a weight's AdamW state together, others alone."""
    if name.startswith("adam/"):
        return name.rsplit("/", 1)[0]
    return name


@dataclass(eq=False)
class _Job:
    """One tensor: its pieces, who may serve them, and what arrived."""

    spec: TensorSpec
    piece_bytes: int
    bundle: str = ""
    digest: bytes = b""
    donors: list[Donor] = field(default_factory=list)
    refused: set[str] = field(default_factory=set)  # donors whose bytes failed the digest
    one_donor: bool = False  # a mixed try failed its digest: one donor at a time finds the culprit
    buffer: np.ndarray | None = None
    pending: collections.deque[int] = field(default_factory=collections.deque)
    in_flight: dict[int, Donor] = field(default_factory=dict)
    sources: set[str] = field(default_factory=set)  # donors that sent pieces of this try
    arrived: int = 0
    verified: bool = False

    @property
    def pieces(self) -> int:
        return max(1, -(-self.spec.nbytes // self.piece_bytes))

    def restart(self, digest: bytes, donors: list[Donor]) -> None:
        self.digest, self.donors = digest, donors
        self.buffer = np.empty(self.spec.nbytes, dtype=np.uint8)
        self.pending = collections.deque(range(self.pieces))
        self.in_flight.clear()
        self.sources.clear()
        self.arrived = 0

    def piece_range(self, index: int) -> tuple[int, int]:
        start = index * self.piece_bytes
        return start, min(self.piece_bytes, self.spec.nbytes - start)


async def read_manifest(
    client: RpcClient, address: str, *, timeout_s: float, weights_only: bool = False
) -> Donor:
    """Ask ``address`` for a snapshot (of its weights alone, with ``weights_only``); raises
    RpcError or AgoraError for a bad answer."""
    meta = {"weights_only": True} if weights_only else None
    reply = await client.call(address, Method.STATE_MANIFEST, meta, timeout_s=timeout_s)
    meta = reply.meta if isinstance(reply.meta, dict) else {}
    entries, digests = meta.get("tensors"), reply.tensors.get("digests")
    if (
        not isinstance(entries, list)
        or not isinstance(digests, np.ndarray)
        or digests.shape != (len(entries), 32)
    ):
        raise StateDownloadFailed(f"{address} sent a malformed manifest")
    specs, by_name = {}, {}
    for (name, dtype, shape), digest in zip(entries, digests, strict=True):
        specs[name] = TensorSpec(str(name), str(dtype), tuple(int(d) for d in shape))
        by_name[name] = bytes(digest)
    return Donor(
        address=address,
        node_id=str(meta.get("node_id", "")),
        snapshot=str(meta.get("snapshot", "")),
        step=int(meta.get("step", 0)),
        specs=specs,
        digests=by_name,
    )


class StateDownload:
    """One download; ``run()`` returns the assembled snapshot."""

    def __init__(
        self,
        client: RpcClient,
        donors: list[Donor],
        *,
        expected: Mapping[str, TensorSpec],
        required: set[str],
        config: JoinConfig,
        on_progress: Callable[[DownloadProgress], None] | None = None,
        progress_interval_s: float = 1.0,
        injections: InjectionPoints = NO_INJECTIONS,
    ):
        """``injections``: the operator's mid-download trigger fires as a piece is requested."""
        self._client = client
        self._injections = injections
        self._config = config
        self._on_progress = on_progress
        self._progress_interval_s = progress_interval_s
        self.donors = [d for d in donors if _compatible(d, expected, required)]
        if not self.donors:
            raise StateDownloadFailed("no donor's snapshot fits this stage")
        names = sorted({n for d in self.donors for n in d.specs if n in expected})
        self._jobs = {
            n: _Job(spec=expected[n], piece_bytes=config.piece_bytes, bundle=bundle_of(n)) for n in names
        }
        self._bundles: dict[str, list[_Job]] = collections.defaultdict(list)
        for job in self._jobs.values():
            self._bundles[job.bundle].append(job)
        self.total_bytes = sum(job.spec.nbytes for job in self._jobs.values())
        self._changed = asyncio.Event()
        self._started = world.monotonic()
        self.failed_pieces = 0
        self.refetched_tensors = 0
        self.pieces_arrived = 0  # of every try, for the download trigger's count
        for job in self._jobs.values():
            self._plan(job)
        self._pieces = sum(job.pieces for job in self._jobs.values())

    # --- planning -----------------------------------------------------------------------------

    def _plan(self, job: _Job) -> None:
        """Choose the digest (and so the donors) to fetch ``job`` from: the one most living
        donors agree on; among equals, the one whose donors carry the least so far. Within a
        bundle, only donors that hold the same bytes as the bundle's tensors already chosen;
        when no living donor does, the whole bundle starts over from the donors that best hold
        all of it (tensors already fetched from them are kept)."""
        bundle = self._bundles[job.bundle]
        groups = self._groups(bundle, job)
        if not groups:
            raise StateDownloadFailed(f"no living donor can supply {job.spec.name}")
        chosen = [(i, j.digest) for i, j in enumerate(bundle) if j is not job and j.digest]
        fitting = {k: m for k, m in groups.items() if all(k[i] == d for i, d in chosen)}
        key, members = min(
            (fitting or groups).items(),
            key=lambda g: (-len(g[1]), min(d.assigned_bytes for d in g[1]), -max(d.step for d in g[1])),
        )
        for i, each in enumerate(bundle):
            if each is not job and (fitting or each.digest == key[i]):
                continue
            each.verified = False
            group = [min(members, key=lambda d: d.assigned_bytes)] if each.one_donor else members
            if len(group) == 1:
                group[0].assigned_bytes += each.spec.nbytes
            each.restart(key[i], group)
            if each.spec.nbytes == 0:
                self._finish(each)

    def _groups(self, bundle: list[_Job], job: _Job) -> dict[tuple[bytes, ...], list[Donor]]:
        """Living donors that hold every tensor of ``bundle``, grouped by their digests for
        them (in the bundle's order); a donor whose bytes failed ``job``'s digest is left out."""
        names = [j.spec.name for j in bundle]
        groups: dict[tuple[bytes, ...], list[Donor]] = collections.defaultdict(list)
        for donor in self.donors:
            if not donor.alive or donor.node_id in job.refused or any(n not in donor.specs for n in names):
                continue
            groups[tuple(donor.digests[n] for n in names)].append(donor)
        return groups

    def _next_piece(self, donor: Donor) -> tuple[_Job, int] | None:
        for job in self._jobs.values():
            if job.pending and donor in job.donors:
                return job, job.pending.popleft()
        return None

    # --- fetching -----------------------------------------------------------------------------

    async def _fetcher(self, donor: Donor) -> None:
        while donor.alive and not self.complete:
            picked = self._next_piece(donor)
            if picked is None:  # until a piece comes back to the queue, or a tensor is replanned
                self._changed.clear()
                await self._changed.wait()
                continue
            job, index = picked
            if self._injections.armed:
                self._injections.reached(Trigger.DOWNLOAD, index=self.pieces_arrived, count=self._pieces)
            job.in_flight[index] = donor
            start, length = job.piece_range(index)
            try:
                reply = await self._client.call(
                    donor.address,
                    Method.STATE_FETCH,
                    {"snapshot": donor.snapshot, "name": job.spec.name, "offset": start, "length": length},
                    timeout_s=self._config.piece_timeout_s,
                )
                data = reply.tensors.get("data")
                if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.nbytes != length:
                    raise StateDownloadFailed(f"{donor.address} sent a malformed piece of {job.spec.name}")
            except (RpcError, StateDownloadFailed) as exc:
                self._drop(donor, f"{type(exc).__name__}: {exc}")
                return
            if job.in_flight.get(index) is not donor:
                continue  # the job restarted meanwhile: these bytes belong to an older try
            del job.in_flight[index]
            job.buffer[start : start + length] = data
            job.arrived += 1
            self.pieces_arrived += 1
            job.sources.add(donor.node_id)
            donor.fetched_bytes += length
            if job.arrived == job.pieces:
                await self._verify(job)

    async def _verify(self, job: _Job) -> None:
        buffer = job.buffer
        big = buffer.nbytes > (1 << 20)
        actual = await world.offload(tensor_digest, buffer) if big else tensor_digest(buffer)
        if bytes.fromhex(actual) == job.digest:
            self._finish(job)
            return
        log.warning("state_digest_mismatch", tensor=job.spec.name, donors=sorted(job.sources))
        self.refetched_tensors += 1
        if len(job.sources) == 1:
            job.refused |= job.sources
        job.one_donor = True
        self._plan(job)  # raises when nobody else has it
        self._changed.set()

    def _finish(self, job: _Job) -> None:
        job.verified = True
        job.pending.clear()
        self._changed.set()

    def _drop(self, donor: Donor, why: str) -> None:
        if not donor.alive:
            return
        donor.alive = False
        log.warning("state_donor_dropped", donor=donor.address, error=why[:300])
        for job in self._jobs.values():
            if job.verified or job.arrived == job.pieces:  # done, or its digest being checked
                continue
            returned = [i for i, d in job.in_flight.items() if d is donor]
            for index in returned:
                del job.in_flight[index]
                job.pending.appendleft(index)
                self.failed_pieces += 1
            if donor in job.donors:
                job.donors = [d for d in job.donors if d is not donor]
                if not job.donors:
                    self._plan(job)  # bytes of this try came from a snapshot nobody else holds
        self._changed.set()

    @property
    def complete(self) -> bool:
        return all(job.verified for job in self._jobs.values())

    @property
    def done_bytes(self) -> int:
        done = 0
        for job in self._jobs.values():
            done += job.spec.nbytes if job.verified else job.arrived * job.piece_bytes
        return min(done, self.total_bytes)

    def progress(self) -> DownloadProgress:
        alive = sum(d.alive for d in self.donors)
        return DownloadProgress(self.done_bytes, self.total_bytes, world.monotonic() - self._started, alive)

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(self._progress_interval_s)
            if self._on_progress is not None:
                self._on_progress(self.progress())

    async def run(self) -> StateSnapshot:
        """Fetch everything; raises StateDownloadFailed when the donors run out."""
        self._started = world.monotonic()
        reporter = asyncio.get_running_loop().create_task(self._report())
        fetchers = [
            asyncio.get_running_loop().create_task(self._fetcher(donor))
            for donor in self.donors
            for _ in range(self._config.pieces_in_flight)
        ]
        try:
            for finished in asyncio.as_completed(fetchers):
                await finished  # a planning failure (nobody has a tensor) surfaces here
                if self.complete:
                    break
        finally:
            for task in (*fetchers, reporter):
                task.cancel()
            await asyncio.gather(*fetchers, reporter, return_exceptions=True)
        if not self.complete:
            missing = [n for n, job in self._jobs.items() if not job.verified]
            raise StateDownloadFailed(
                f"every donor failed; {len(missing)} tensors missing, e.g. {missing[0]}"
            )
        if self._on_progress is not None:
            self._on_progress(self.progress())
        tensors = {
            name: job.buffer.view(np.dtype(job.spec.dtype)).reshape(job.spec.shape)
            for name, job in self._jobs.items()
        }
        used = [d for d in self.donors if d.fetched_bytes or d.alive]
        snapshot = StateSnapshot(max(d.step for d in used), tensors)
        for name, job in self._jobs.items():
            snapshot._digests[name] = job.digest.hex()
        return snapshot


def _compatible(donor: Donor, expected: Mapping[str, TensorSpec], required: set[str]) -> bool:
    """Whether the donor holds every required tensor, and each tensor we want in our shape."""
    missing = required - donor.specs.keys()
    wrong = [n for n, s in donor.specs.items() if n in expected and s != expected[n]]
    if missing or wrong:
        log.warning(
            "state_donor_incompatible",
            donor=donor.address,
            missing=sorted(missing)[:3],
            wrong_shape=sorted(wrong)[:3],
        )
        return False
    return True


async def download_state(
    client: RpcClient,
    addresses: list[str],
    *,
    expected: Mapping[str, TensorSpec],
    required: set[str] | None = None,
    config: JoinConfig,
    on_progress: Callable[[DownloadProgress], None] | None = None,
    injections: InjectionPoints = NO_INJECTIONS,
) -> tuple[StateSnapshot, StateDownload]:
    """Download the tensors named in ``expected`` from up to ``config.max_donors`` of
    ``addresses``; every name in ``required`` (default: the weights among ``expected``; AdamW
    moments exist only once a replica has stepped) must be held by a donor for it to be used. Returns the snapshot and the finished download (its figures)."""
    if required is None:
        required = {name for name in expected if name.startswith(PARAM_PREFIX)}
    weights_only = all(name.startswith(PARAM_PREFIX) for name in expected)  # donors copy less
    answers = await asyncio.gather(
        *(
            read_manifest(client, a, timeout_s=config.manifest_timeout_s, weights_only=weights_only)
            for a in addresses[: config.max_donors]
        ),
        return_exceptions=True,
    )
    donors = []
    for address, answer in zip(addresses, answers, strict=False):
        if isinstance(answer, BaseException):
            if not isinstance(answer, (RpcError, AgoraError, ValueError, TypeError)):
                raise answer
            log.warning("state_manifest_failed", donor=address, error=str(answer)[:300])
        else:
            donors.append(answer)
    if not donors:
        raise StateDownloadFailed(f"none of {len(addresses)} candidate donors sent a manifest")
    download = StateDownload(
        client,
        donors,
        expected=expected,
        required=required,
        config=config,
        on_progress=on_progress,
        injections=injections,
    )
    return await download.run(), download
