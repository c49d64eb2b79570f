"""The chart's metadata, documentation and YAML hygiene: appVersion is the crate version, every
value is documented (`## @param`) and the README's parameter table is what
@bitnami/readme-generator-for-helm makes of values.yaml today, the YAML lints, and the packaged
chart carries its templates but not these tests."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
import tomllib
from pathlib import Path
from typing import Any

import helm_python
import yaml
from yamllint import config as yl_config
from yamllint import linter

from nmchart import CHART, REPO

README_GENERATOR = os.environ.get("NM_README_GENERATOR", "")


def test_chart_metadata():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    cargo = tomllib.loads((REPO / "Cargo.toml").read_text())
    crate = cargo["package"]["version"]
    if isinstance(crate, dict):  # version.workspace = true
        crate = cargo["workspace"]["package"]["version"]
    assert chart["apiVersion"] == "v2" and chart["type"] == "application"
    assert chart["appVersion"] == crate, "appVersion must be the nm-gateway crate version"
    assert re.fullmatch(r">=1\.\d+\.\d+-0", chart["kubeVersion"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])


def _leaves(node: Any, path: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [leaf for k, v in node.items() for leaf in _leaves(v, f"{path}.{k}" if path else k)]
    return [path]


def test_every_value_is_documented():
    text = (CHART / "values.yaml").read_text()
    documented = set(re.findall(r"^\s*## @param (\S+)", text, re.M))
    values = yaml.safe_load(text)
    missing = [leaf for leaf in _leaves(values) if leaf not in documented and not any(leaf.startswith(d + ".") for d in documented)]
    assert missing == [], f"values without a ## @param comment: {missing}"
    unknown = [d for d in documented if d not in _leaves(values) and not any(leaf.startswith(d + ".") for leaf in _leaves(values))]
    assert unknown == [], f"## @param for values that do not exist: {unknown}"


def test_readme_parameter_table_is_up_to_date(tmp_path):
    assert README_GENERATOR and Path(README_GENERATOR).is_file(), "set NM_README_GENERATOR (helm/ci.sh installs @bitnami/readme-generator-for-helm)"
    readme = tmp_path / "README.md"
    shutil.copyfile(CHART / "README.md", readme)
    done = subprocess.run([README_GENERATOR, "--values", str(CHART / "values.yaml"), "--readme", str(readme)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert readme.read_text() == (CHART / "README.md").read_text(), (
        "README.md's parameter table is stale: run helm/ci.sh --update-golden (it regenerates the table)"
    )


YAMLLINT = yl_config.YamlLintConfig(
    """
extends: default
rules:
  line-length: {max: 200}
  document-start: disable
  truthy: {allowed-values: ["true", "false"], check-keys: false}
  comments: {min-spaces-from-content: 1}
  comments-indentation: disable
"""
)
RENDERED = yl_config.YamlLintConfig(
    """
extends: default
rules:
  line-length: disable
  document-start: disable
  indentation: {indent-sequences: whatever}
"""
)


def test_yaml_lints():
    files = [CHART / "Chart.yaml", CHART / "values.yaml", *sorted((CHART / "ci").glob("*.yaml")), *sorted((CHART / "tests" / "golden").glob("*.yaml"))]
    problems = []
    for f in files:
        # Rendered output: toYaml writes block sequences unindented under their key, as Helm does.
        conf = RENDERED if f.parent.name == "golden" else YAMLLINT
        for p in linter.run(f.read_text(), conf, str(f)):
            problems.append(f"{f.relative_to(REPO)}:{p.line}:{p.column}: {p.desc} ({p.rule})")
    assert problems == []


def test_packaged_chart_has_templates_not_tests(tmp_path):
    archive = helm_python.chart.package(CHART, destination=tmp_path)
    names = tarfile.open(archive).getnames()
    assert "nm-gateway/templates/tests/test-controlplane.yaml" in names
    assert "nm-gateway/values.schema.json" in names and "nm-gateway/README.md" in names
    assert not [n for n in names if n.startswith("nm-gateway/tests/")]
