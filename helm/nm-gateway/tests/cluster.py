"""A rendered release run as real processes on loopback: what the kubelet would start, minus
the container.

From a render it takes, per pod, each container's command, args and environment (envFrom and
env in order, `valueFrom.secretKeyRef`/`configMapKeyRef` resolved from the rendered Secrets and
ConfigMaps, `fieldRef` faked, `$(VAR)` expanded as Kubernetes does) and runs it with:
- `nm-gateway` -> the binary under test (NM_GATEWAY_BIN);
- every listen address (`0.0.0.0:PORT`) -> a free loopback port of that pod;
- every Service DNS name in a URL -> 127.0.0.1 and the port of the pod the Service selects;
- every volume mount path -> a directory of that pod (emptyDir: kept across restarts of the
  container, like the kubelet; a PVC: one directory per claim; ConfigMap and Secret volumes:
  their rendered files);
- the image's environment only (PATH, SSL_CERT_FILE), never the test runner's.
Probes are evaluated the kubelet's way from the rendered probe specs.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nmchart import NAMESPACE, Render, containers, pod_meta, pod_spec

IMAGE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt"}
BIND = re.compile(r"^(0\.0\.0\.0|127\.0\.0\.1|\[::\]):(\d+)$")
URL = re.compile(r"\b(https?)://([A-Za-z0-9.-]+):(\d+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poll(what: str, check: Callable[[], Any], deadline_s: float = 60.0, every_s: float = 0.2) -> Any:
    """Calls `check` until it returns a true value or the deadline passes (then fails with `what`
    and the last error). Polling an observable condition, never a sleep standing in for one."""
    end = time.monotonic() + deadline_s
    last: Any = None
    while True:
        try:
            got = check()
            if got:
                return got
            last = got
        except Exception as e:  # noqa: BLE001 - reported below
            last = e
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline_s:.0f}s waiting for {what}; last: {last!r}")
        time.sleep(every_s)


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined variables are replaced, `$$` escapes, others stay."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)


@dataclass
class Pod:
    name: str
    component: str
    workload: dict[str, Any]
    container: dict[str, Any]
    root: Path
    ports: dict[int, int] = field(default_factory=dict)  # containerPort -> loopback port
    mounts: dict[str, Path] = field(default_factory=dict)  # mountPath -> directory
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    restarts: int = 0

    @property
    def labels(self) -> dict[str, str]:
        return pod_meta(self.workload)["labels"]

    def port(self, ref: Any) -> int:
        if isinstance(ref, int):
            return self.ports[ref]
        named = {p["name"]: p["containerPort"] for p in self.container.get("ports") or []}
        return self.ports[named[ref]]

    @property
    def log(self) -> Path:
        return self.root / f"container-{self.restarts}.log"

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} is running"
        out = self.log.open("wb")
        self.proc = subprocess.Popen(self.argv, env=self.env, cwd=self.root / "workdir", stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def restart_after_crash(self) -> None:
        """SIGKILL and start again with the same volumes: a container restart in the same pod."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        self.restarts += 1
        self.start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 25) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return f"--- {self.name} ({self.component}) last {n} log lines:\n" + "\n".join(lines[-n:])

    # === probes, as the kubelet runs them ===

    def probe(self, kind: str) -> tuple[bool, str]:
        spec = self.container.get(kind)
        if spec is None:
            return True, "no probe"
        timeout = spec.get("timeoutSeconds", 1)
        if "httpGet" in spec:
            g = spec["httpGet"]
            url = f"http://127.0.0.1:{self.port(g['port'])}{g.get('path', '/')}"
            try:
                with urllib.request.urlopen(url, timeout=timeout) as r:
                    code = r.status
            except urllib.error.HTTPError as e:
                code = e.code
            except OSError as e:
                return False, f"GET {g.get('path')}: {e}"
            return 200 <= code < 400, f"GET {g.get('path')} -> {code}"
        if "grpc" in spec:
            g = spec["grpc"]
            with grpc.insecure_channel(f"127.0.0.1:{self.port(g['port'])}") as ch:
                try:
                    resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=g.get("service", "")), timeout=timeout)
                except grpc.RpcError as e:
                    return False, f"grpc.health.v1 Check: {e.code()}"
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
                return status == "SERVING", f"grpc.health.v1 Check -> {status}"
        if "tcpSocket" in spec:
            try:
                socket.create_connection(("127.0.0.1", self.port(spec["tcpSocket"]["port"])), timeout=timeout).close()
                return True, "tcp connect ok"
            except OSError as e:
                return False, f"tcp connect: {e}"
        raise AssertionError(f"{self.name}: unsupported probe {spec}")

    def wait_for(self, kind: str, deadline_s: float = 60.0) -> None:
        def check() -> bool:
            if not self.alive():
                raise AssertionError(f"{self.name} exited with {self.proc.returncode if self.proc else None}\n{self.tail()}")
            ok, why = self.probe(kind)
            if not ok:
                raise RuntimeError(why)
            return True

        try:
            poll(f"{self.name} {kind}", check, deadline_s)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.tail()}") from None

    def sigterm_and_wait(self) -> int:
        """SIGTERM, then the exit code within the pod's grace period (what the kubelet allows)."""
        assert self.proc is not None
        grace = pod_spec(self.workload).get("terminationGracePeriodSeconds", 30)
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.name} did not stop within terminationGracePeriodSeconds={grace}\n{self.tail()}") from None


class Cluster:
    def __init__(self, r: Render, binary: str, root: Path, extra_env: dict[str, dict[str, str]] | None = None, max_replicas: dict[str, int] | None = None):
        self.render = r
        self.binary = binary
        self.root = root
        self.extra_env = extra_env or {}
        self.pods: list[Pod] = []
        self.claims: dict[str, Path] = {}
        for w in r.of_kind("Deployment", "StatefulSet", "Pod"):
            component = pod_meta(w)["labels"]["app.kubernetes.io/component"]
            n = 1 if w["kind"] == "Pod" else w["spec"].get("replicas", 1)
            if max_replicas and component in max_replicas:
                n = min(n, max_replicas[component])
            for i in range(n):
                c = containers(w)[0]
                name = f"{w['metadata']['name']}-{i}" if w["kind"] != "Pod" else w["metadata"]["name"]
                pod = Pod(name, component, w, c, root / name)
                (pod.root / "workdir").mkdir(parents=True)
                for p in c.get("ports") or []:
                    pod.ports[p["containerPort"]] = free_port()
                self.pods.append(pod)
        for pod in self.pods:
            self._volumes(pod)
        for pod in self.pods:
            self._resolve(pod)

    def of(self, component: str) -> list[Pod]:
        return [p for p in self.pods if p.component == component]

    # === resolution ===

    def _volumes(self, pod: Pod) -> None:
        spec = pod_spec(pod.workload)
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        templates = pod.workload["spec"].get("volumeClaimTemplates", []) if pod.workload["kind"] == "StatefulSet" else []
        for t in templates:
            volumes[t["metadata"]["name"]] = {"name": t["metadata"]["name"], "persistentVolumeClaim": {"claimName": f"{t['metadata']['name']}-{pod.name}"}}
        for m in pod.container.get("volumeMounts") or []:
            v = volumes[m["name"]]
            if "persistentVolumeClaim" in v:
                claim = v["persistentVolumeClaim"]["claimName"]
                d = self.claims.setdefault(claim, self.root / "claims" / claim)
            else:
                d = pod.root / "volumes" / m["name"]
            d.mkdir(parents=True, exist_ok=True)
            if "configMap" in v or "secret" in v:
                src = v.get("configMap") or v["secret"]
                if "configMap" in v:
                    data = self.render.get("ConfigMap", src["name"])["data"]
                else:
                    data = self.render.secret_data(src["secretName"])
                items = src.get("items") or [{"key": k, "path": k} for k in data]
                for it in items:
                    (d / it["path"]).write_text(data[it["key"]])
            elif not ({"emptyDir", "persistentVolumeClaim"} & set(v)):
                raise AssertionError(f"{pod.name}: volume kind not mapped: {v}")
            pod.mounts[m["mountPath"]] = d

    def _service_target(self, host: str, port: int) -> int | None:
        for svc in self.render.of_kind("Service"):
            n = svc["metadata"]["name"]
            if host not in {n, f"{n}.{NAMESPACE}", f"{n}.{NAMESPACE}.svc", f"{n}.{NAMESPACE}.svc.cluster.local"}:
                continue
            for sp in svc["spec"]["ports"]:
                if sp["port"] != port:
                    continue
                selected = [p for p in self.pods if svc["spec"]["selector"].items() <= p.labels.items()]
                assert selected, f"Service {n} selects no pod"
                return selected[0].port(sp.get("targetPort", sp["port"]))
        return None

    def _map_value(self, pod: Pod, value: str) -> str:
        m = BIND.match(value)
        if m:
            port = int(m.group(2))
            if port not in pod.ports:
                pod.ports[port] = free_port()
            return f"127.0.0.1:{pod.ports[port]}"

        def url(m: re.Match) -> str:
            target = self._service_target(m.group(2), int(m.group(3)))
            return m.group(0) if target is None else f"{m.group(1)}://127.0.0.1:{target}"

        value = URL.sub(url, value)
        if pod.mounts:
            # One pass, longest mount path first: a mapped path is never mapped again.
            paths = "|".join(re.escape(p) for p in sorted(pod.mounts, key=len, reverse=True))
            value = re.sub(rf"(?<![\w.-])({paths})(?=/|\?|$)", lambda m: str(pod.mounts[m.group(1)]), value)
        return value

    def _resolve(self, pod: Pod) -> None:
        c = pod.container
        env: dict[str, str] = {}
        for src in c.get("envFrom") or []:
            if "configMapRef" in src:
                data = self.render.get("ConfigMap", src["configMapRef"]["name"])["data"]
            else:
                data = self.render.secret_data(src["secretRef"]["name"])
            env.update({src.get("prefix", "") + k: v for k, v in data.items()})
        fields = {"metadata.name": pod.name, "metadata.namespace": NAMESPACE, "spec.nodeName": "smoke-node", "metadata.uid": str(uuid.uuid4())}
        for e in c.get("env") or []:
            if "value" in e:
                env[e["name"]] = expand(e["value"], env)
                continue
            ref = e["valueFrom"]
            if "secretKeyRef" in ref:
                env[e["name"]] = self.render.secret_data(ref["secretKeyRef"]["name"])[ref["secretKeyRef"]["key"]]
            elif "configMapKeyRef" in ref:
                env[e["name"]] = self.render.get("ConfigMap", ref["configMapKeyRef"]["name"])["data"][ref["configMapKeyRef"]["key"]]
            elif "fieldRef" in ref:
                env[e["name"]] = fields[ref["fieldRef"]["fieldPath"]]
            else:
                raise AssertionError(f"{pod.name}: env source not mapped: {e}")
        pod.env = {**IMAGE_ENV, **{k: self._map_value(pod, v) for k, v in env.items()}, **self.extra_env.get(pod.component, {})}
        cmd = list(c["command"]) + list(c.get("args") or [])
        assert cmd[0] == "nm-gateway", cmd
        pod.argv = [self.binary] + [self._map_value(pod, a) for a in cmd[1:]]

    # === running ===

    def start(self, component: str) -> None:
        for p in self.of(component):
            p.start()

    def run(self, pod: Pod, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """A one-shot container (the test pod) or another command with that pod's environment."""
        argv = pod.argv if not args else [self.binary, *args]
        return subprocess.run(argv, env=pod.env, cwd=pod.root / "workdir", capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def stop_all(self) -> None:
        for p in self.pods:
            if p.alive():
                p.proc.kill()
                p.proc.wait()

    def tails(self) -> str:
        return "\n".join(p.tail() for p in self.pods if p.proc is not None)
