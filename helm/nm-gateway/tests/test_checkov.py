"""checkov, the Kubernetes security linter, over every render of the ci/ matrix (offline,
--skip-download). Its findings must be empty but for the skips below, each with its reason."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import yaml

from nmchart import CI_VALUES, case_name, load_values, render_case

CHECKOV = os.environ.get("NM_CHECKOV", "")

# Skipped everywhere.
SKIP = {
    # Secrets reach the gateway as env vars because that is the binary's interface (NM_LINK_SECRET,
    # NM_DATABASE_URL, ...); they come from Secrets by secretKeyRef, never as literals (asserted
    # in test_render.py).
    "CKV_K8S_35": "secrets as env vars",
    # The image is pinned by a version tag by default; image.digest pins it by digest (ha render).
    "CKV_K8S_43": "image by digest",
    # IfNotPresent with immutable version tags or a digest; Always only adds a registry round trip
    # (and a registry dependency) to every pod start.
    "CKV_K8S_15": "pull policy Always",
}
# Skipped for one kind of object or render only.
SCOPED = {
    # The helm test pod runs one command to completion: probes mean nothing for it.
    ("CKV_K8S_8", "Pod.gw.nm-nm-gateway-test"): "liveness probe on the test pod",
    ("CKV_K8S_9", "Pod.gw.nm-nm-gateway-test"): "readiness probe on the test pod",
}
# NetworkPolicies are opt-in (networkPolicy.enabled): checked on the renders that enable them.
NETPOL = "CKV2_K8S_6"


def test_checkov_passes_on_every_render(tmp_path):
    assert CHECKOV and Path(CHECKOV).is_file(), "set NM_CHECKOV (helm/ci.sh installs checkov in target/checkov-venv)"
    cases = {}
    for f in CI_VALUES:
        name = case_name(f)
        cases[name] = load_values(f).get("networkPolicy", {}).get("enabled", False)
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump_all(render_case(f).manifests(), sort_keys=False))
    done = subprocess.run(
        [CHECKOV, "--directory", str(tmp_path), "--framework", "kubernetes", "--skip-download", "--output", "json", "--skip-check", ",".join(SKIP)],
        capture_output=True,
        text=True,
    )
    assert done.returncode in (0, 1), done.stderr[-2000:]
    report = json.loads(done.stdout)
    reports = report if isinstance(report, list) else [report]
    failed = [c for r in reports for c in r.get("results", {}).get("failed_checks", [])]
    passed = sum(len(r.get("results", {}).get("passed_checks", [])) for r in reports)
    assert passed > 500, f"checkov ran too few checks ({passed})"
    findings = []
    for c in failed:
        render = Path(c["file_path"]).stem
        if (c["check_id"], c["resource"]) in SCOPED:
            continue
        if c["check_id"] == NETPOL and not cases[render]:
            continue
        findings.append(f"{render}: {c['check_id']} {c['check_name']} on {c['resource']}")
    assert findings == [], "\n".join(findings)
