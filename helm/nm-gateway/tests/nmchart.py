"""Rendering the chart offline and reading the result.

The real Helm engine (helm-python-sdk, Helm v4 as a library) renders the chart exactly as
`helm template` would: values.schema.json is enforced and `fail` stops the render. No cluster is
involved, so `lookup` finds nothing and the generated secrets are new on every render; goldens
mask them.
"""

from __future__ import annotations

import base64
import functools
import re
from pathlib import Path
from typing import Any, Iterator

import helm_python
import yaml

TESTS = Path(__file__).resolve().parent
CHART = TESTS.parent
REPO = CHART.parent.parent
GOLDEN = TESTS / "golden"
CI_VALUES = sorted(CHART.glob("ci/*-values.yaml"))
RELEASE = "nm"
NAMESPACE = "gw"
FULLNAME = f"{RELEASE}-nm-gateway"

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Pod")
# Env names whose value is a secret: they may only come from a Secret (valueFrom.secretKeyRef).
SECRET_ENV = re.compile(
    r"^(NM_LINK_SECRET|NM_BOOTSTRAP_KEY|NM_ADMIN_KEY|NM_DATABASE_URL|NM_PROVIDER_KEY_.+|OTEL_EXPORTER_OTLP_HEADERS)$"
)


def case_name(values_file: Path) -> str:
    return values_file.name.removesuffix("-values.yaml")


def load_values(values_file: Path) -> dict[str, Any]:
    return yaml.safe_load(values_file.read_text()) or {}


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


@functools.lru_cache(maxsize=1)
def chart() -> helm_python.Chart:
    return helm_python.Chart.load(CHART)


def render_files(values: dict[str, Any] | None = None, *, name: str = RELEASE) -> dict[str, str]:
    """Template path -> rendered text (raises helm_python errors on schema or `fail`)."""
    return chart().render(values or {}, name=name, namespace=NAMESPACE, is_install=True)


class Render:
    """One render: its manifests as dicts, and lookups over them."""

    def __init__(self, files: dict[str, str]):
        self.files = files
        self.notes = files.get("nm-gateway/templates/NOTES.txt", "")
        self.docs: list[dict[str, Any]] = []
        for path in sorted(files):
            if path.endswith("NOTES.txt"):
                continue
            for doc in yaml.safe_load_all(files[path]):
                if doc:
                    doc.setdefault("__source__", path)
                    self.docs.append(doc)

    def manifests(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in d.items() if k != "__source__"} for d in self.docs]

    def of_kind(self, *kinds: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] in kinds]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [d for d in self.docs if d["kind"] == kind and d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
        return found[0]

    def maybe(self, kind: str, name: str) -> dict[str, Any] | None:
        found = [d for d in self.docs if d["kind"] == kind and d["metadata"]["name"] == name]
        return found[0] if found else None

    def workloads(self) -> list[dict[str, Any]]:
        return self.of_kind(*WORKLOAD_KINDS)

    def component(self, component: str) -> dict[str, Any]:
        found = [
            d
            for d in self.workloads()
            if d["metadata"]["labels"].get("app.kubernetes.io/component") == component
        ]
        assert len(found) == 1, f"expected one {component} workload, found {len(found)}"
        return found[0]

    def secret_data(self, name: str) -> dict[str, str]:
        s = self.get("Secret", name)
        return {k: base64.b64decode(v).decode() for k, v in (s.get("data") or {}).items()}

    def secret_values(self) -> list[str]:
        return [v for s in self.of_kind("Secret") for v in self.secret_data(s["metadata"]["name"]).values()]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"] if workload["kind"] == "Pod" else workload["spec"]["template"]["spec"]


def pod_meta(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["metadata"] if workload["kind"] == "Pod" else workload["spec"]["template"]["metadata"]


def containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(workload)
    return list(spec.get("initContainers") or []) + list(spec["containers"])


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env") or []}


def render(values: dict[str, Any] | None = None, **kw: Any) -> Render:
    return Render(render_files(values, **kw))


def render_case(values_file: Path, extra: dict[str, Any] | None = None) -> Render:
    return render(deep_merge(load_values(values_file), extra or {}))


def walk_strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield str(k)
            yield from walk_strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk_strings(v)


# === goldens ===

GENERATED_KEYS = {"link-secret", "bootstrap-key"}
MASK = "R0VORVJBVEVE"  # base64("GENERATED"): keeps the golden valid YAML and valid base64


def golden_text(files: dict[str, str]) -> tuple[str, str]:
    """(manifests as one YAML stream, NOTES.txt), generated secrets masked: they differ on every
    offline render."""
    r = Render(files)
    generated = set()
    for s in r.of_kind("Secret"):
        for k, v in (s.get("data") or {}).items():
            if k in GENERATED_KEYS:
                generated.add(v)
    parts = []
    for path in sorted(files):
        text = files[path].strip("\n")
        if not text.strip() or path.endswith("NOTES.txt"):
            continue
        for g in generated:
            text = text.replace(g, MASK)
        parts.append(f"# Source: {path}\n{text}\n")
    return "---\n".join(parts), r.notes.strip("\n") + "\n"
