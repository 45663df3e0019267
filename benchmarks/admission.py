#!/usr/bin/env python3
"""Admission benchmark: the full flow (request -> checks -> credential) under a crowd of joiners.

    python benchmarks/admission.py [--joiners 200] [--repeat 3] [--backends sqlite,postgresql]
                                   [--json] [--smoke]

For each backend a real authorizer process (``agora-authorizer serve``) admits ``--joiners``
concurrent simulated joiners (each its own key and RPC server on 127.0.0.1, answering the
dial-back: key proof, a 64 KiB bandwidth probe and the matmul challenge at the run's width).

Figures per backend:
* ``admissions_per_s`` with the token bucket off and every check on: joiners / (first
  request sent -> last credential in hand), the median of ``--repeat`` crowds of fresh
  joiners; target >= 50 on SQLite on two cores. Baseline: ``admission.poll``
  calls per second from the same crowd against the same authorizer, answered from memory
  (the RPC round trips this crowd and machine sustain), so the ratio is the share of that
  call rate the whole flow keeps, with its four round trips and three commits.
* ``arrival_order`` with the bucket on (``--rate`` per minute): the fraction of joiner pairs
  admitted in the order their requests arrived (1.0: strictly first come, first served).
* ``refresh_ms``: the median latency of a credential refresh, one joiner at a time, against
  the median of a poll (ratio: what a refresh costs over a bare round trip: signature checks,
  the nonce and the new credential committed).

The crowd runs in this process and the authorizer in another, on the same cores: the figures
are the machine's, not the authorizer's alone.

``--smoke``: one crowd of 2 joiners through each backend (PostgreSQL only where installed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import _harness
from _report import Report  # benchmarks/ is on sys.path when a benchmark runs as a script
from agora_core.identity import NodeKey
from agora_core.observability.logs import configure_logging
from agora_devkit.authorizer import TestJoiner, authorizer_process, small_run

ADMISSION_WAIT_S = 600.0  # a joiner's wait for its credential, in the largest crowd


async def crowd(authz, count: int) -> list[TestJoiner]:
    return list(await asyncio.gather(*(TestJoiner(authz.run, authz.address).start() for _ in range(count))))


async def admit_all(joiners: list[TestJoiner], account: str, token: str) -> tuple[float, list]:
    started = time.perf_counter()
    await asyncio.gather(*(j.join(account, token) for j in joiners))
    final = await asyncio.gather(*(j.admission.wait(timeout_s=ADMISSION_WAIT_S) for j in joiners))
    return time.perf_counter() - started, final


async def poll_rate(joiners: list[TestJoiner], rounds: int = 3) -> float:
    started = time.perf_counter()
    for _ in range(rounds):
        await asyncio.gather(*(j.admission.poll() for j in joiners))
    return rounds * len(joiners) / (time.perf_counter() - started)


def ordered_fraction(statuses: list) -> float:
    """Of all pairs, the share admitted in arrival (request id) order."""
    issued = [s.credential.credential.issued for s in sorted(statuses, key=lambda s: s.request_id)]
    pairs = in_order = 0
    for i in range(len(issued)):
        for j in range(i + 1, len(issued)):
            pairs += 1
            in_order += issued[i] <= issued[j]
    return in_order / pairs if pairs else 1.0


async def refresh_latency(
    authz, joiners: list[TestJoiner], statuses: list, samples: int
) -> tuple[float, float]:
    refresh_ms, poll_ms = [], []
    for joiner, status in list(zip(joiners, statuses, strict=True))[:samples]:
        keeper = joiner.keeper(status.credential)
        started = time.perf_counter()
        await joiner.admission.poll()
        poll_ms.append((time.perf_counter() - started) * 1e3)
        started = time.perf_counter()
        await keeper.refresh()
        refresh_ms.append((time.perf_counter() - started) * 1e3)
    return statistics.median(refresh_ms), statistics.median(poll_ms)


async def measure(report: Report, backend: str, db: Callable[[], str | None], directory: Path, args) -> None:
    count = args.joiners
    # 1. throughput, bucket off: --repeat crowds of fresh joiners, the median reported
    run = small_run(
        admissions_per_minute=0.0, min_bandwidth_mbps=1.0, max_latency_ms=1000.0, max_challenge_s=10.0
    )
    report.note(f"{backend}: starting the authorizer (no rate limit)")
    with authorizer_process(directory / "open", run, db=db(), key=NodeKey.generate()) as authz:
        token = authz.add_account("bench", max_nodes=count * (args.repeat + 1))
        rates = []
        for attempt in range(args.repeat):
            report.note(f"{backend}: starting {count} joiners' servers")
            joiners = await crowd(authz, count)
            try:
                report.note(
                    f"{backend}: {count} joiners through the full flow, no rate limit ({attempt + 1}/{args.repeat})"
                )
                elapsed, statuses = await admit_all(joiners, "bench", token)
                rates.append(count / elapsed)
                if attempt == args.repeat - 1:
                    report.note(f"{backend}: polls and refreshes of the last crowd")
                    baseline = await poll_rate(joiners)
                    refresh, poll = await refresh_latency(authz, joiners, statuses, min(50, count))
            finally:
                await asyncio.gather(*(j.close() for j in joiners), return_exceptions=True)
        report.note(f"{backend}: admissions/s per crowd {', '.join(f'{r:.1f}' for r in rates)}")
        target = ">= 50" if backend == "sqlite" else None
        report.compare(
            f"{backend}.admissions_per_s", statistics.median(rates), baseline, "admissions/s", target=target
        )
        report.compare(f"{backend}.refresh_ms", refresh, poll, "ms (median)")
    # 2. fairness, bucket on
    run = small_run(admissions_per_minute=args.rate, admission_burst=1)
    report.note(f"{backend}: starting the authorizer ({args.rate:g} admissions/min)")
    with authorizer_process(directory / "paced", run, db=db(), key=NodeKey.generate()) as authz:
        token = authz.add_account("bench", max_nodes=count * 2)
        report.note(f"{backend}: starting {count} joiners' servers")
        joiners = await crowd(authz, count)
        try:
            report.note(f"{backend}: the same crowd through a bucket of {args.rate:g}/min")
            elapsed, statuses = await admit_all(joiners, "bench", token)
            report.add(
                f"{backend}.arrival_order", ordered_fraction(statuses), "fraction of pairs", target="1.0"
            )
            report.add(
                f"{backend}.paced_admissions_per_s",
                count / elapsed,
                "admissions/s",
                ratio=count / elapsed / (args.rate / 60),
            )
        finally:
            await asyncio.gather(*(j.close() for j in joiners), return_exceptions=True)


def start_postgres(stack: contextlib.ExitStack, report: Report, smoke: bool) -> str | None:
    """A throwaway PostgreSQL server's URL (stopped with ``stack``); None under --smoke where
    none can run here, so that the smoke still proves the SQLite path."""
    # imported here: psycopg is a dev requirement, which a SQLite-only run does without
    from agora_devkit.postgres import PostgresUnavailable, postgres_server

    report.note("starting a throwaway PostgreSQL server")
    try:
        return stack.enter_context(postgres_server())
    except PostgresUnavailable as error:
        if not smoke:
            raise
        report.note(f"--smoke: PostgreSQL left out, it cannot run here: {error}")
        return None


async def measure_postgres(report: Report, directory: Path, args) -> None:
    """``measure`` on a throwaway PostgreSQL server, a fresh database per authorizer."""
    from agora_devkit.postgres import create_database

    with contextlib.ExitStack() as stack:
        server = start_postgres(stack, report, args.smoke)
        if server is not None:
            await measure(report, "postgresql", lambda: create_database(server), directory, args)


async def main_async(args) -> None:
    report = Report("admission", as_json=args.json)
    with tempfile.TemporaryDirectory(prefix="agora-admission-") as tmp:
        for backend in args.backends.split(","):
            directory = Path(tmp) / backend
            if backend == "sqlite":
                await measure(report, backend, lambda: None, directory, args)
            elif backend == "postgresql":
                await measure_postgres(report, directory, args)
            else:
                sys.exit(f"unknown backend {backend!r}: sqlite or postgresql")
    report.finish()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--joiners", type=int, default=200)
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument(
        "--rate", type=float, default=3000.0, help="admissions per minute for the fairness run"
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="crowds through the unpaced authorizer (median)"
    )
    _harness.add_arguments(parser, deadline_s=900)
    args = _harness.parse(parser, smoke={"joiners": 2, "repeat": 1})
    configure_logging(fmt="console", level="warning")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
