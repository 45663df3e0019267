"""Every role's metrics as Prometheus gets them: real node processes pushing to a real
``prometheus-pushgateway`` on 127.0.0.1 and serving ``/metrics`` on 127.0.0.2 (the
``AGORA_METRICS_HOST`` knob; still loopback). Each exposition passes ``promtool check metrics``,
each group is refreshed periodically and is gone once its node exits cleanly, and every agora_*
name monitoring/alerts.yml reads is one the nodes really export.

One open run: a DHT seed, a worker of stage 0 and a trainer (waiting for stage 1, which never
comes: it serves and pushes its metrics meanwhile). The authorizer runs its own run.
"""

from __future__ import annotations

import contextlib
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agora_devkit.authority import SMALL_MODEL
from agora_devkit.authorizer import authorizer_process
from agora_devkit.processes import ChildProcess, spawn_python, wait_until
from agora_devkit.prometheus import PushGateway, check_metrics
from agora_trainer.data.sharding import make_shards
from agora_trainer.data.tokenizer import ByteTokenizer

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
METRICS_HOST = "127.0.0.2"  # not the default 127.0.0.1: the knob must be what binds
START_S = 60.0  # a worker imports torch on a busy machine
PUSH_S = 10.0
RUN = f"""
name = "metrics-test"
{SMALL_MODEL}
[dht]
gossip_period_s = 0.2
probe_timeout_s = 0.1
suspicion_timeout_s = 1.0
op_timeout_s = 1.0
"""


@pytest.fixture
def push_env(gateway) -> dict[str, str]:
    return {
        "AGORA_METRICS_PUSH_GATEWAY": gateway.address,
        "AGORA_METRICS_PUSH_INTERVAL_S": "0.2",
        "AGORA_METRICS_HOST": METRICS_HOST,
        "AGORA_LOG_LEVEL": "error",
    }


def scrape(url: str) -> bytes:
    assert url.startswith(f"http://{METRICS_HOST}:"), url
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


def names_in(exposition: bytes) -> set[str]:
    """Every metric family and sample name in an exposition."""
    names = set()
    for family in text_string_to_metric_families(exposition.decode()):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def alert_metric_names() -> set[str]:
    """The agora_* names monitoring/alerts.yml reads (recorded agora:* series aside)."""
    text = (ROOT / "monitoring" / "alerts.yml").read_text()
    expressions = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    return set(re.findall(r"\bagora_[a-z0-9_]+", expressions))


def pushes_seen(gateway: PushGateway, instance: str) -> float:
    group = gateway.group(instance=instance)
    return 0.0 if group is None else group.value("agora_metrics_pushes_total", outcome="ok") or 0.0


@contextlib.contextmanager
def node(args: list[str], env: dict[str, str]):
    """A node process; yields (child, its instance label, its /metrics URL)."""
    with spawn_python(args, env=env) as child:
        node_id = child.read_until(_id_line(args), timeout_s=START_S).split()[0]
        yield child, node_id[:12], child.read_until("  metrics    ", timeout_s=START_S)


def _id_line(args: list[str]) -> str:
    return "agora dht node " if "dht" in args else "  node id    "


def stop_cleanly(child: ChildProcess) -> None:
    assert child.stop() == 0, child.lines


def test_nodes_push_periodically_pass_promtool_and_a_clean_exit_deletes_their_group(
    tmp_path, gateway, push_env
):
    config = tmp_path / "run.toml"
    config.write_text(RUN)
    shards = tmp_path / "shards"
    make_shards(shards, shards=1, tokenizer=ByteTokenizer(), max_bytes=20_000)
    dht_args = ["-m", "agora_core", "dht", "serve", "--config", str(config), "--metrics-port", "0"]
    dht_args += ["--key-file", str(tmp_path / "dht.key")]
    with node(dht_args, push_env) as (seed, seed_instance, seed_url):
        address = next(line.split()[-1] for line in seed.lines if line.startswith("  serving    "))
        common = ["--config", str(config), "--bootstrap", address, "--metrics-port", "0"]
        worker_args = ["-m", "agora_worker", "run", *common, "--stage", "0", "--device", "cpu"]
        worker_args += ["--key-file", str(tmp_path / "worker.key")]
        trainer_args = ["-m", "agora_trainer", "run", *common, "--shards", str(shards)]
        trainer_args += ["--key-file", str(tmp_path / "trainer.key")]
        with node(worker_args, push_env) as (worker, worker_instance, worker_url):
            with node(trainer_args, push_env) as (trainer, trainer_instance, trainer_url):
                nodes = {"dht": seed_instance, "worker": worker_instance, "trainer": trainer_instance}
                for role, instance in nodes.items():  # pushed again and again, not once
                    wait_until(
                        lambda i=instance: pushes_seen(gateway, i) >= 3,
                        timeout_s=PUSH_S,
                        what=f"the {role}'s periodic pushes",
                        every_s=0.05,
                    )
                    group = gateway.group(instance=instance)
                    assert group.labels == {
                        "job": "agora",
                        "run": "metrics-test",
                        "role": role,
                        "instance": instance,
                    }
                    assert group.value("agora_host_rss_bytes") > 10 << 20
                worker_group = gateway.group(instance=worker_instance)
                assert worker_group.value("agora_worker_phase", phase="serving", stage="0") == 1
                assert worker_group.value("agora_worker_terminated", reason="host_memory") == 0
                assert worker_group.value("agora_worker_device_memory_allocated_bytes") is None  # a CPU

                expositions = {"gateway": gateway.exposition()}
                for role, url in (("dht", seed_url), ("worker", worker_url), ("trainer", trainer_url)):
                    expositions[role] = scrape(url)
                for source, exposition in expositions.items():
                    assert check_metrics(exposition) == "", f"{source}: {check_metrics(exposition)}"
                exported = set().union(*(names_in(e) for e in expositions.values()))
                assert alert_metric_names() - exported == set()
                assert alert_metric_names() >= {"agora_worker_terminated", "agora_trainer_tokens_total"}

                stop_cleanly(trainer)
                assert gateway.group(instance=trainer_instance) is None
            stop_cleanly(worker)  # deleted before it exits: no wait needed
            assert gateway.group(instance=worker_instance) is None
            assert gateway.group(instance=seed_instance) is not None  # the others' stay
        stop_cleanly(seed)
        assert gateway.groups() == []


def test_the_authorizer_serves_and_pushes_promtool_clean_metrics(tmp_path, gateway, push_env, monkeypatch):
    for name, value in push_env.items():  # the authorizer process inherits the environment
        monkeypatch.setenv(name, value)
    with authorizer_process(tmp_path, extra=("--metrics-port", "0")) as authorizer:
        url = authorizer.child.read_until("  metrics    ", timeout_s=START_S)
        instance = authorizer.key.node_id[:12]
        wait_until(
            lambda: pushes_seen(gateway, instance) >= 2, timeout_s=PUSH_S, what="its pushes", every_s=0.05
        )
        assert gateway.group(instance=instance).labels["role"] == "authorizer"
        exposition = scrape(url)
        assert "agora_authorizer_queue_length" in names_in(exposition)
        assert check_metrics(exposition) == "", check_metrics(exposition)
        stop_cleanly(authorizer.child)
    assert gateway.group(instance=instance) is None
