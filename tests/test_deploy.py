"""The deployment files (docker-compose.yml, deploy/k8s) run the service the locked way:
exposed on every interface, so with bearer tokens; never --insecure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

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
        yaml.safe_load_all((ROOT / "deploy/k8s/service.yaml").read_text()))
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
