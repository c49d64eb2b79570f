"""The chart's default and PostgreSQL renders, started as real processes (see cluster.py): one
controlplane and two dataplanes per render, every rendered probe hit, a proxied request to a
mock provider and a signal through each dataplane, both checked stored through the admin CLI
with the environment the chart gives its `helm test` pod; then the spool across a container
restart while the controlplane is away, and SIGTERM within the rendered grace period.

Needs NM_GATEWAY_BIN (the binary under test) and, for the PostgreSQL render,
NM_TEST_POSTGRES_URL (default postgres://postgres@127.0.0.1:5432/test) and psql.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest

from cluster import Cluster, Pod, poll
from nmchart import CHART, FULLNAME, render_case

BIN = os.environ.get("NM_GATEWAY_BIN", "")
PG_URL = os.environ.get("NM_TEST_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test")
USAGE = {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}


class MockOpenAI:
    """OpenAI chat completions on loopback, recording what arrives."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        mock = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                with mock.lock:
                    mock.requests.append({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body})
                answer = json.dumps({
                    "id": f"chatcmpl-{uuid.uuid4().hex}",
                    "object": "chat.completion",
                    "created": 1700000000,
                    "model": "gpt-4o-mini-2024-07-18",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello."}, "finish_reason": "stop"}],
                    "usage": USAGE,
                }).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def http(method: str, url: str, headers: dict[str, str], body: Any = None) -> tuple[int, dict[str, str], Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode(errors="replace")


def psql(sql: str) -> None:
    subprocess.run(["psql", PG_URL, "-v", "ON_ERROR_STOP=1", "-qAtc", sql], check=True, capture_output=True, text=True, stdin=subprocess.DEVNULL)


class Release:
    def __init__(self, case: str, cluster: Cluster, mock: MockOpenAI):
        self.case = case
        self.cluster = cluster
        self.mock = mock
        r = cluster.render
        self.bootstrap_key = r.secret_data(f"{FULLNAME}-bootstrap")["bootstrap-key"]
        providers = r.maybe("Secret", f"{FULLNAME}-providers")
        self.operator_key = r.secret_data(f"{FULLNAME}-providers")["openai"] if providers else None
        self.controlplane = cluster.of("controlplane")[0]
        self.dataplanes = cluster.of("dataplane")
        self.test_pod = cluster.of("test")[0]

    def proxy(self, dp: Pod, agent: str, session: str) -> tuple[int, Any]:
        headers = {"NM-Key": self.bootstrap_key, "NM-Agent": agent, "NM-Session": session}
        if self.operator_key is None:
            headers["Authorization"] = "Bearer sk-client-own-key"
        status, _, body = http(
            "POST",
            f"http://127.0.0.1:{dp.port('http')}/openai/v1/chat/completions",
            headers,
            {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hi"}]},
        )
        return status, body

    def cli(self, *args: str) -> Any:
        """The admin CLI with the helm test pod's environment (URL and admin key from the render)."""
        done = self.cluster.run(self.test_pod, *args)
        assert done.returncode == 0, f"nm-gateway {' '.join(args)} -> {done.returncode}\n{done.stderr}\n{self.cluster.tails()}"
        return json.loads(done.stdout)

    def usage(self, agent: str) -> dict[str, Any]:
        return self.cli("usage", "--json", "--since", "1h", "--agent", agent)["total"]


@pytest.fixture(scope="module", params=["default", "postgres"])
def release(request, tmp_path_factory) -> Iterator[Release]:
    assert BIN and Path(BIN).is_file(), "set NM_GATEWAY_BIN to the nm-gateway binary under test"
    case = request.param
    extra: dict[str, Any] = {}
    db = None
    if case == "postgres":
        db = f"nm_test_{uuid.uuid4().hex[:12]}"
        psql(f"CREATE DATABASE {db}")
        extra = {"database": {"url": PG_URL.rsplit("/", 1)[0] + f"/{db}"}}
    mock = MockOpenAI()
    r = render_case(CHART / "ci" / f"{case}-values.yaml", extra)
    cluster = Cluster(
        r,
        str(Path(BIN).resolve()),
        tmp_path_factory.mktemp(f"smoke-{case}"),
        extra_env={"dataplane": {"NM_UPSTREAM_OPENAI": mock.url}},
        max_replicas={"controlplane": 1},
    )
    rel = Release(case, cluster, mock)
    assert len(rel.dataplanes) == 2, "the chart's default is two dataplanes"
    try:
        cluster.start("controlplane")
        rel.controlplane.wait_for("readinessProbe")
        cluster.start("dataplane")
        for dp in rel.dataplanes:
            dp.wait_for("readinessProbe")
        yield rel
    finally:
        cluster.stop_all()
        mock.close()
        if db:
            psql(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")


def test_every_rendered_probe_passes(release):
    failures = []
    for pod in release.dataplanes + [release.controlplane]:
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            ok, why = pod.probe(kind)
            if not ok:
                failures.append(f"{pod.name} {kind}: {why}")
    assert failures == [], failures


def test_helm_test_pod_passes(release):
    done = release.cluster.run(release.test_pod)
    assert done.returncode == 0, f"{done.stderr}\n{release.cluster.tails()}"
    assert "total" in json.loads(done.stdout)


def test_requests_and_signals_through_each_dataplane_are_stored(release):
    agent = f"smoke-{release.case}"
    before = len(release.mock.requests)
    for i, dp in enumerate(release.dataplanes):
        session = f"sess_smoke_{release.case}_{i}"
        status, body = release.proxy(dp, agent, session)
        assert status == 200, (dp.name, body)
        assert body["choices"][0]["message"]["content"] == "Hello." and body["usage"] == USAGE
        status, _, body = http("POST", f"http://127.0.0.1:{dp.port('http')}/v1/signal", {"NM-Key": release.bootstrap_key, "NM-Agent": agent}, {"session_id": session, "action": "accepted"})
        assert (status, body) == (200, {"ok": True}), dp.name
    seen = release.mock.requests[before:]
    assert [r["path"] for r in seen] == ["/v1/chat/completions"] * 2
    for r in seen:
        # The operator key from the chart's Secret is injected when the client sends none.
        expected = f"Bearer {release.operator_key}" if release.operator_key else "Bearer sk-client-own-key"
        assert r["headers"]["authorization"] == expected
        assert not any(h.startswith("nm-") for h in r["headers"])
    total = poll("2 stored requests", lambda: (t := release.usage(agent))["requests"] == 2 and t, 30)
    assert (total["input_tokens"], total["output_tokens"]) == (2 * USAGE["prompt_tokens"], 2 * USAGE["completion_tokens"])
    shown = poll("2 stored signals", lambda: (s := release.cli("agents", "show", agent, "--json"))["total"] == 2 and s, 30)
    assert shown["by_action"]["accepted"] == 2


def test_controlplane_outage_keeps_dataplanes_alive_and_spooled_records_survive_a_restart(release):
    """The controlplane goes away: readiness fails, liveness does not (no restart storm); a
    record made meanwhile lands in the spool volume, survives a crash of the dataplane container
    and is delivered once the controlplane is back."""
    agent = f"smoke-spool-{release.case}"
    dp, other = release.dataplanes
    assert release.controlplane.sigterm_and_wait() == 0
    status, body = release.proxy(dp, agent, f"sess_spool_{release.case}")
    assert status == 200, body

    def spooled() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{dp.port('http')}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("nm_spool_records") and float(line.split()[-1]) >= 1:
                    return True
        return False

    poll("the record in the spool", spooled, 60)
    spool_dir = dp.mounts[dp.container["env"][[e["name"] for e in dp.container["env"]].index("NM_SPOOL_DIR")]["value"]]
    assert any(f.is_file() and f.stat().st_size > 0 for f in spool_dir.rglob("*")), "the spool volume holds the record"
    poll("readiness to fail without the controlplane", lambda: not other.probe("readinessProbe")[0], 60)
    live_ok, live_why = other.probe("livenessProbe")

    dp.restart_after_crash()
    release.controlplane.restarts += 1
    release.controlplane.start()
    release.controlplane.wait_for("readinessProbe")
    for p in release.dataplanes:
        p.wait_for("readinessProbe")
    total = poll("the spooled record stored", lambda: (t := release.usage(agent))["requests"] >= 1 and t, 60)
    assert total["requests"] == 1, "delivered exactly once"
    assert live_ok, f"liveness must not fail while the controlplane is away: {live_why}"


def test_sigterm_stops_within_the_rendered_grace_period(release):
    for pod in release.dataplanes + [release.controlplane]:
        assert pod.sigterm_and_wait() == 0, pod.tail()
