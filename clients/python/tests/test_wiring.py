"""Every factory returns the provider's own client, pointed at the gateway, and every request
it makes carries the attribution headers of the session in force (unit level: a stand-in
gateway records exactly what the SDKs sent; tests/test_real_gateway.py checks the real one)."""

from __future__ import annotations

from typing import Dict, List

import anthropic
import groq
import openai
import pytest
from conftest import FAKE_KEY
from google import genai
from mistral_compat import Mistral
from mock_provider import MockProvider, Received
from sdk_calls import ASYNC_CALLS, EXPECTED_TEXT, SYNC_CALLS, Call

from nm_gateway import PROVIDER_KEY_PLACEHOLDER, Gateway, current_session

CREDENTIALS = ("authorization", "x-api-key", "x-goog-api-key")


def nm_headers(rec: Received) -> Dict[str, str]:
    return {k: v for k, v in rec.headers.items() if k.startswith("nm-")}


def check_session_requests(recs: List[Received], provider: str, session_id: str, user: str) -> None:
    assert recs, "no request reached the gateway"
    for rec in recs:
        assert rec.path.startswith(f"/{provider}/"), rec.path
        assert nm_headers(rec) == {
            "nm-key": FAKE_KEY,
            "nm-agent": "unit-agent",
            "nm-env": "development",
            "nm-session": session_id,
            "nm-user": user,
        }
        # No provider key configured: the placeholder never leaves the process.
        assert not any(h in rec.headers for h in CREDENTIALS), rec.headers


@pytest.mark.parametrize("call", SYNC_CALLS, ids=lambda c: c.name)
def test_sync_clients_carry_the_session(call: Call, gw: Gateway, fake: MockProvider) -> None:
    assert call.run is not None
    with gw.session(user="user-7") as s:
        assert call.run(gw) == EXPECTED_TEXT
    recs = fake.received()
    check_session_requests(recs, call.provider, s.id, "user-7")
    assert s.last_request_id == f"req-{len(recs)}"
    assert s.last_trace_id == f"{len(recs):032x}"
    assert s.last_error_code is None


@pytest.mark.parametrize("call", ASYNC_CALLS, ids=lambda c: c.name)
async def test_async_clients_carry_the_session(call: Call, gw: Gateway, fake: MockProvider) -> None:
    assert call.arun is not None
    async with gw.session(user="user-8") as s:
        assert await call.arun(gw) == EXPECTED_TEXT
    recs = fake.received()
    check_session_requests(recs, call.provider, s.id, "user-8")
    assert s.last_request_id == f"req-{len(recs)}"


@pytest.mark.parametrize("call", SYNC_CALLS[::2], ids=lambda c: c.name)
def test_outside_a_session_no_session_header(call: Call, gw: Gateway, fake: MockProvider) -> None:
    assert call.run is not None
    assert current_session() is None
    assert call.run(gw) == EXPECTED_TEXT
    for rec in fake.received():
        assert nm_headers(rec) == {"nm-key": FAKE_KEY, "nm-agent": "unit-agent", "nm-env": "development"}


def test_factories_return_the_sdks_own_clients(gw: Gateway) -> None:
    assert type(gw.openai()) is openai.OpenAI
    assert type(gw.async_openai()) is openai.AsyncOpenAI
    assert type(gw.anthropic()) is anthropic.Anthropic
    assert type(gw.async_anthropic()) is anthropic.AsyncAnthropic
    assert type(gw.genai()) is genai.Client
    assert type(gw.groq()) is groq.Groq
    assert type(gw.async_groq()) is groq.AsyncGroq
    assert type(gw.mistral()) is Mistral
    assert str(gw.openai().base_url).rstrip("/") == gw.url + "/openai/v1"
    assert str(gw.anthropic().base_url).rstrip("/") == gw.url + "/anthropic"
    assert str(gw.groq().base_url).rstrip("/") == gw.url + "/groq"
    for name in ("openai", "anthropic", "groq"):  # the factories use what base_url() says
        assert str(getattr(gw, name)().base_url).rstrip("/") == gw.base_url(name)


def test_nested_sessions_restore_the_outer_one(gw: Gateway, fake: MockProvider) -> None:
    client = gw.openai()

    def ask() -> None:
        client.chat.completions.create(model="m", messages=[])

    with gw.session(user="outer-user") as outer:
        ask()
        with gw.session(user="inner-user", agent="inner-agent") as inner:
            ask()
            assert current_session() is not None and current_session().id == inner.id  # type: ignore[union-attr]
        ask()
    ask()
    seen = [
        (r.headers.get("nm-session"), r.headers.get("nm-user"), r.headers.get("nm-agent"))
        for r in fake.received()
    ]
    assert seen == [
        (outer.id, "outer-user", "unit-agent"),
        (inner.id, "inner-user", "inner-agent"),
        (outer.id, "outer-user", "unit-agent"),
        (None, None, "unit-agent"),
    ]
    assert outer.last_request_id == "req-3" and inner.last_request_id == "req-2"


def test_a_session_scope_is_entered_once(gw: Gateway) -> None:
    scope = gw.session()
    with scope, pytest.raises(RuntimeError, match="already entered"):
        scope.__enter__()


def test_headers_set_by_the_caller_win(gw: Gateway, fake: MockProvider) -> None:
    with gw.session(user="u1"):
        gw.openai().chat.completions.create(
            model="m", messages=[], extra_headers={"NM-Session": "sess_explicit", "NM-User": "someone"}
        )
    assert nm_headers(fake.received()[0])["nm-session"] == "sess_explicit"
    assert nm_headers(fake.received()[0])["nm-user"] == "someone"


def test_provider_credentials(gw: Gateway, fake: MockProvider, monkeypatch: pytest.MonkeyPatch) -> None:
    gw.openai(api_key="sk-mine").chat.completions.create(model="m", messages=[])
    assert fake.received()[-1].headers["authorization"] == "Bearer sk-mine"
    gw.anthropic(api_key="sk-ant-mine").messages.create(model="m", max_tokens=1, messages=[])
    # (anthropic 2.x sends its key as a bearer token, older versions as x-api-key)
    sent = fake.received()[-1].headers
    assert "sk-ant-mine" in (sent.get("x-api-key"), sent.get("authorization", "").removeprefix("Bearer "))
    gw.genai(api_key="g-mine").models.generate_content(model="gemini-2.0-flash", contents="x")
    assert fake.received()[-1].headers["x-goog-api-key"] == "g-mine"
    gw.mistral(api_key="m-mine").chat.complete(model="m", messages=MESSAGES_1)
    assert fake.received()[-1].headers["authorization"] == "Bearer m-mine"
    # The SDK's own environment variable is honoured as usual.
    monkeypatch.setenv("GROQ_API_KEY", "gsk-env")
    gw.groq().chat.completions.create(model="m", messages=[])
    assert fake.received()[-1].headers["authorization"] == "Bearer gsk-env"
    assert all(PROVIDER_KEY_PLACEHOLDER not in str(r.headers) for r in fake.received())


MESSAGES_1 = [{"role": "user", "content": "x"}]


def test_a_client_of_your_own_is_wired_too(gw: Gateway, fake: MockProvider) -> None:
    own = openai.DefaultHttpxClient()
    client = gw.openai(http_client=own)
    assert gw.wire(own, is_async=False) is own  # idempotent
    with gw.session(user="u2") as s:
        client.chat.completions.create(model="m", messages=[])
    assert [r.headers.get("nm-session") for r in fake.received()] == [s.id]
    assert len(own.event_hooks["request"]) == 1


def test_sdk_retries_carry_the_headers(gw: Gateway, fake: MockProvider) -> None:
    """The SDK's own retry (here after a 503) goes through the hook again."""
    from mock_provider import Reply

    fake.script_proxy(
        Reply(503, {"Content-Type": "application/json", "Retry-After": "0"}, b'{"error":{"message":"busy"}}')
    )
    with gw.session(user="u3") as s:
        r = gw.openai(max_retries=2).chat.completions.create(model="m", messages=[])
    assert r.choices[0].message.content == EXPECTED_TEXT
    recs = fake.received()
    assert len(recs) == 2
    assert [r.headers.get("x-stainless-retry-count") for r in recs] == ["0", "1"]
    assert {r.headers["nm-session"] for r in recs} == {s.id}
    assert s.last_request_id == "req-2"


def test_missing_sdk_says_which_extra(gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_groq(name: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name == "groq":
            raise ImportError("No module named 'groq'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_groq)
    with pytest.raises(ImportError, match=r"pip install 'nm-gateway\[groq\]'"):
        gw.groq()


def test_last_variant_is_the_last_answers(gw: Gateway, fake: MockProvider) -> None:
    with gw.session() as s:
        assert s.last_variant is None
        fake.variant = "exp-1/groq"
        gw.openai().chat.completions.create(model="m", messages=[])
        assert s.last_variant == "exp-1/groq"
        assert s.last_request_id == f"req-{len(fake.received())}"
        # An answer without the header (the request was in no experiment) clears it.
        fake.variant = None
        gw.openai().chat.completions.create(model="m", messages=[])
        assert s.last_variant is None


async def test_async_last_variant(gw: Gateway, fake: MockProvider) -> None:
    fake.variant = "exp-2/control"
    async with gw.session() as s:
        await gw.async_openai().chat.completions.create(model="m", messages=[])
        assert s.last_variant == "exp-2/control"
