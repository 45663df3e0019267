"""monitoring/: the Prometheus config and alert rules load, and the alerts behave as their unit
tests (monitoring/alerts_test.yml) say, under the real promtool."""

from __future__ import annotations

from pathlib import Path

from agora_devkit.prometheus import promtool

MONITORING = Path(__file__).resolve().parent.parent / "monitoring"


def passes(*args: str) -> str:
    """promtool's output, after asserting it exited 0."""
    result = promtool(*args)
    output = result.stdout.decode(errors="replace")
    assert result.returncode == 0, output
    return output


def test_the_prometheus_config_and_its_rule_file_load():
    output = passes("check", "config", str(MONITORING / "prometheus.yml"))
    assert "1 rule files found" in output


def test_the_alert_rules_are_valid():
    output = passes("check", "rules", str(MONITORING / "alerts.yml"))
    assert "SUCCESS" in output


def test_the_alert_rules_pass_their_unit_tests():
    output = passes("test", "rules", str(MONITORING / "alerts_test.yml"))
    assert "SUCCESS" in output


def test_a_broken_alert_fails_its_unit_tests(tmp_path):
    # The unit tests can fail: the same tests against rules whose averaging threshold moved.
    rules = (MONITORING / "alerts.yml").read_text()
    assert rules.count(") < 0.8") == 1
    (tmp_path / "alerts.yml").write_text(rules.replace(") < 0.8", ") < 0.4"))
    (tmp_path / "alerts_test.yml").write_text((MONITORING / "alerts_test.yml").read_text())
    result = promtool("test", "rules", str(tmp_path / "alerts_test.yml"))
    assert result.returncode == 1
    assert "AgoraAveragingFailing" in result.stdout.decode()
