"""Checks the built wheel and sdist hold exactly the right files (clients/ci.sh runs it).

Usage: check_dist.py DIST_DIR
"""

from __future__ import annotations

import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

MODULES = {
    "__init__.py",
    "_edit.py",
    "_errors.py",
    "_gateway.py",
    "_rules.py",
    "_session.py",
    "_signals.py",
    "py.typed",
}
EXTRAS = {"openai", "anthropic", "google", "groq", "mistral", "all"}


def fail(msg: str) -> None:
    sys.exit(f"check_dist: {msg}")


def main(dist: Path) -> None:
    wheels = list(dist.glob("nm_gateway-*-py3-none-any.whl"))
    sdists = list(dist.glob("nm_gateway-*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        fail(f"expected one wheel and one sdist in {dist}, found {sorted(p.name for p in dist.iterdir())}")

    with zipfile.ZipFile(wheels[0]) as whl:
        names = whl.namelist()
        package = {n.split("/", 1)[1] for n in names if n.startswith("nm_gateway/")}
        other = [n for n in names if not n.startswith(("nm_gateway/", "nm_gateway-0.1.0.dist-info/"))]
        if package != MODULES:
            fail(f"wheel package files {sorted(package)} != {sorted(MODULES)}")
        if other:
            fail(f"wheel holds unexpected files: {other}")
        meta = Parser().parsestr(whl.read("nm_gateway-0.1.0.dist-info/METADATA").decode())
    if meta["Name"] != "nm-gateway" or meta["Requires-Python"] != ">=3.9":
        fail(f"wheel metadata: Name={meta['Name']!r} Requires-Python={meta['Requires-Python']!r}")
    extras = set(meta.get_all("Provides-Extra") or [])
    if extras != EXTRAS:
        fail(f"extras {sorted(extras)} != {sorted(EXTRAS)}")
    requires = meta.get_all("Requires-Dist") or []
    if any("extra" not in r for r in requires):
        fail(f"a runtime dependency crept in: {requires}")
    if "Quick start" not in (meta.get_payload() or ""):
        fail("the README (with its quick start) is not the long description")

    with tarfile.open(sdists[0]) as sd:
        names = {n.split("/", 1)[1] for n in sd.getnames() if "/" in n}
    want = {"pyproject.toml", "README.md", "PKG-INFO", "requirements-dev.txt"}
    want |= {f"src/nm_gateway/{m}" for m in MODULES}
    missing = want - names
    if missing:
        fail(f"sdist lacks {sorted(missing)}")
    if any("__pycache__" in n or n.endswith(".pyc") for n in names):
        fail("sdist holds bytecode")
    if not any(n.startswith("tests/test_") for n in names):
        fail("sdist lacks the tests")
    print(f"check_dist: {wheels[0].name} ({len(names)} files in the sdist) ok")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
