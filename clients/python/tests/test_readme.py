"""The READMEs' Python code, run as a new user runs it: each block saved as a file and run by
a separate Python against a real gateway of its own, with only `NM_GATEWAY_URL` and `NM_KEY`
set (the README's `export` lines) and no provider key (the gateway adds its operator's).

The Python is `CLIENTS_QUICKSTART_PYTHON` when set (clients/ci.sh: a fresh venv holding only
the built wheel and the `openai` extra), else this one. What each block did is read back from
the gateway (requests by session, user and provider; signals by action), so a block that runs
but sends nothing, or sends it unattributed, fails too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
from harness import RealGateway, eventually
from mock_provider import MockProvider

ROOT = Path(__file__).resolve().parents[3]
PYTHON = os.environ.get("CLIENTS_QUICKSTART_PYTHON") or sys.executable
AGENT = "support-bot"


def python_blocks(doc: str, section: Optional[str]) -> List[str]:
    """The ```python blocks of `doc` (within the `## section`, when given)."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    if section is not None:
        start = text.index(f"\n## {section}\n")
        end = text.find("\n## ", start + 1)
        text = text[start : end if end != -1 else len(text)]
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


# (document, section, block index) -> what the block must leave in the gateway: requests per
# provider (all in one session, or none), the session's user, signals by action, and whether
# it prints "<session id> <request id>".
Expect = Dict[str, Any]
BLOCKS: Dict[Tuple[str, Optional[str], int], Expect] = {
    ("clients/python/README.md", None, 0): {
        "provider": "openai",
        "user": "user-7",
        "signals": {"edited": 1},
        "prints_ids": True,
    },
    ("clients/python/README.md", None, 1): {
        "provider": "xai",
        "user": None,
        "signals": {},
        "prints_ids": False,
    },
    ("README.md", "Client libraries", 0): {
        "provider": "openai",
        "user": "user-7",
        "signals": {"accepted": 1},
        "prints_ids": False,
    },
    ("docs/proxying.md", "Client libraries", 0): {
        "provider": "openai",
        "user": "user-7",
        "signals": {"accepted": 1},
        "prints_ids": False,
    },
}


def test_every_python_block_is_run_here() -> None:
    """A block added to a README must be added to BLOCKS (and so be run)."""
    for doc, section in {(d, s) for d, s, _ in BLOCKS}:
        found = len(python_blocks(doc, section))
        listed = sum(1 for d, s, _ in BLOCKS if (d, s) == (doc, section))
        assert found == listed, f"{doc} ({section or 'whole file'}): {found} python blocks, {listed} run here"


@pytest.fixture
def gateway(upstream: MockProvider) -> Iterator[RealGateway]:
    """A gateway of the block's own: the agent's counts are the block's alone."""
    with tempfile.TemporaryDirectory(prefix="nm-clients-readme-") as d:
        g = RealGateway(d, upstream.url)
        try:
            yield g
        finally:
            g.stop()


@pytest.mark.parametrize("where", list(BLOCKS), ids=lambda w: f"{w[0]}#{w[2]}")
def test_readme_block_runs_as_written(
    where: Tuple[str, Optional[str], int], gateway: RealGateway, tmp_path: Path
) -> None:
    doc, section, index = where
    want = BLOCKS[where]
    code = python_blocks(doc, section)[index]
    script = tmp_path / "quickstart.py"
    script.write_text(code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR", "SYSTEMROOT")}
    env.update(NM_GATEWAY_URL=gateway.url, NM_KEY=gateway.admin_key, XAI_API_KEY="xai-test-key")
    done = subprocess.run(
        [PYTHON, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"{doc} block {index} failed:\n{code}\n--- stderr\n{done.stderr}"

    def one_row() -> Optional[Dict[str, Any]]:
        rows = gateway.usage("session", "user", "provider", agent=AGENT)
        assert len(rows) <= 1, rows
        return rows[0] if rows else None

    row = eventually(f"the request of {doc} block {index}", one_row)
    assert (row["provider"], row["user"], row["requests"]) == (want["provider"], want["user"], 1), row
    assert str(row["session"]).startswith("sess_"), row
    if want["prints_ids"]:
        session_id, request_id = done.stdout.split()
        assert session_id == row["session"] and request_id, done.stdout
    total = sum(want["signals"].values())
    got = eventually(
        f"{total} signal(s) of {AGENT}",
        lambda: (lambda a: a if a["total"] == total else None)(gateway.agent_signals(AGENT)),
    )
    assert {k: v for k, v in got["by_action"].items() if v} == want["signals"], got
