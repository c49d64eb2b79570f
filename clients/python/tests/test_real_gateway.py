"""Against the real `nm-gateway` (NM_GATEWAY_BIN) and a mock provider: what the gateway
*recorded* (read back with `nm-gateway usage` / `agents show`) proves what the SDKs sent,
since the gateway strips every NM-* header before forwarding."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import tempfile
import threading
import time
import uuid
from typing import Any, Dict, List

import anthropic
import groq
import openai
import pytest
from google.genai import errors as genai_errors
from harness import OPERATOR_OPENAI_KEY, RealGateway, eventually
from mistralai.client import errors as mistral_errors
from mock_provider import MockProvider
from sdk_calls import ALL_CALLS, EXPECTED_TEXT

from nm_gateway import Gateway, InvalidSignal, SignalError, error_code, request_id


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def rows_for(real: RealGateway, agent: str, expected_requests: int) -> List[Dict[str, Any]]:
    """Usage rows of one agent by session/user/env/provider, once all its requests are in."""

    def ready() -> Any:
        rows = real.usage("session", "user", "agent", "env", "provider", agent=agent)
        total = sum(r["requests"] for r in rows)
        assert total <= expected_requests, rows
        return rows if total == expected_requests else None

    result: List[Dict[str, Any]] = eventually(f"{expected_requests} requests of {agent}", ready)
    return result


def signals_of(real: RealGateway, agent: str, total: int) -> Dict[str, Any]:
    def ready() -> Any:
        got = real.agent_signals(agent)
        assert got["total"] <= total, got
        return got if got["total"] == total else None

    result: Dict[str, Any] = eventually(f"{total} signals of {agent}", ready)
    return result


async def test_every_wired_sdk_is_attributed(real: RealGateway, upstream: MockProvider) -> None:
    """Each SDK call (sync, async, streamed) in its own session and user: the gateway recorded
    every request under that session, user, agent, env and provider, and the provider got no
    NM-* header and the operator's credential instead of the library's placeholder."""
    agent = unique("py-sdks")
    gw = Gateway(url=real.url, key=real.admin_key, agent=agent, env="staging")
    expected: Dict[str, Dict[str, Any]] = {}
    upstream.clear()
    for i, call in enumerate(ALL_CALLS):
        user = f"user-{i}"
        if call.run is not None:
            with gw.session(user=user) as s:
                assert await asyncio.to_thread(call.run, gw) == EXPECTED_TEXT, call.name
        else:
            assert call.arun is not None
            async with gw.session(user=user) as s:  # type: ignore[assignment]
                assert await call.arun(gw) == EXPECTED_TEXT, call.name
        assert s.last_request_id, call.name
        expected[s.id] = {"user": user, "provider": call.provider, "name": call.name}
    # One request outside any session.
    gw.openai().chat.completions.create(model="gpt-4o-mini", messages=[])

    rows = rows_for(real, agent, len(ALL_CALLS) + 1)
    by_session = {r["session"]: r for r in rows}
    for sid, want in expected.items():
        row = by_session.get(sid)
        assert row is not None, f"{want['name']}: session {sid} not recorded; rows: {rows}"
        assert (row["user"], row["agent"], row["env"], row["provider"], row["requests"]) == (
            want["user"],
            agent,
            "staging",
            want["provider"],
            1,
        ), want["name"]
    outside = [r for r in rows if r["session"] not in expected]
    assert len(outside) == 1 and outside[0]["requests"] == 1 and outside[0]["user"] is None
    assert outside[0]["session"] is None

    received = upstream.received()
    assert len(received) == len(ALL_CALLS) + 1
    for rec in received:
        assert not any(k.startswith("nm-") for k in rec.headers), rec.headers
        assert "nm-gateway-no-provider-key" not in str(rec.headers)
    openai_auth = {r.headers.get("authorization") for r in received if r.path.startswith("/v1/chat")}
    assert f"Bearer {OPERATOR_OPENAI_KEY}" in openai_auth


def test_last_request_id_is_the_gateways(real: RealGateway) -> None:
    gw = Gateway(url=real.url, key=real.admin_key, agent=unique("py-ids"))
    with gw.session() as s:
        raw = gw.openai().chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=[])
        assert s.last_request_id == raw.headers["nm-request-id"]
        assert s.last_trace_id is None  # tracing is off in this gateway
        uuid.UUID(s.last_request_id)


def test_gateway_errors_are_the_sdks_own_exceptions_with_the_code(real: RealGateway) -> None:
    bad = Gateway(url=real.url, key="nmk_" + "f" * 48, agent="py-errors")
    with bad.session() as s:
        with pytest.raises(openai.AuthenticationError) as oe:
            bad.openai(max_retries=0).chat.completions.create(model="m", messages=[])
        assert s.last_error_code == "invalid_api_key"
        with pytest.raises(anthropic.AuthenticationError) as ae:
            bad.anthropic(max_retries=0).messages.create(model="m", max_tokens=1, messages=[])
        with pytest.raises(groq.AuthenticationError) as ge:
            bad.groq(max_retries=0).chat.completions.create(model="m", messages=[])
        with pytest.raises(genai_errors.ClientError) as gm:
            bad.genai().models.generate_content(model="gemini-2.0-flash", contents="x")
        with pytest.raises(mistral_errors.MistralError) as me:
            bad.mistral().chat.complete(model="m", messages=[{"role": "user", "content": "x"}])
    for exc in (oe.value, ae.value, ge.value, gm.value, me.value):
        assert error_code(exc) == "invalid_api_key", type(exc)
        assert request_id(exc), type(exc)
    assert gm.value.code == 401
    assert error_code(ValueError("not an HTTP error")) is None

    # An error the provider itself returns has no gateway code.
    gw = Gateway(url=real.url, key=real.admin_key)
    with pytest.raises(openai.NotFoundError) as nf:
        gw.openai(max_retries=0).models.retrieve("nope")
    assert error_code(nf.value) is None and request_id(nf.value)


def test_a_rate_limit_is_the_sdks_rate_limit_error_with_the_code(real: RealGateway) -> None:
    user = unique("py-budget-user")
    before = real.metric("nm_budget_rules") or 0
    real.cli("budgets", "set", "--user", user, "--rpm", "1")
    eventually(
        "the budget rule at the dataplane",
        lambda: True if (real.metric("nm_budget_rules") or 0) > before else None,
    )
    gw = Gateway(url=real.url, key=real.admin_key, agent=unique("py-budget"))
    client = gw.openai(max_retries=0)
    with gw.session(user=user) as s:
        client.chat.completions.create(model="gpt-4o-mini", messages=[])
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(model="gpt-4o-mini", messages=[])
        assert s.last_error_code == "rate_limited"
    assert error_code(e.value) == "rate_limited"
    assert int(e.value.response.headers["retry-after"]) > 0


def test_signals_are_counted_for_the_agent(real: RealGateway) -> None:
    agent = unique("py-signals")
    gw = Gateway(url=real.url, key=real.admin_key, agent=agent, env="production")
    client = gw.openai()
    with gw.session(user="u-sig") as s:
        client.chat.completions.create(model="gpt-4o-mini", messages=[])
        s.accepted()
        s.edited(12)
        s.edited(original="Dear team, the release is ready.", final="Hi all, release ready!")
        s.regenerated()
        s.abandoned()
        s.thumbs_up(custom_label={"variant": "B"})
        s.thumbs_down()
        s.published()
        s.sent()
    gw.signal(s.id, "accepted", custom_label="general call")
    got = signals_of(real, agent, 10)
    assert got["by_action"] == {
        "accepted": 2,
        "edited": 2,
        "regenerated": 1,
        "abandoned": 1,
        "thumbs_up": 1,
        "thumbs_down": 1,
        "published": 1,
        "sent": 1,
    }


async def test_async_signals_are_counted(real: RealGateway) -> None:
    agent = unique("py-async-signals")
    gw = Gateway(url=real.url, key=real.admin_key, agent=agent)
    async with gw.session() as s:
        await gw.async_anthropic().messages.create(
            model="claude-test", max_tokens=8, messages=[{"role": "user", "content": "x"}]
        )
        await asyncio.gather(s.accepted(), s.thumbs_up(), s.edited(original="abc", final="abd"))
    got = signals_of(real, agent, 3)
    assert got["by_action"]["edited"] == 1


def test_session_signals_name_the_last_answer(real: RealGateway) -> None:
    """A session's signals carry the last answer's NM-Request-Id (`request_id`) by default; an
    explicit one, or None (the session only), overrides it; the gateway refuses an answer of
    another session with 409 session_mismatch, and counts each signal for its answer."""
    agent = unique("py-answer")
    gw = Gateway(url=real.url, key=real.admin_key, agent=agent)
    client = gw.openai()
    with gw.session() as s:
        client.chat.completions.create(model="gpt-4o-mini", messages=[])
        first = s.last_request_id
        client.chat.completions.create(model="gpt-4o-mini", messages=[])
        second = s.last_request_id
        assert first and second and first != second
        rows_for(real, agent, 2)  # both records are in: the answers are known
        s.accepted()
        s.thumbs_up(request_id=first)
        s.sent(request_id=None)
        s.edited(original="abc", final="abd", request_id=first)
    gw.signal(None, "thumbs_down", request_id=second)
    with pytest.raises(SignalError) as e:
        gw.signal("sess_" + uuid.uuid4().hex, "accepted", request_id=second)
    assert (e.value.code, e.value.status, e.value.retryable) == ("session_mismatch", 409, False)
    with pytest.raises(InvalidSignal) as bad:
        gw.signal(None, "accepted", request_id=second.upper())
    assert bad.value.code == "invalid_field"
    with pytest.raises(InvalidSignal) as none:
        gw.signal(None, "accepted")
    assert none.value.code == "missing_field"
    signals_of(real, agent, 5)
    with sqlite3.connect(f"{real.tmpdir}/nm.db") as db:
        stored = db.execute(
            "SELECT action, request_id, session_id FROM signals WHERE agent = ? ORDER BY received_at_ms, id",
            (agent,),
        ).fetchall()
    assert [(a, r) for a, r, _ in stored] == [
        ("accepted", second),
        ("thumbs_up", first),
        ("sent", None),
        ("edited", first),
        ("thumbs_down", second),
    ]
    assert {sess for _, _, sess in stored} == {s.id}, "the answer's session is learnt"


async def test_async_session_signals_name_the_last_answer(real: RealGateway) -> None:
    agent = unique("py-async-answer")
    gw = Gateway(url=real.url, key=real.admin_key, agent=agent)
    async with gw.session() as s:
        await gw.async_openai().chat.completions.create(model="gpt-4o-mini", messages=[])
        await s.accepted()
        await s.regenerated(request_id=None)
    signals_of(real, agent, 2)
    with sqlite3.connect(f"{real.tmpdir}/nm.db") as db:
        stored = db.execute(
            "SELECT action, request_id FROM signals WHERE agent = ? ORDER BY received_at_ms, id", (agent,)
        ).fetchall()
    assert stored == [("accepted", s.last_request_id), ("regenerated", None)]


def test_server_side_refusals_surface_with_their_code(real: RealGateway) -> None:
    bad = Gateway(url=real.url, key="nmk_" + "e" * 48)
    with pytest.raises(SignalError) as e:
        bad.signal("sess_1", "accepted")
    assert (e.value.code, e.value.status, e.value.retryable) == ("invalid_api_key", 401, False)
    assert e.value.request_id


def test_the_same_idempotency_key_counts_once(real: RealGateway) -> None:
    """A resend of a signal whose answer was lost (same key) is acknowledged and counted once."""
    agent = unique("py-idem")
    gw = Gateway(url=real.url, key=real.admin_key, agent=agent)
    key = "idem-" + uuid.uuid4().hex
    with gw.session() as s:
        gw.openai().chat.completions.create(model="gpt-4o-mini", messages=[])
        s.accepted(idempotency_key=key)
        s.accepted(idempotency_key=key)
        s.sent()
    got = signals_of(real, agent, 2)
    assert got["by_action"]["accepted"] == 1 and got["by_action"]["sent"] == 1


def test_concurrent_sessions_in_threads_and_tasks_do_not_mix(real: RealGateway) -> None:
    agent = unique("py-concurrent")
    gw = Gateway(url=real.url, key=real.admin_key, agent=agent)
    sync_client = gw.openai()
    async_client = gw.async_anthropic()
    n, calls = 6, 3
    barrier = threading.Barrier(n)
    ids: Dict[str, str] = {}
    lock = threading.Lock()

    def thread(i: int) -> None:
        with gw.session(user=f"thread-{i}") as s:
            with lock:
                ids[s.id] = f"thread-{i}"
            barrier.wait(timeout=30)
            for _ in range(calls):
                sync_client.chat.completions.create(model="gpt-4o-mini", messages=[])

    async def tasks() -> None:
        open_count = 0
        all_open = asyncio.Event()

        async def task(i: int) -> None:
            nonlocal open_count
            async with gw.session(user=f"task-{i}") as s:
                ids[s.id] = f"task-{i}"
                open_count += 1
                if open_count == n:
                    all_open.set()
                await all_open.wait()
                for _ in range(calls):
                    await async_client.messages.create(
                        model="claude-test", max_tokens=8, messages=[{"role": "user", "content": "x"}]
                    )

        await asyncio.gather(*(task(i) for i in range(n)))

    threads = [threading.Thread(target=thread, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    asyncio.run(tasks())  # the tasks run while the threads do
    for t in threads:
        t.join(timeout=60)

    rows = rows_for(real, agent, 2 * n * calls)
    assert len(rows) == 2 * n
    for row in rows:
        assert ids.get(row["session"]) == row["user"], row
        assert row["requests"] == calls
        assert row["provider"] == ("openai" if row["user"].startswith("thread") else "anthropic")


class _FirstRetry(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.seen = threading.Event()
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "nm_signal_retry"):
            self.messages.append(record.getMessage())
            self.seen.set()


def test_retried_through_a_controlplane_outage_and_counted_once(split: RealGateway) -> None:
    """The controlplane stops: the gateway answers 503 `unavailable` with Retry-After; the
    library waits and resends with the same idempotency key until the restarted controlplane
    stores it; it is counted once. The background queue rides out the same outage."""
    agent = unique("py-outage")
    gw = Gateway(url=split.url, key=split.admin_key, agent=agent)  # the default retries
    bg = Gateway(url=split.url, key=split.admin_key, agent=agent, background_signals=True)
    with gw.session() as s:
        gw.openai().chat.completions.create(model="gpt-4o-mini", messages=[])
    rows_for(split, agent, 1)  # the session is known to the controlplane

    watcher = _FirstRetry()
    log = logging.getLogger("nm_gateway")
    log.addHandler(watcher)
    old_level = log.level
    log.setLevel(logging.INFO)
    errors: List[BaseException] = []
    try:
        split.stop_controlplane()

        def send() -> None:
            try:
                s.edited(original="draft", final="drafted")
            except BaseException as e:  # reported below
                errors.append(e)

        sender = threading.Thread(target=send)
        sender.start()
        assert watcher.seen.wait(30), "the library never retried"
        bg.signal(s.id, "sent")  # queued while the controlplane is away
        split.start_controlplane()
        sender.join(timeout=120)
        assert not sender.is_alive() and not errors, errors
        assert bg.flush(timeout=120)
    finally:
        log.removeHandler(watcher)
        log.setLevel(old_level)
    assert "(unavailable 503)" in watcher.messages[0]
    assert bg.close(timeout=5).sent == 1
    got = signals_of(split, agent, 2)
    assert got["by_action"]["edited"] == 1 and got["by_action"]["sent"] == 1


#: How long the gateway stays away in the restart test: the README promises the defaults ride
#: out a restart of a minute.
OUTAGE_SECS = 60.0


def test_the_defaults_ride_out_a_gateway_restart_of_a_minute(upstream: MockProvider) -> None:
    """The whole gateway (`serve`) stops for a minute, then starts again on the same address
    and database. A foreground signal sent with the default settings keeps retrying through
    the outage (connection refused), is still waiting when the minute is over, and is stored
    once when the gateway is back."""
    with tempfile.TemporaryDirectory(prefix="nm-clients-restart-") as d:
        g = RealGateway(d, upstream.url)
        watcher = _FirstRetry()
        log = logging.getLogger("nm_gateway")
        log.addHandler(watcher)
        old_level = log.level
        log.setLevel(logging.INFO)
        try:
            agent = unique("py-restart")
            gw = Gateway(url=g.url, key=g.admin_key, agent=agent)  # nothing about retries
            with gw.session() as s:
                gw.openai().chat.completions.create(model="gpt-4o-mini", messages=[])
            rows_for(g, agent, 1)  # the session is known to the controlplane

            g.stop_serve()
            errors: List[BaseException] = []

            def send() -> None:
                try:
                    s.accepted()
                except BaseException as e:  # reported below
                    errors.append(e)

            sender = threading.Thread(target=send)
            sender.start()
            assert watcher.seen.wait(30), "the library never retried"
            assert "(connection_error)" in watcher.messages[0], watcher.messages[0]
            time.sleep(OUTAGE_SECS)  # not a synchronisation: the outage's length
            assert sender.is_alive(), f"gave up within the outage: {errors}"
            g.start_serve()
            sender.join(timeout=120)
            assert not sender.is_alive() and not errors, errors
            assert len(watcher.messages) > 5, "more retries than the old default's 5"
            got = signals_of(g, agent, 1)
            assert got["by_action"]["accepted"] == 1
        except BaseException:
            print("\n" + g.logs())
            raise
        finally:
            log.removeHandler(watcher)
            log.setLevel(old_level)
            g.stop()


#: The path the provider's real API has under the gateway's base for it (the gateway's bases:
#: api.openai.com, api.anthropic.com, generativelanguage.googleapis.com, api.groq.com,
#: api.mistral.ai, api.deepseek.com, api.x.ai, api.together.xyz, api.fireworks.ai/inference,
#: openrouter.ai/api), for the call each SDK makes below.
NATIVE_PATHS = {
    "openai": "/v1/chat/completions",
    "anthropic": "/v1/messages",
    "gemini": "/v1/models/gemini-2.0-flash:generateContent",  # google-genai 3.x: API v1 by default
    "groq": "/openai/v1/chat/completions",
    "mistral": "/v1/chat/completions",
    "deepseek": "/v1/chat/completions",
    "xai": "/v1/chat/completions",
    "together": "/v1/chat/completions",
    "fireworks": "/v1/chat/completions",
    "openrouter": "/v1/chat/completions",
}


def test_base_url_is_what_each_providers_sdk_takes(real: RealGateway, upstream: MockProvider) -> None:
    """Each provider's SDK built by hand with `base_url=gw.base_url(provider)` (the OpenAI SDK
    for OpenAI and the OpenAI-compatible providers) reaches the provider's native path through
    the gateway, and the gateway records the request under that provider."""
    from google import genai
    from mistralai.client import Mistral

    agent = unique("py-base-url")
    gw = Gateway(url=real.url, key=real.admin_key, agent=agent)
    msgs: Any = [{"role": "user", "content": "Hi"}]

    def stainless(module: Any, cls: Any, provider: str) -> Any:
        hooks = module.DefaultHttpxClient(event_hooks=gw.event_hooks(is_async=False))
        return cls(base_url=gw.base_url(provider), api_key="sk-test", http_client=hooks, max_retries=0)

    upstream.clear()
    for p in ("openai", "deepseek", "xai", "together", "fireworks", "openrouter"):
        r = stainless(openai, openai.OpenAI, p).chat.completions.create(model="m", messages=msgs)
        assert r.choices[0].message.content, p
    stainless(anthropic, anthropic.Anthropic, "anthropic").messages.create(
        model="claude-test", max_tokens=8, messages=msgs
    )
    stainless(groq, groq.Groq, "groq").chat.completions.create(model="m", messages=msgs)
    g = genai.Client(
        api_key="g-test", http_options={"base_url": gw.base_url("gemini"), "headers": gw.headers()}
    )
    assert g.models.generate_content(model="gemini-2.0-flash", contents="Hi").text
    m = Mistral(api_key="m-test", server_url=gw.base_url("mistral"))
    gw.wire(m.sdk_configuration.client, is_async=False)
    m.chat.complete(model="m", messages=msgs)

    assert sorted(r.path for r in upstream.received()) == sorted(NATIVE_PATHS.values())
    rows = rows_for(real, agent, len(NATIVE_PATHS))
    assert sorted(r["provider"] for r in rows) == sorted(NATIVE_PATHS)
