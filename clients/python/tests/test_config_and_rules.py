"""Settings from arguments and environment, and the client-side checks of every value the
gateway would refuse (same rules, same codes as the endpoint)."""

from __future__ import annotations

import json
import re

import pytest
from conftest import FAKE_KEY
from hypothesis import given
from hypothesis import strategies as st

from nm_gateway import ConfigError, Gateway, InvalidSignal, new_session_id
from nm_gateway._signals import build_signal, parse_retry_after

# The gateway's grammar (nm-types SessionId), written out independently.
GATEWAY_SESSION = re.compile(r"sess_[A-Za-z0-9_-]{1,128}")


def test_settings_come_from_the_environment_and_arguments_win() -> None:
    env = {
        "NM_GATEWAY_URL": "http://gw.internal:8080/",
        "NM_KEY": FAKE_KEY,
        "NM_AGENT": "env-agent",
        "NM_ENV": "staging",
    }
    g = Gateway(environ=env)
    assert (g.url, g.agent, g.env) == ("http://gw.internal:8080", "env-agent", "staging")
    assert g.headers() == {"NM-Key": FAKE_KEY, "NM-Agent": "env-agent", "NM-Env": "staging"}
    g = Gateway(url="https://other/llm", key="nmk_x", agent="arg-agent", env="production", environ=env)
    assert (g.url, g.agent, g.env) == ("https://other/llm", "arg-agent", "production")
    # What each provider's SDK takes as its base URL (the SDKs are run through a real gateway
    # with these in test_real_gateway.py).
    assert {p: g.base_url(p) for p in ("openai", "xai", "anthropic", "gemini", "groq", "acme")} == {
        "openai": "https://other/llm/openai/v1",
        "xai": "https://other/llm/xai/v1",
        "anthropic": "https://other/llm/anthropic",
        "gemini": "https://other/llm/gemini",
        "groq": "https://other/llm/groq",
        "acme": "https://other/llm/acme",
    }
    for bad in ("OpenAI", "", "../x", "a/b"):
        with pytest.raises(ValueError, match="provider prefix"):
            g.base_url(bad)
    assert FAKE_KEY not in repr(g)


def test_settings_read_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NM_GATEWAY_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("NM_KEY", FAKE_KEY)
    monkeypatch.setenv("NM_AGENT", "from-os")
    g = Gateway()
    assert (g.url, g.agent, g.env) == ("http://127.0.0.1:9", "from-os", None)


@pytest.mark.parametrize(
    "env, kwargs, message",
    [
        ({}, {"key": FAKE_KEY}, "NM_GATEWAY_URL"),
        ({"NM_GATEWAY_URL": "http://gw"}, {}, "NM_KEY"),
        ({"NM_GATEWAY_URL": "gw:8080", "NM_KEY": FAKE_KEY}, {}, "NM_GATEWAY_URL: the gateway URL must be"),
        ({"NM_GATEWAY_URL": "ftp://gw", "NM_KEY": FAKE_KEY}, {}, "must be http(s)"),
        ({"NM_GATEWAY_URL": "http://gw/?x=1", "NM_KEY": FAKE_KEY}, {}, "must be http(s)"),
        ({"NM_GATEWAY_URL": "http://gw", "NM_KEY": FAKE_KEY}, {"url": "gw"}, "argument url: the gateway URL"),
        (
            {"NM_GATEWAY_URL": "http://gw", "NM_KEY": FAKE_KEY, "NM_ENV": "prod"},
            {},
            "NM_ENV: env must be one of",
        ),
        ({"NM_GATEWAY_URL": "http://gw", "NM_KEY": FAKE_KEY}, {"env": "Production"}, "argument env"),
        (
            {"NM_GATEWAY_URL": "http://gw", "NM_KEY": FAKE_KEY, "NM_AGENT": "a\nb"},
            {},
            "NM_AGENT: an agent name",
        ),
        ({"NM_GATEWAY_URL": "http://gw", "NM_KEY": FAKE_KEY}, {"agent": "x" * 129}, "agent name is 1 to 128"),
        ({"NM_GATEWAY_URL": "http://gw", "NM_KEY": FAKE_KEY}, {"agent": "café"}, "visible ASCII"),
        ({"NM_GATEWAY_URL": "http://gw", "NM_KEY": "nmk with space"}, {}, "NM_KEY: the key must be"),
        ({"NM_GATEWAY_URL": "http://gw", "NM_KEY": FAKE_KEY}, {"max_retries": -1}, "max_retries"),
        ({"NM_GATEWAY_URL": "http://gw", "NM_KEY": FAKE_KEY}, {"max_retries": True}, "max_retries"),
        ({"NM_GATEWAY_URL": "http://gw", "NM_KEY": FAKE_KEY}, {"retry_deadline": -1}, "retry_deadline"),
        (
            {"NM_GATEWAY_URL": "http://gw", "NM_KEY": FAKE_KEY},
            {"retry_deadline": float("inf")},
            "retry_deadline",
        ),
    ],
)
def test_bad_settings_name_the_setting(env: dict, kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        Gateway(environ=env, **kwargs)
    assert message in str(e.value)


def test_session_ids_follow_the_gateway_grammar(gw: Gateway) -> None:
    ids = {new_session_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(GATEWAY_SESSION.fullmatch(i) for i in ids)
    assert all(len(i) == len("sess_") + 32 for i in ids)
    with gw.session() as s:
        assert GATEWAY_SESSION.fullmatch(s.id)
    with gw.session(id="sess_my-own_1") as s:
        assert s.id == "sess_my-own_1"
    for bad in ["42", "sess_", "sess_a b", "sess_é", "SESS_x", "sess_" + "a" * 129]:
        with pytest.raises(ConfigError, match="sess_<id>"):
            gw.session(id=bad)
    with pytest.raises(ConfigError, match="end-user id"):
        gw.session(user="")
    with pytest.raises(ConfigError, match="end-user id"):
        gw.session(user="u" * 257)
    gw.session(user="u" * 256)


@given(st.text(max_size=140))
def test_session_check_agrees_with_the_gateway_grammar(text: str) -> None:
    from nm_gateway._rules import is_session_id

    assert is_session_id(text) == bool(GATEWAY_SESSION.fullmatch(text))


@pytest.mark.parametrize(
    "kwargs, code",
    [
        ({"session_id": "abc", "action": "accepted"}, "invalid_session_id"),
        ({"session_id": 42, "action": "accepted"}, "invalid_session_id"),
        ({"session_id": None, "action": "accepted"}, "missing_field"),
        ({"session_id": None, "action": "accepted", "request_id": None}, "missing_field"),
        ({"session_id": None, "action": "accepted", "request_id": "req_1"}, "invalid_field"),
        (
            {
                "session_id": "sess_1",
                "action": "accepted",
                "request_id": "01890A5D-AC96-774B-BCCE-B302099A8057",
            },
            "invalid_field",
        ),
        (
            {
                "session_id": "sess_1",
                "action": "accepted",
                "request_id": "01890a5d-ac96-474b-bcce-b302099a8057",
            },
            "invalid_field",
        ),
        (
            {"session_id": "bad", "action": "accepted", "request_id": "01890a5d-ac96-774b-bcce-b302099a8057"},
            "invalid_session_id",
        ),
        ({"session_id": "sess_1", "action": "liked"}, "invalid_action"),
        ({"session_id": "sess_1", "action": "Accepted"}, "invalid_action"),
        ({"session_id": "sess_1", "action": "edited"}, "edit_distance_required"),
        ({"session_id": "sess_1", "action": "edited", "edit_distance": -1}, "invalid_edit_distance"),
        ({"session_id": "sess_1", "action": "edited", "edit_distance": 1.5}, "invalid_edit_distance"),
        ({"session_id": "sess_1", "action": "edited", "edit_distance": "3"}, "invalid_edit_distance"),
        ({"session_id": "sess_1", "action": "edited", "edit_distance": True}, "invalid_edit_distance"),
        ({"session_id": "sess_1", "action": "edited", "edit_distance": 2**64}, "invalid_edit_distance"),
        ({"session_id": "sess_1", "action": "sent", "edit_distance": -3}, "invalid_edit_distance"),
        ({"session_id": "sess_1", "action": "sent", "custom_label": "x" * 1100}, "invalid_field"),
        ({"session_id": "sess_1", "action": "sent", "custom_label": {1, 2}}, "invalid_field"),
        ({"session_id": "sess_1", "action": "sent", "custom_label": float("nan")}, "invalid_field"),
        ({"session_id": "sess_1", "action": "sent", "idempotency_key": ""}, "invalid_field"),
        ({"session_id": "sess_1", "action": "sent", "idempotency_key": "k" * 256}, "invalid_field"),
        ({"session_id": "sess_1", "action": "sent", "idempotency_key": "ключ"}, "invalid_field"),
    ],
)
def test_invalid_signals_get_the_endpoints_code(kwargs: dict, code: str) -> None:
    with pytest.raises(InvalidSignal) as e:
        build_signal(**kwargs)
    assert e.value.code == code
    assert isinstance(e.value, ValueError)
    assert e.value.message


def test_valid_signal_bodies() -> None:
    s = build_signal("sess_1", "edited", edit_distance=0, custom_label={"variant": "B", "ü": [1, True]})
    assert json.loads(s.body) == {
        "session_id": "sess_1",
        "action": "edited",
        "edit_distance": 0,
        "custom_label": {"variant": "B", "ü": [1, True]},
    }
    assert 1 <= len(s.idempotency_key) <= 255
    assert json.loads(build_signal("sess_1", "accepted").body) == {
        "session_id": "sess_1",
        "action": "accepted",
    }
    # A label of exactly 1 KiB of JSON is allowed; the key may be 255 characters.
    build_signal("sess_1", "sent", custom_label="x" * 1022, idempotency_key="k" * 255)
    keys = {build_signal("sess_1", "sent").idempotency_key for _ in range(100)}
    assert len(keys) == 100


def test_a_signal_may_name_an_answer() -> None:
    rid = "01890a5d-ac96-774b-bcce-b302099a8057"
    s = build_signal(None, "accepted", request_id=rid)
    assert json.loads(s.body) == {"request_id": rid, "action": "accepted"}
    assert (s.session_id, s.request_id, s.about) == (None, rid, rid)
    both = build_signal("sess_1", "accepted", request_id=rid)
    assert json.loads(both.body) == {"session_id": "sess_1", "request_id": rid, "action": "accepted"}


def test_a_sessions_signal_names_its_last_answer_by_default(gw: Gateway) -> None:
    from nm_gateway import LAST_ANSWER
    from nm_gateway._session import Session, _State

    rid = "01890a5d-ac96-774b-bcce-b302099a8057"
    state = _State(gw, "sess_1", None, None)
    s = Session(state)
    assert s._answer(LAST_ANSWER) is None, "no answer yet: the session only"
    state.record(rid, None, None)
    assert s._answer(LAST_ANSWER) == rid
    assert s._answer(None) is None
    other = "01890a5d-ac96-774b-bcce-b302099a8058"
    assert s._answer(other) == other
    state.record(rid, None, "budget_exceeded")
    assert s._answer(LAST_ANSWER) is None, "a gateway-made error is no answer"
    state.record("req-1", None, None)
    assert s._answer(LAST_ANSWER) is None, "an id not of the gateway's form names nothing"


def test_edited_takes_a_distance_or_two_texts(gw: Gateway) -> None:
    with gw.session() as s:
        with pytest.raises(InvalidSignal, match="not both"):
            s.edited(3, original="a", final="b")
        with pytest.raises(InvalidSignal, match="both be given"):
            s.edited(original="a")
        with pytest.raises(InvalidSignal) as e:
            s.edited()
        assert e.value.code == "edit_distance_required"


def test_retry_after_forms() -> None:
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(" 0 ") == 0.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == 10.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412490.0) == 0.0
    assert parse_retry_after("soon") is None
    assert parse_retry_after(None) is None
