"""The chart rendered by the real Helm engine over the ci/*-values.yaml matrix, and what every
render must hold: it lints, validates against Kubernetes' schemas, matches its golden, keeps
secrets in Secrets, hardens every container, probes by the health contract, and refuses the
combinations that cannot work."""

from __future__ import annotations

import base64
import os
import re
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml

import crd_schemas
from nmchart import (
    CHART,
    CI_VALUES,
    FULLNAME,
    GOLDEN,
    NAMESPACE,
    RELEASE,
    REPO,
    SECRET_ENV,
    Render,
    case_name,
    containers,
    env_of,
    golden_text,
    load_values,
    pod_meta,
    pod_spec,
    render,
    render_case,
    render_files,
    walk_strings,
)

UPDATE_GOLDEN = os.environ.get("UPDATE_GOLDEN") == "1"
KUBE_FLOOR = "1.30.0"  # Chart.yaml kubeVersion
KUBE_CURRENT = kubernetes_validate.utils.latest_version()
IMAGE_UID = 65532
CASES = {case_name(f): f for f in CI_VALUES}


def test_the_matrix_is_complete():
    assert set(CASES) >= {"default", "postgres", "ha", "serve", "otel", "networkpolicy", "servicemonitor", "tls"}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request) -> tuple[str, Render]:
    return request.param, render_case(CASES[request.param])


# === lint, schemas, goldens ===


@pytest.mark.parametrize("name", sorted(CASES))
def test_lint_strict_passes(name):
    report = helm_python.chart.lint(
        CHART, load_values(CASES[name]), strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_FLOOR}"
    )
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert problems == [], problems


def test_every_render_passes_kubernetes_validate_strict(case):
    name, r = case
    for doc in r.manifests():
        if doc["kind"] in crd_schemas.SCHEMAS:
            crd_schemas.validate(doc)
            continue
        for version in (KUBE_FLOOR, KUBE_CURRENT):
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']} invalid for Kubernetes {version}: {e}")


def test_golden(case):
    name, _ = case
    files = render_files(load_values(CASES[name]))
    manifests, notes = golden_text(files)
    for path, text in ((GOLDEN / f"{name}.yaml", manifests), (GOLDEN / f"{name}-NOTES.txt", notes)):
        if UPDATE_GOLDEN:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
        assert path.exists(), f"{path} missing: run helm/ci.sh --update-golden"
        assert path.read_text() == text, f"{path.name} differs from the render: review, then helm/ci.sh --update-golden"


def test_no_stale_goldens():
    expected = {f"{n}.yaml" for n in CASES} | {f"{n}-NOTES.txt" for n in CASES}
    assert {p.name for p in GOLDEN.iterdir()} == expected


# === secrets ===


def test_secrets_only_in_secrets(case):
    name, r = case
    given = [
        v
        for v in walk_strings(
            {k: load_values(CASES[name]).get(k) for k in ("database", "providers", "linkSecret", "bootstrapKey")}
        )
        if ("://" in v and "@" in v) or v.startswith("sk-")
    ]
    secrets = r.secret_values() + given
    for doc in r.docs:
        if doc["kind"] == "Secret":
            continue
        for text in walk_strings(doc):
            for s in secrets:
                if len(s) >= 8:
                    assert s not in text, f"{name}: a secret value appears in {doc['kind']}/{doc['metadata']['name']}"
    for doc in r.of_kind("ConfigMap"):
        for key in doc.get("data") or {}:
            assert not SECRET_ENV.match(key), f"{name}: {key} in ConfigMap {doc['metadata']['name']}"
        for text in (doc.get("data") or {}).values():
            assert not re.search(r"(?m)^\s*(api_key|bootstrap_key|admin_key|database_url)\s*=", text)


def test_secret_env_comes_from_a_rendered_or_given_secret(case):
    name, r = case
    values = load_values(CASES[name])
    given = {
        values.get(k, {}).get("existingSecret")
        for k in ("database", "linkSecret", "bootstrapKey", "providers")
    } | {values.get("otel", {}).get("headers", {}).get("existingSecret")}
    for w in r.workloads():
        for c in containers(w):
            for env in c.get("env") or []:
                if not SECRET_ENV.match(env["name"]):
                    continue
                assert "value" not in env, f"{name}: {env['name']} is a literal in {c['name']}"
                ref = env["valueFrom"]["secretKeyRef"]
                if ref["name"] in given:
                    continue
                data = r.get("Secret", ref["name"]).get("data") or {}
                assert ref["key"] in data, f"{name}: {env['name']} -> {ref} not in the rendered Secret"


def test_generated_secrets_have_generated_strength():
    r = render()
    link = r.secret_data(f"{FULLNAME}-link")["link-secret"]
    assert len(link) >= 32 and link.isalnum()
    key = r.secret_data(f"{FULLNAME}-bootstrap")["bootstrap-key"]
    assert re.fullmatch(r"nmk_[A-Za-z0-9]{48}", key), key
    assert render().secret_data(f"{FULLNAME}-bootstrap")["bootstrap-key"] != key


def test_existing_secrets_replace_generated_ones():
    r = render_case(CASES["ha"])
    assert {s["metadata"]["name"] for s in r.of_kind("Secret")} == set()
    cp = env_of(containers(r.component("controlplane"))[0])
    assert cp["NM_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "nm-gateway-database", "key": "url"}
    assert cp["NM_LINK_SECRET"]["valueFrom"]["secretKeyRef"] == {"name": "nm-gateway-link", "key": "link-secret"}
    assert cp["NM_BOOTSTRAP_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "nm-gateway-bootstrap", "key": "bootstrap-key"}
    dp = env_of(containers(r.component("dataplane"))[0])
    assert dp["NM_PROVIDER_KEY_OPENAI"]["valueFrom"]["secretKeyRef"] == {"name": "nm-gateway-providers", "key": "openai-api-key"}
    assert "NM_DATABASE_URL" not in dp and "NM_BOOTSTRAP_KEY" not in dp


def test_each_component_gets_only_the_secrets_it_needs():
    r = render_case(CASES["postgres"])
    dp = env_of(containers(r.component("dataplane"))[0])
    cp = env_of(containers(r.component("controlplane"))[0])
    assert {"NM_LINK_SECRET", "NM_PROVIDER_KEY_OPENAI"} <= set(dp) and not {"NM_DATABASE_URL", "NM_BOOTSTRAP_KEY"} & set(dp)
    assert {"NM_LINK_SECRET", "NM_DATABASE_URL", "NM_BOOTSTRAP_KEY"} <= set(cp) and "NM_PROVIDER_KEY_OPENAI" not in cp
    assert r.secret_data(f"{FULLNAME}-database")["database-url"].startswith("postgres://")


def test_serve_mode_has_no_link_secret():
    r = render_case(CASES["serve"])
    assert r.maybe("Secret", f"{FULLNAME}-link") is None
    assert "NM_LINK_SECRET" not in env_of(containers(r.component("serve"))[0])


def test_config_file_with_a_secret_is_refused():
    with pytest.raises(helm_python.HelmRenderError, match="configFile holds a secret"):
        render({"configFile": '[providers.openai]\napi_key = "sk-live"\n'})


# === hardening ===


def test_every_pod_and_container_is_hardened(case):
    name, r = case
    assert r.workloads(), name
    for w in r.workloads():
        spec = pod_spec(w)
        where = f"{name}: {w['kind']}/{w['metadata']['name']}"
        assert spec["automountServiceAccountToken"] is False, where
        assert spec["enableServiceLinks"] is False, where
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] == IMAGE_UID and psc["runAsGroup"] == IMAGE_UID, where
        assert psc["fsGroup"] == IMAGE_UID and psc["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), where
        for c in containers(w):
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] == IMAGE_UID, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False, where
            assert sc["capabilities"] == {"drop": ["ALL"]}, where
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, where
            res = c["resources"]
            assert {"cpu", "memory"} <= set(res["requests"]) and "memory" in res["limits"], where
            assert c["command"] == ["nm-gateway"], where
            mounts = {m["mountPath"] for m in c.get("volumeMounts") or []}
            assert "/tmp" in mounts, f"{where}: a writable /tmp on the read-only root"


def test_image_user_matches_the_chart():
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(rf"^USER {IMAGE_UID}:{IMAGE_UID}$", dockerfile, re.M)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == IMAGE_UID
    assert values["containerSecurityContext"]["runAsUser"] == IMAGE_UID


def test_service_account_mounts_no_token():
    r = render()
    sa = r.get("ServiceAccount", FULLNAME)
    assert sa["automountServiceAccountToken"] is False


def test_grace_period_outlasts_the_gateways_drain(case):
    name, r = case
    drain = int(r.get("ConfigMap", f"{FULLNAME}-config")["data"]["NM_SHUTDOWN_GRACE_SECS"])
    for w in r.of_kind("Deployment", "StatefulSet"):
        spec = pod_spec(w)
        c = spec["containers"][0]
        pre = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        assert spec["terminationGracePeriodSeconds"] > drain + pre, f"{name}: {w['metadata']['name']}"


def test_grace_period_follows_the_setting_and_a_too_short_one_is_refused():
    r = render({"config": {"shutdownGraceSecs": 100}})
    assert pod_spec(r.component("controlplane"))["terminationGracePeriodSeconds"] == 115
    assert pod_spec(r.component("dataplane"))["terminationGracePeriodSeconds"] == 120
    with pytest.raises(helm_python.HelmRenderError, match="must be above config.shutdownGraceSecs"):
        render({"dataplane": {"terminationGracePeriodSeconds": 30}})


def test_config_change_rolls_the_pods():
    def sums(r: Render) -> dict[str, str]:
        return {w["metadata"]["name"]: pod_meta(w)["annotations"]["checksum/config"] for w in r.of_kind("Deployment")}

    base, again = sums(render()), sums(render())
    assert base == again
    changed = sums(render({"config": {"log": "debug"}}))
    assert set(changed) == set(base) and all(changed[k] != base[k] for k in base)
    secret = lambda r: {pod_meta(w)["annotations"]["checksum/secret"] for w in r.of_kind("Deployment")}  # noqa: E731
    assert secret(render({"database": {"url": "postgres://a@h/d"}})) != secret(render({"database": {"url": "postgres://b@h/d"}}))


# === probes ===


def _probe_target(probe: dict[str, Any]) -> tuple[str, Any]:
    for kind in ("httpGet", "grpc", "tcpSocket", "exec"):
        if kind in probe:
            return kind, probe[kind]
    raise AssertionError(probe)


def _named_port(c: dict[str, Any], port: Any) -> int:
    if isinstance(port, int):
        assert port in {p["containerPort"] for p in c["ports"]}
        return port
    return {p["name"]: p["containerPort"] for p in c["ports"]}[port]


def test_probes_match_the_health_contract(case):
    name, r = case
    tls = load_values(CASES[name]).get("tls", {}).get("enabled", False)
    for w in r.of_kind("Deployment", "StatefulSet"):
        comp = w["metadata"]["labels"]["app.kubernetes.io/component"]
        c = containers(w)[0]
        probes = {k: c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
        for p in probes.values():
            kind, target = _probe_target(p)
            _named_port(c, target["port"])
        if comp in ("dataplane", "serve"):
            assert probes["readinessProbe"]["httpGet"]["path"] == "/health", name
            assert probes["startupProbe"]["httpGet"]["path"] == "/health/live", name
            kind, target = _probe_target(probes["livenessProbe"])
            # Liveness must not depend on the controlplane: never /health.
            assert (kind, target.get("path")) in {("httpGet", "/health/live"), ("tcpSocket", None)}, name
        else:
            assert comp == "controlplane"
            for k in ("startupProbe", "readinessProbe"):
                kind, target = _probe_target(probes[k])
                # kubelet's gRPC probe cannot speak TLS.
                assert kind == ("tcpSocket" if tls else "grpc"), (name, k)
                assert _named_port(c, target["port"]) == 50051
            assert "tcpSocket" in probes["livenessProbe"], name


def test_probe_choices():
    r = render({"dataplane": {"livenessProbe": {"type": "tcpSocket"}}, "controlplane": {"livenessProbe": {"type": "grpc"}}})
    assert "tcpSocket" in containers(r.component("dataplane"))[0]["livenessProbe"]
    assert containers(r.component("controlplane"))[0]["livenessProbe"]["grpc"] == {"port": 50051}


# === topology ===


def test_split_topology():
    r = render()
    dp, cp = r.component("dataplane"), r.component("controlplane")
    assert dp["kind"] == cp["kind"] == "Deployment"
    assert dp["spec"]["replicas"] == 2 and cp["spec"]["replicas"] == 1
    assert cp["spec"]["strategy"] == {"type": "Recreate"}
    assert containers(dp)[0]["args"] == ["dataplane"] and containers(cp)[0]["args"] == ["controlplane"]
    svc = r.get("Service", f"{FULLNAME}-controlplane")
    assert svc["spec"]["ports"] == [{"name": "grpc", "port": 50051, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"}]
    assert svc["spec"]["selector"].items() <= pod_meta(cp)["labels"].items()
    http = r.get("Service", FULLNAME)
    assert http["spec"]["selector"].items() <= pod_meta(dp)["labels"].items()
    assert env_of(containers(dp)[0])["NM_CONTROLPLANE_URL"]["value"] == f"http://{FULLNAME}-controlplane.{NAMESPACE}.svc:50051"
    pvc = r.get("PersistentVolumeClaim", f"{FULLNAME}-data")
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    vols = {v["name"]: v for v in pod_spec(cp)["volumes"]}
    assert vols["data"]["persistentVolumeClaim"]["claimName"] == f"{FULLNAME}-data"
    db = r.secret_data(f"{FULLNAME}-database")["database-url"]
    mount = {m["name"]: m["mountPath"] for m in containers(cp)[0]["volumeMounts"]}["data"]
    assert db == f"sqlite://{mount}/nm-gateway.db?mode=rwc"


def test_labels(case):
    name, r = case
    for doc in r.docs:
        labels = doc["metadata"].get("labels") or {}
        for k in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version", "app.kubernetes.io/managed-by", "helm.sh/chart"):
            assert k in labels, f"{name}: {doc['kind']}/{doc['metadata']['name']} lacks {k}"
        assert doc["metadata"].get("namespace") == NAMESPACE, f"{name}: {doc['kind']} without namespace"
    for w in r.workloads():
        comp = pod_meta(w)["labels"]["app.kubernetes.io/component"]
        assert comp in {"dataplane", "controlplane", "serve", "test"}
        if w["kind"] != "Pod":
            assert w["spec"]["selector"]["matchLabels"].items() <= pod_meta(w)["labels"].items()
    pods = [pod_meta(w)["labels"] for w in r.workloads() if w["kind"] != "Pod"]
    for svc in r.of_kind("Service"):
        assert any(svc["spec"]["selector"].items() <= labels.items() for labels in pods), svc["metadata"]["name"]


def test_more_than_one_controlplane_on_sqlite_fails_and_says_why():
    with pytest.raises(helm_python.HelmRenderError) as e:
        render({"controlplane": {"replicaCount": 2}})
    msg = str(e.value)
    assert "controlplane.replicaCount=2 needs PostgreSQL" in msg and "ReadWriteOnce" in msg and "database.url" in msg
    with pytest.raises(helm_python.HelmRenderError, match="serve.replicaCount=3 needs PostgreSQL"):
        render({"mode": "serve", "serve": {"replicaCount": 3}})
    # PostgreSQL: any number, rolling updates, no claim.
    r = render({"controlplane": {"replicaCount": 3}, "database": {"url": "postgres://u:p@db:5432/nm"}})
    cp = r.component("controlplane")
    assert cp["spec"]["replicas"] == 3 and cp["spec"]["strategy"]["type"] == "RollingUpdate"
    assert not r.of_kind("PersistentVolumeClaim")
    assert "data" not in {v["name"] for v in pod_spec(cp)["volumes"]}


def test_serve_shape():
    r = render_case(CASES["serve"])
    assert [w["metadata"]["labels"]["app.kubernetes.io/component"] for w in r.workloads()] == ["serve"]
    s = r.component("serve")
    c = containers(s)[0]
    assert c["args"] == ["serve"] and s["spec"]["replicas"] == 1 and s["spec"]["strategy"] == {"type": "Recreate"}
    env = env_of(c)
    assert env["NM_GRPC_ADDR"]["value"].startswith("127.0.0.1:")
    assert r.get("Service", FULLNAME)["spec"]["selector"]["app.kubernetes.io/component"] == "serve"
    assert not r.maybe("Service", f"{FULLNAME}-controlplane")
    assert "port-forward deploy/" in r.notes


def test_spool_is_on_a_volume_that_survives_container_restarts(case):
    name, r = case
    for w in r.of_kind("Deployment", "StatefulSet"):
        c = containers(w)[0]
        env = env_of(c)
        if "NM_SPOOL_DIR" not in env:
            continue
        spool = env["NM_SPOOL_DIR"]["value"]
        mount = [m for m in c["volumeMounts"] if m["mountPath"] == spool]
        assert len(mount) == 1, f"{name}: spool dir is not a volume"
        vols = {v["name"]: v for v in pod_spec(w).get("volumes") or []}
        claims = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates") or []}
        vol = vols.get(mount[0]["name"])
        assert (vol and "emptyDir" in vol) or mount[0]["name"] in claims, name


def test_persistent_spool_makes_the_dataplane_a_statefulset():
    r = render_case(CASES["ha"])
    dp = r.component("dataplane")
    assert dp["kind"] == "StatefulSet"
    assert dp["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "2Gi"
    assert r.get("Service", dp["spec"]["serviceName"])["spec"]["clusterIP"] == "None"
    hpa = r.get("HorizontalPodAutoscaler", f"{FULLNAME}-dataplane")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": dp["metadata"]["name"]}
    assert "replicas" not in dp["spec"], "the HPA owns the replica count"
    assert containers(dp)[0]["image"].endswith("@sha256:" + "0123456789abcdef" * 4)


def test_dataplane_disruption_budget_and_spread():
    r = render()
    dp = r.component("dataplane")
    pdb = r.get("PodDisruptionBudget", f"{FULLNAME}-dataplane")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_meta(dp)["labels"].items()
    keys = {c["topologyKey"] for c in pod_spec(dp)["topologySpreadConstraints"]}
    assert keys == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    for c in pod_spec(dp)["topologySpreadConstraints"]:
        assert c["labelSelector"]["matchLabels"].items() <= pod_meta(dp)["labels"].items()
    assert not r.of_kind("HorizontalPodAutoscaler")
    with pytest.raises(helm_python.HelmRenderError, match="minReplicas"):
        render({"dataplane": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}})


# === operations ===


def test_network_policy_admits_only_dataplanes_tests_and_admins():
    r = render_case(CASES["networkpolicy"])
    cp = r.get("NetworkPolicy", f"{FULLNAME}-controlplane")
    rules = cp["spec"]["ingress"]
    assert len(rules) == 1 and rules[0]["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    peers = rules[0]["from"]
    selectors = [p["podSelector"]["matchLabels"] for p in peers if "podSelector" in p]
    dp_labels = pod_meta(r.component("dataplane"))["labels"]
    test_labels = pod_meta(r.component("test"))["labels"]
    assert any(s.items() <= dp_labels.items() for s in selectors)
    assert any(s.items() <= test_labels.items() for s in selectors)
    for s in selectors:
        assert s["app.kubernetes.io/instance"] == RELEASE and s["app.kubernetes.io/component"] in {"dataplane", "test"}
    assert [p["ipBlock"]["cidr"] for p in peers if "ipBlock" in p] == ["10.20.0.0/16", "fd00:20::/64"]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}} in peers
    assert cp["spec"]["podSelector"]["matchLabels"].items() <= pod_meta(r.component("controlplane"))["labels"].items()
    dp = r.get("NetworkPolicy", f"{FULLNAME}-dataplane")
    assert dp["spec"]["ingress"][0]["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert len(dp["spec"]["ingress"][0]["from"]) == 2
    assert not render().of_kind("NetworkPolicy")


def test_service_monitor_scrapes_metrics_on_the_http_service():
    r = render_case(CASES["servicemonitor"])
    sm = r.get("ServiceMonitor", FULLNAME)
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s", "scrapeTimeout": "5s"}]
    svc = r.get("Service", FULLNAME)
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert "http" in {p["name"] for p in svc["spec"]["ports"]}
    pm = render_case(CASES["extras"]).get("PodMonitor", FULLNAME)
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    with pytest.raises(helm_python.HelmRenderError, match="both enabled"):
        render({"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}})


def test_otel_block_becomes_otel_env_per_component():
    r = render_case(CASES["otel"])
    for comp, service in (("dataplane", "nm-dataplane"), ("controlplane", "nm-controlplane")):
        env_list = containers(r.component(comp))[0]["env"]
        env = {e["name"]: e for e in env_list}
        assert env["OTEL_SERVICE_NAME"]["value"] == service
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://otel-collector.observability.svc:4317"
        assert env["OTEL_EXPORTER_OTLP_PROTOCOL"]["value"] == "grpc"
        assert env["OTEL_TRACES_SAMPLER"]["value"] == "parentbased_traceidratio"
        assert env["OTEL_TRACES_SAMPLER_ARG"]["value"] == "0.1"
        assert env["OTEL_EXPORTER_OTLP_HEADERS"]["valueFrom"]["secretKeyRef"]["name"] == "otel-collector-auth"
        attrs = env["OTEL_RESOURCE_ATTRIBUTES"]["value"]
        for a in ("k8s.pod.name=$(K8S_POD_NAME)", "k8s.namespace.name=$(K8S_NAMESPACE_NAME)", "deployment.environment.name=production"):
            assert a in attrs.split(",")
        # $(VAR) expands only from variables defined earlier in the list.
        names = [e["name"] for e in env_list]
        for ref in re.findall(r"\$\(([A-Z0-9_]+)\)", attrs):
            assert names.index(ref) < names.index("OTEL_RESOURCE_ATTRIBUTES")
            assert "fieldRef" in env[ref]["valueFrom"]
    serve = render({"mode": "serve", "otel": {"endpoint": "http://c:4317"}})
    assert env_of(containers(serve.component("serve"))[0])["OTEL_SERVICE_NAME"]["value"] == "nm-gateway"
    for w in render().workloads():
        assert not any(e["name"].startswith("OTEL_") for c in containers(w) for e in c.get("env") or [])


def test_tls_link_from_cert_manager_secrets():
    r = render_case(CASES["tls"])
    dp, cp, test = (containers(r.component(c))[0] for c in ("dataplane", "controlplane", "test"))
    assert env_of(dp)["NM_CONTROLPLANE_URL"]["value"] == f"https://{FULLNAME}-controlplane.{NAMESPACE}.svc:50051"
    server = r.get("Certificate", f"{FULLNAME}-controlplane")
    assert f"{FULLNAME}-controlplane.{NAMESPACE}.svc" in server["spec"]["dnsNames"]
    client = r.get("Certificate", f"{FULLNAME}-dataplane")
    assert "client auth" in client["spec"]["usages"]

    def files(w: dict[str, Any], c: dict[str, Any]) -> dict[str, tuple[str, str]]:
        vols = {v["name"]: v for v in pod_spec(w)["volumes"]}
        out = {}
        for m in c["volumeMounts"]:
            secret = vols[m["name"]].get("secret")
            for item in (secret or {}).get("items", []):
                out[f"{m['mountPath']}/{item['path']}"] = (secret["secretName"], item["key"])
        return out

    cp_files = files(r.component("controlplane"), cp)
    cpe = env_of(cp)
    assert cp_files[cpe["NM_GRPC_TLS_CERT"]["value"]] == (server["spec"]["secretName"], "tls.crt")
    assert cp_files[cpe["NM_GRPC_TLS_KEY"]["value"]] == (server["spec"]["secretName"], "tls.key")
    assert cp_files[cpe["NM_GRPC_TLS_CLIENT_CA"]["value"]] == (server["spec"]["secretName"], "ca.crt")
    for w, c in ((r.component("dataplane"), dp), (r.component("test"), test)):
        f, e = files(w, c), env_of(c)
        assert f[e["NM_CONTROLPLANE_CA"]["value"]] == (server["spec"]["secretName"], "ca.crt")
        assert f[e["NM_CONTROLPLANE_CLIENT_CERT"]["value"]] == (client["spec"]["secretName"], "tls.crt")
        assert f[e["NM_CONTROLPLANE_CLIENT_KEY"]["value"]] == (client["spec"]["secretName"], "tls.key")
        # The server's private key is never mounted into a client pod.
        assert (server["spec"]["secretName"], "tls.key") not in f.values()
    with pytest.raises(helm_python.HelmRenderError, match="tls.enabled needs a certificate"):
        render({"tls": {"enabled": True}})
    own = render({"tls": {"enabled": True, "secretName": "my-cp-tls"}})
    assert not own.of_kind("Certificate")


def test_extra_hooks_reach_every_pod():
    r = render_case(CASES["extras"])
    for w in r.workloads():
        spec = pod_spec(w)
        comp = pod_meta(w)["labels"]["app.kubernetes.io/component"]
        assert spec["imagePullSecrets"] == [{"name": "regcred"}], comp
        assert spec["nodeSelector"] == {"kubernetes.io/arch": "amd64"}, comp
        assert w["metadata"]["labels"]["team"] == "llm-platform"
    dp = r.component("dataplane")
    spec, c = pod_spec(dp), containers(dp)[0]
    assert spec["tolerations"][0]["key"] == "dedicated" and "podAntiAffinity" in spec["affinity"]
    assert env_of(c)["NM_TLS_CA_FILE"]["value"] == "/etc/nm-gateway/extra-ca/ca.crt"
    assert {"secretRef": {"name": "nm-gateway-extra"}} in c["envFrom"]
    assert "extra-ca" in {v["name"] for v in spec["volumes"]}
    assert "/etc/nm-gateway/extra-ca" in {m["mountPath"] for m in c["volumeMounts"]}
    # The config file is mounted read-only and passed to every gateway process.
    for comp in ("dataplane", "controlplane"):
        c = containers(r.component(comp))[0]
        assert c["args"][1:] == ["--config", "/etc/nm-gateway/config/config.toml"]
        assert any(m["mountPath"] == "/etc/nm-gateway/config" and m["readOnly"] for m in c["volumeMounts"])
    assert "[providers.acme]" in r.get("ConfigMap", f"{FULLNAME}-file")["data"]["config.toml"]
    assert r.get("ConfigMap", f"{FULLNAME}-config")["data"]["NM_UPSTREAM_OPENAI"] == "https://openai-egress.internal"
    ingress = r.get("Ingress", FULLNAME)
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["port"]["name"] in {p["name"] for p in r.get("Service", backend["name"])["spec"]["ports"]}
    assert not render().of_kind("Ingress")


def test_helm_test_pod_uses_the_gateway_image_and_the_bootstrap_key():
    r = render()
    pod = r.get("Pod", f"{FULLNAME}-test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    c = containers(pod)[0]
    assert c["image"] == containers(r.component("dataplane"))[0]["image"]
    assert c["command"] == ["nm-gateway"] and c["args"][0] == "usage"
    env = env_of(c)
    assert env["NM_CONTROLPLANE_URL"] == env_of(containers(r.component("dataplane"))[0])["NM_CONTROLPLANE_URL"]
    assert env["NM_ADMIN_KEY"]["valueFrom"]["secretKeyRef"] == {"name": f"{FULLNAME}-bootstrap", "key": "bootstrap-key"}


def test_notes_tell_how_to_start():
    notes = render().notes
    assert f"get secret {FULLNAME}-bootstrap" in notes
    assert f"port-forward svc/{FULLNAME} 8080:8080" in notes
    assert "curl -s http://127.0.0.1:8080/health" in notes
    assert "/openai/v1/chat/completions" in notes and "NM-Key: $NM_ADMIN_KEY" in notes


# === values schema ===


@pytest.mark.parametrize(
    "values, complaint",
    [
        ({"replicas": 3}, "replicas"),
        ({"dataplane": {"replicas": 3}}, "replicas"),
        ({"dataplane": {"replicaCount": "2"}}, "replicaCount"),
        ({"dataplane": {"replicaCount": 0}}, "replicaCount"),
        ({"mode": "both"}, "mode"),
        ({"database": {"url": "mysql://u@h/db"}}, "url"),
        ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
        ({"dataplane": {"livenessProbe": {"type": "exec"}}}, "type"),
        ({"otel": {"protocol": "thrift"}}, "protocol"),
        ({"otel": {"endpoint": "collector:4317"}}, "endpoint"),
        ({"providers": {"apiKeys": {"Open-AI": "x"}}}, "Open-AI"),
        ({"networkPolicy": {"adminCIDRs": ["10.0.0.1"]}}, "adminCIDRs"),
        ({"config": {"logFormat": "xml"}}, "logFormat"),
        ({"linkSecret": {"existingSecret": "Not_A_Name"}}, "existingSecret"),
    ],
)
def test_schema_rejects(values, complaint):
    with pytest.raises(helm_python.HelmError) as e:
        render(values)
    assert complaint in str(e.value)


def test_schema_requires_every_default_key():
    """The defaults satisfy the schema, and the schema knows every key values.yaml has."""
    schema = helm_python.Chart.load(CHART).schema
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def check(v: Any, s: dict[str, Any], path: str) -> None:
        if "$ref" in s:
            s = schema["definitions"][s["$ref"].split("/")[-1]]
        if isinstance(v, dict) and "properties" in s:
            for k, sub in v.items():
                assert k in s["properties"], f"{path}.{k} missing from values.schema.json"
                check(sub, s["properties"][k], f"{path}.{k}")

    check(values, schema, "")
