"""Prometheus metrics for one node, labelled by role, stage and instance.

Every node owns a :class:`NodeMetrics`: a private registry (so many nodes can live in one
process, as they do in tests) whose exported samples all carry ``role``, ``stage`` and
``instance`` labels. Components declare their metrics through it with only their own,
low-cardinality labels. Operator nodes are scraped (:meth:`NodeMetrics.serve_http`);
contributors behind NAT push to a gateway (``agora_core.observability.metrics_push``); a role's command does
either through ``agora_core.observability.metrics_exposure``. Every node exports its process's resident
memory (``agora_host_rss_bytes``), read when collected.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import start_http_server
from prometheus_client.metrics_core import Metric

from agora_core.node.host import host_rss_bytes

NODE_LABELS = ("role", "stage", "instance")


class _LabelledRegistry(CollectorRegistry):
    """A registry that stamps the node's labels onto every sample it exports."""

    def __init__(self, node_labels: dict[str, str]):
        super().__init__()
        self._node_labels = node_labels

    def collect(self) -> Iterable[Metric]:
        for metric in super().collect():
            stamped = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            stamped.samples = [
                sample._replace(labels={**self._node_labels, **sample.labels}) for sample in metric.samples
            ]
            yield stamped


CounterReading = Callable[[], dict[tuple[str, ...], float]]  # label values -> running total


class _ReadCounter:
    """A counter whose totals live elsewhere (plain ints on a hot path) and are read when
    the registry is collected; the totals of every source declared under the name add up."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...], *, registry):
        self.name, self.documentation, self.labelnames = name, documentation, labelnames
        self.sources: list[CounterReading] = []
        registry.register(self)

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        totals: dict[tuple[str, ...], float] = {}
        for read in self.sources:
            for labels, value in read().items():
                totals[labels] = totals.get(labels, 0.0) + value
        for labels, value in totals.items():
            family.add_metric(labels, value)
        yield family


class Tally:
    """Observations of a histogram counted as plain numbers, for a hot path where a
    Histogram.observe() (a lock per bucket and sum) costs more than the work it times.
    Declared with :meth:`NodeMetrics.histogram_from`; only one thread may observe."""

    def __init__(self, buckets: Sequence[float]):
        self.buckets = tuple(sorted(buckets))
        self._by_labels: dict[tuple[str, ...], list[float]] = {}  # per bucket (non-cumulative), +Inf, sum

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        counts = self._by_labels.get(labels)
        if counts is None:
            counts = self._by_labels[labels] = [0] * (len(self.buckets) + 2)
        counts[bisect.bisect_left(self.buckets, value)] += 1  # the first bucket with value <= bound
        counts[-1] += value

    def readings(self) -> list[tuple[tuple[str, ...], list[float]]]:
        return [(labels, list(counts)) for labels, counts in list(self._by_labels.items())]


class _ReadHistogram:
    """A histogram whose observations live in :class:`Tally` objects; they add up."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...], *, registry):
        self.name, self.documentation, self.labelnames = name, documentation, labelnames
        self.tallies: list[Tally] = []
        registry.register(self)

    def collect(self) -> Iterable[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        merged: dict[tuple[tuple[str, ...], tuple[float, ...]], list[float]] = {}
        for tally in self.tallies:
            for labels, counts in tally.readings():
                total = merged.setdefault((labels, tally.buckets), [0] * len(counts))
                for i, count in enumerate(counts):
                    total[i] += count
        for (labels, bounds), counts in merged.items():
            cumulative, buckets = 0, []
            for bound, count in zip((*bounds, float("inf")), counts[:-1], strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
            family.add_metric(list(labels), buckets, counts[-1])
        yield family


class MetricsEndpoint:
    """A running HTTP exposition endpoint; ``port`` is the bound port."""

    def __init__(self, server, thread: threading.Thread):
        self._server = server
        self._thread = thread
        self.port: int = server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class NodeMetrics:
    """The metrics registry of one node. Declaring the same metric twice returns the first."""

    def __init__(self, *, role: str, stage: int | str | None = None, instance: str = ""):
        self.labels = {
            "role": role,
            "stage": "" if stage is None else str(stage),
            "instance": instance,
        }
        self.registry = _LabelledRegistry(self.labels)
        self._metrics: dict[str, tuple[type, tuple[str, ...], object]] = {}
        self._lock = threading.Lock()
        rss = self.gauge("agora_host_rss_bytes", "Resident memory of this node's process on its host.")
        rss.set_function(host_rss_bytes)

    def set_stage(self, stage: int | None) -> None:
        """Label every sample with ``stage`` from now on: a worker of an authorized run learns
        its stage from the authorizer after its RPC server (and its metrics) started."""
        self.labels["stage"] = "" if stage is None else str(stage)

    def _declare(self, cls, name: str, documentation: str, labelnames: Sequence[str], **kwargs):
        if not name.startswith("agora_"):
            raise ValueError(f"metric {name!r} must carry the agora_ prefix")
        clash = set(labelnames) & set(NODE_LABELS)
        if clash:
            raise ValueError(f"metric {name!r}: labels {sorted(clash)} are added per node")
        labelnames = tuple(labelnames)
        with self._lock:
            known = self._metrics.get(name)
            if known is not None:
                if known[0] is not cls or known[1] != labelnames:
                    raise ValueError(f"metric {name!r} already declared as {known[0].__name__}{known[1]}")
                return known[2]
            metric = cls(name, documentation, labelnames, registry=self.registry, **kwargs)
            self._metrics[name] = (cls, labelnames, metric)
            return metric

    def counter(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Counter:
        return self._declare(Counter, name, documentation, labelnames)

    def counter_from(
        self, name: str, documentation: str, labelnames: Sequence[str], read: CounterReading
    ) -> None:
        """A counter read at collection time: ``read()`` returns the running totals by label
        values. For counts bumped per message, where a Counter.inc() per message costs more
        than the message's own bookkeeping. Sources declared under one name add up."""
        counter = self._declare(_ReadCounter, name, documentation, labelnames)
        counter.sources.append(read)

    def gauge(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Gauge:
        return self._declare(Gauge, name, documentation, labelnames)

    def histogram(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float] = Histogram.DEFAULT_BUCKETS,
    ) -> Histogram:
        return self._declare(Histogram, name, documentation, labelnames, buckets=tuple(buckets))

    def histogram_from(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float] = Histogram.DEFAULT_BUCKETS,
    ) -> Tally:
        """A histogram observed through the returned :class:`Tally` (plain numbers, read at
        collection time). Tallies declared under one name add up."""
        histogram = self._declare(_ReadHistogram, name, documentation, labelnames)
        tally = Tally([b for b in buckets if b != float("inf")])
        histogram.tallies.append(tally)
        return tally

    def exposition(self) -> bytes:
        """The current samples in Prometheus text format."""
        return generate_latest(self.registry)

    def sample_value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """Value of one exported sample (node labels implied), or None; handy in tests/tools."""
        wanted = {**self.labels, **(labels or {})}
        for metric in self.registry.collect():
            for sample in metric.samples:
                if sample.name == name and sample.labels == wanted:
                    return sample.value
        return None

    def serve_http(self, port: int = 0, host: str = "127.0.0.1") -> MetricsEndpoint:
        """Serve ``/metrics`` for a Prometheus scraper; ``port=0`` picks a free port."""
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        return MetricsEndpoint(server, thread)
