from __future__ import annotations

import os
import sys
import tempfile
from typing import Any, Iterator

import pytest
from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))

# No example database; clients/ci.sh moves Hypothesis' other files (.hypothesis/) under target/.
settings.register_profile("nm-clients", database=None, deadline=None)
settings.load_profile("nm-clients")
if os.environ.get("NM_CLIENTS_HYPOTHESIS_DIR"):
    from hypothesis.configuration import set_hypothesis_home_dir

    set_hypothesis_home_dir(os.environ["NM_CLIENTS_HYPOTHESIS_DIR"])

from harness import RealGateway  # noqa: E402
from mock_provider import MockProvider  # noqa: E402

from nm_gateway import Gateway  # noqa: E402

FAKE_KEY = "nmk_" + "0" * 48


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Any:
    rep = yield
    if rep.failed:
        item.nm_failed = True
    return rep


@pytest.fixture(autouse=True)
def _no_nm_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests see no NM_* or provider key from the machine running them."""
    for name in list(os.environ):
        if (name.startswith("NM_") and name != "NM_GATEWAY_BIN") or name.endswith("_API_KEY"):
            monkeypatch.delenv(name)


@pytest.fixture
def fake() -> Iterator[MockProvider]:
    """A stand-in gateway: records what the SDKs send it, answers like the providers."""
    with MockProvider(as_gateway=True) as m:
        yield m


@pytest.fixture
def gw(fake: MockProvider) -> Gateway:
    return Gateway(url=fake.url, key=FAKE_KEY, agent="unit-agent", env="development", max_retries=3)


@pytest.fixture(scope="session")
def upstream() -> Iterator[MockProvider]:
    """The mock provider behind the real gateway (every provider's upstream)."""
    with MockProvider() as m:
        yield m


@pytest.fixture(scope="session")
def real(upstream: MockProvider, request: Any) -> Iterator[RealGateway]:
    """`nm-gateway serve`, shared by the tests (each uses its own agent, sessions and users)."""
    with tempfile.TemporaryDirectory(prefix="nm-clients-") as d:
        g = RealGateway(d, upstream.url)
        try:
            yield g
        finally:
            g.stop()
            if any(getattr(i, "nm_failed", False) for i in request.session.items):
                print("\n" + g.logs())


@pytest.fixture
def split(upstream: MockProvider, request: Any) -> Iterator[RealGateway]:
    """`nm-gateway controlplane` + `dataplane`: the controlplane can be stopped."""
    with tempfile.TemporaryDirectory(prefix="nm-clients-split-") as d:
        g = RealGateway(d, upstream.url, split=True)
        try:
            yield g
        finally:
            g.stop()
            if getattr(request.node, "nm_failed", False):
                print("\n" + g.logs())
