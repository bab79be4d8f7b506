"""The deployment files (docker-compose.yml, deploy/k8s) run the service the locked way:
exposed on every interface, so with bearer tokens; never --insecure."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml

from tieredbuf.cli import build_parser, parse_duration

ROOT = Path(__file__).resolve().parents[1]


def test_compose_serves_with_a_token_it_makes_the_operator_set() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    svc = compose["services"]["tieredbuf"]
    assert svc["command"][0] == "serve" and "--host=0.0.0.0" in svc["command"]
    assert "--insecure" not in svc["command"]
    tokens = svc["environment"]["TIEREDBUF_SERVICE_TOKENS"]
    assert tokens.startswith("${TIEREDBUF_TOKEN:?"), "compose refuses to start without one"
    assert "AWS_SECRET_ACCESS_KEY" in svc["environment"]


def test_k8s_serves_with_a_token_file_from_a_secret() -> None:
    docs: list[dict[str, Any]] = list(
        yaml.safe_load_all((ROOT / "deploy/k8s/service.yaml").read_text())
    )
    pod = next(d for d in docs if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    serve = pod["containers"][0]
    args = serve["args"]
    assert args[0] == "serve" and "--host=0.0.0.0" in args and "--insecure" not in args
    token_arg = next(a for a in args if a.startswith("--token-file="))
    token_dir = str(Path(token_arg.split("=", 1)[1]).parent)
    mount = next(m for m in serve["volumeMounts"] if m["mountPath"] == token_dir)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "tieredbuf-tokens"
    assert serve["readinessProbe"]["httpGet"]["path"] == "/readyz"  # open: no token needed


def _stop_budget(args: list[str]) -> timedelta:
    """What `tieredbuf serve` may take after SIGTERM: --shutdown-timeout + --drain-timeout
    (their defaults unless given) + the 30 s the supervisor adds before it kills a worker."""
    ns = build_parser().parse_args(
        [
            *args[:2],
            "--staging=/s",
            *(a for a in args if a.split("=")[0] in ("--shutdown-timeout", "--drain-timeout")),
        ]
    )
    return ns.shutdown_timeout + ns.drain_timeout + timedelta(seconds=30)


def test_compose_waits_for_the_drain_operations_md_promises() -> None:
    svc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["tieredbuf"]
    assert parse_duration(svc["stop_grace_period"]) >= _stop_budget(svc["command"])


def _k8s() -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((ROOT / "deploy/k8s/service.yaml").read_text()))


def _pre_stop(container: dict[str, Any]) -> timedelta:
    """The preStop hook's sleep: Kubernetes counts it in the grace period."""
    hook = container.get("lifecycle", {}).get("preStop")
    if hook is None:
        return timedelta(0)
    cmd = hook["exec"]["command"]
    assert cmd[0] == "sleep", cmd
    return timedelta(seconds=float(cmd[1]))


def test_k8s_waits_for_the_drain_operations_md_promises() -> None:
    pod = next(d for d in _k8s() if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    serve = pod["containers"][0]
    grace = timedelta(seconds=pod["terminationGracePeriodSeconds"])
    assert grace >= _pre_stop(serve) + _stop_budget(serve["args"])


def test_k8s_instances_each_have_a_stage_of_their_own_and_leave_rotation_before_draining() -> None:
    """Several instances on one buffer: a PersistentVolumeClaim per pod for the stage
    (a stage belongs to its instance), a preStop pause so the load balancers stop
    sending requests before SIGTERM stops the intake, and a headless Service so clients
    can list the pods."""
    docs = _k8s()
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    serve = sts["spec"]["template"]["spec"]["containers"][0]
    stage_dir = next(a for a in serve["args"] if a.startswith("--staging=")).split("=", 1)[1]
    mount = next(m for m in serve["volumeMounts"] if m["mountPath"] == stage_dir)
    claims = {c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]}
    assert mount["name"] in claims  # a claim per pod, not a volume shared by the pods
    assert _pre_stop(serve) > timedelta(0)
    headless = next(
        d
        for d in docs
        if d["kind"] == "Service" and d["metadata"]["name"] == sts["spec"]["serviceName"]
    )
    assert headless["spec"]["clusterIP"] == "None"


def test_compose_runs_two_instances_each_on_a_stage_of_its_own() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    serves = {n: s for n, s in services.items() if s.get("command", [""])[0] == "serve"}
    assert len(serves) >= 2
    stages = [next(v for v in s["volumes"] if v.endswith(":/stage")) for s in serves.values()]
    assert len(set(stages)) == len(stages), stages
    assert len({s["ports"][0].split(":")[0] for s in serves.values()}) == len(serves)
    for s in serves.values():
        assert s["command"][1] == serves["tieredbuf"]["command"][1]  # one buffer
        assert parse_duration(s["stop_grace_period"]) >= _stop_budget(s["command"])


def test_every_alert_rule_names_metrics_tieredbuf_exports() -> None:
    """A rule over a metric nobody exports never fires: silently.  Every tieredbuf_*
    name in deploy/prometheus/alerts.yml is one the package defines."""
    import re

    source = "\n".join(p.read_text() for p in (ROOT / "tieredbuf").rglob("*.py"))
    names = set(re.findall(r'"(tieredbuf_[a-z0-9_]+)"', source))
    defined = names | {f"{n}_total" for n in names}  # prometheus_client's Counter suffix
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    used = {
        name
        for group in rules["groups"]
        for rule in group["rules"]
        for name in re.findall(r"tieredbuf_[a-z0-9_]+", rule["expr"])
    }
    assert used and used <= defined, sorted(used - defined)


def test_the_stuck_consumer_rule_is_judged_against_positions() -> None:
    """An idle Spark stream keeps its last micro-batch queued: the rule that watches the
    oldest record must also require new entries and a head that did not move."""
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    by_name = {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}
    for name, position in (
        ("TieredbufConsumerStuck", "tieredbuf_queue_depth"),
        ("TieredbufSubscriberStuck", "tieredbuf_subscriber_next_sequence"),
    ):
        expr = by_name[name]
        assert "changes(max(tieredbuf_queue_next_sequence)" in expr and position in expr
    assert not any("oldest_age" in e and "changes(" not in e for e in by_name.values())
