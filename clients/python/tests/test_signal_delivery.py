"""Signals on the wire: every action, retries with one idempotency key, final errors, and the
background queue (flush, drops, report at exit). A stand-in gateway scripts the answers."""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys
import textwrap

import pytest
from conftest import FAKE_KEY
from mock_provider import MockProvider, Reply

from nm_gateway import ACTIONS, Gateway, SignalError, error_code, request_id
from nm_gateway._signals import BACKOFF_CAP_SECS, MAX_WAIT_SECS, Sender

UNAVAILABLE = Reply(
    503,
    {"Content-Type": "application/json", "NM-Error": "unavailable", "Retry-After": "0"},
    b'{"ok":false,"error":{"code":"unavailable","message":"nothing was stored"}}',
)
LIMITED = Reply(
    429,
    {"Content-Type": "application/json", "Retry-After": "0"},
    b'{"ok":false,"error":{"code":"rate_limited","message":"slow down"}}',
)


def test_every_action_from_a_session(gw: Gateway, fake: MockProvider) -> None:
    with gw.session(user="u") as s:
        s.accepted()
        s.edited(37)
        s.edited(original="Hallo Welt", final="Hallo, schöne Welt!")
        s.regenerated()
        s.abandoned()
        s.thumbs_up(custom_label={"variant": "B"})
        s.thumbs_down()
        s.published()
        s.sent(idempotency_key="my-key-1")
        s.signal("accepted", custom_label="via signal()")
    recs = fake.signals()
    bodies = [r.json() for r in recs]
    assert [b["action"] for b in bodies] == [
        "accepted",
        "edited",
        "edited",
        "regenerated",
        "abandoned",
        "thumbs_up",
        "thumbs_down",
        "published",
        "sent",
        "accepted",
    ]
    assert set(ACTIONS) == {b["action"] for b in bodies}
    assert {b["session_id"] for b in bodies} == {s.id}
    assert bodies[1]["edit_distance"] == 37
    assert bodies[2]["edit_distance"] == 9  # inserted: "," + "schöne " + "!"
    assert bodies[5]["custom_label"] == {"variant": "B"}
    assert "edit_distance" not in bodies[0] and "custom_label" not in bodies[0]
    for r in recs:
        assert r.headers["nm-key"] == FAKE_KEY
        assert r.headers["nm-agent"] == "unit-agent"
        assert r.headers["content-type"] == "application/json"
        assert "nm-session" not in r.headers  # the body names the session
    keys = [r.headers["idempotency-key"] for r in recs]
    assert len(set(keys)) == len(keys)
    assert keys[8] == "my-key-1"


async def test_every_action_from_an_async_session(gw: Gateway, fake: MockProvider) -> None:
    async with gw.session() as s:
        await s.accepted()
        await s.edited(original="kitten", final="sitting")
        await s.regenerated()
        await s.abandoned()
        await s.thumbs_up()
        await s.thumbs_down()
        await s.published()
        await s.sent()
    bodies = [r.json() for r in fake.signals()]
    assert [b["action"] for b in bodies] == list(ACTIONS)
    assert bodies[1]["edit_distance"] == 3
    await gw.asignal(s.id, "sent", custom_label=[1, 2])
    assert fake.signals()[-1].json()["custom_label"] == [1, 2]


def test_the_general_signal_call(gw: Gateway, fake: MockProvider) -> None:
    gw.signal("sess_from-elsewhere", "thumbs_up", agent="other-agent")
    rec = fake.signals()[0]
    assert rec.json() == {"session_id": "sess_from-elsewhere", "action": "thumbs_up"}
    assert rec.headers["nm-agent"] == "other-agent"


def test_retries_resend_the_same_signal_with_the_same_key(
    gw: Gateway, fake: MockProvider, caplog: pytest.LogCaptureFixture
) -> None:
    fake.script_signals(UNAVAILABLE, LIMITED)
    caplog.set_level(logging.INFO, logger="nm_gateway")
    with gw.session() as s:
        s.edited(5, custom_label={"k": 1})
    recs = fake.signals()
    assert len(recs) == 3
    assert len({r.headers["idempotency-key"] for r in recs}) == 1
    assert len({r.body for r in recs}) == 1
    retries = [r for r in caplog.records if hasattr(r, "nm_signal_retry")]
    assert [r.nm_signal_retry for r in retries] == [1, 2]  # type: ignore[attr-defined]
    assert "unavailable 503" in retries[0].getMessage()


async def test_async_retries_too(gw: Gateway, fake: MockProvider) -> None:
    fake.script_signals(UNAVAILABLE)
    async with gw.session() as s:
        await s.accepted()
    recs = fake.signals()
    assert len(recs) == 2 and recs[0].headers["idempotency-key"] == recs[1].headers["idempotency-key"]


def test_a_refusal_is_final_and_carries_the_code(gw: Gateway, fake: MockProvider) -> None:
    fake.script_signals(
        Reply(
            401,
            {"Content-Type": "application/json", "NM-Error": "invalid_api_key", "NM-Request-Id": "req-x"},
            b'{"ok":false,"error":{"code":"invalid_api_key","message":"unknown key"}}',
        )
    )
    with pytest.raises(SignalError) as e:
        gw.signal("sess_1", "accepted")
    assert (e.value.code, e.value.status, e.value.retryable) == ("invalid_api_key", 401, False)
    assert e.value.message == "unknown key"
    assert error_code(e.value) == "invalid_api_key" and request_id(e.value) == "req-x"
    assert len(fake.signals()) == 1


def test_retries_are_bounded(fake: MockProvider) -> None:
    gw = Gateway(url=fake.url, key=FAKE_KEY, max_retries=2)
    fake.script_signals(UNAVAILABLE, UNAVAILABLE, UNAVAILABLE, UNAVAILABLE)
    with pytest.raises(SignalError) as e:
        gw.signal("sess_1", "accepted")
    assert (e.value.code, e.value.status, e.value.retryable) == ("unavailable", 503, True)
    assert len(fake.signals()) == 3


def test_connection_errors_are_retried_then_reported() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    gw = Gateway(url=f"http://127.0.0.1:{port}", key=FAKE_KEY, max_retries=1, timeout=5)
    with pytest.raises(SignalError) as e:
        gw.signal("sess_1", "accepted")
    assert e.value.code == "connection_error" and e.value.retryable and e.value.status is None
    assert f"127.0.0.1:{port}" in e.value.message


def test_waits_follow_retry_after_and_are_capped() -> None:
    s = Sender("http://x", "k", timeout=1, max_retries=3)
    assert s._delay(0, 2.0) == 2.0
    assert s._delay(0, 10_000.0) == MAX_WAIT_SECS
    for attempt in range(12):
        assert 0 <= s._delay(attempt, None) <= BACKOFF_CAP_SECS


def test_the_defaults_retry_until_a_deadline_not_a_count(fake: MockProvider) -> None:
    """With the defaults, 12 unavailable answers in a row (the old default gave up after 5
    retries) are followed by a retry that is stored."""
    gw = Gateway(url=fake.url, key=FAKE_KEY)
    fake.script_signals(*[UNAVAILABLE] * 12)
    gw.signal("sess_1", "accepted")
    recs = fake.signals()
    assert len(recs) == 13 and len({r.headers["idempotency-key"] for r in recs}) == 1


@pytest.mark.parametrize("retry_deadline, attempts", [(0, 1), (0.5, 2)])
def test_retries_stop_at_the_deadline(fake: MockProvider, retry_deadline: float, attempts: int) -> None:
    """The gateway asks for 1 s each time: with a deadline of 0.5 s the one retry waits only
    until the deadline, and none follows; with 0, none is made."""
    gw = Gateway(url=fake.url, key=FAKE_KEY, retry_deadline=retry_deadline)
    busy = Reply(503, {**UNAVAILABLE.headers, "Retry-After": "1"}, UNAVAILABLE.body)
    fake.script_signals(*[busy] * 5)
    with pytest.raises(SignalError) as e:
        gw.signal("sess_1", "accepted")
    assert (e.value.code, e.value.retryable) == ("unavailable", True)
    assert f"gave up after {attempts} attempt(s)" in e.value.message
    assert len(fake.signals()) == attempts


def test_background_signals_are_queued_and_flushed(fake: MockProvider) -> None:
    gw = Gateway(url=fake.url, key=FAKE_KEY, agent="bg", background_signals=True)
    with gw.session() as s:
        for _ in range(20):
            assert s.accepted() is None
        with pytest.raises(ValueError):  # still checked at the caller's line
            s.edited()
    assert gw.flush(timeout=30)
    st = gw.signal_stats()
    assert (st.sent, st.failed, st.dropped, st.pending) == (20, 0, 0, 0)
    assert len(fake.signals()) == 20
    gw.close(timeout=5)


def test_a_full_queue_drops_and_counts(fake: MockProvider, caplog: pytest.LogCaptureFixture) -> None:
    gw = Gateway(url=fake.url, key=FAKE_KEY, background_signals=True, queue_size=2)
    fake.hold_signals()
    gw.signal("sess_1", "accepted")
    fake.wait_for_signals(1)  # the sender is busy with the first one
    for _ in range(5):
        gw.signal("sess_1", "sent")  # two fit in the queue, three are dropped
    assert gw.signal_stats().dropped == 3
    assert any("dropped" in r.getMessage() for r in caplog.records)
    fake.release_signals()
    assert gw.flush(timeout=30)
    caplog.clear()
    st = gw.close(timeout=5)
    assert (st.sent, st.dropped, st.pending) == (3, 3, 0)
    assert [r.getMessage() for r in caplog.records] == [
        "nm-gateway signals: 3 sent, 0 failed, 3 dropped (queue full), 0 unsent at close"
    ]
    assert [r.json()["action"] for r in fake.signals()] == ["accepted", "sent", "sent"]
    with pytest.raises(RuntimeError, match="closed"):
        gw.signal("sess_1", "sent")


def test_failed_background_signals_are_counted(fake: MockProvider) -> None:
    gw = Gateway(url=fake.url, key=FAKE_KEY, background_signals=True, max_retries=0)
    fake.script_signals(UNAVAILABLE)
    gw.signal("sess_1", "accepted")
    gw.signal("sess_1", "accepted")
    assert gw.flush(timeout=30)
    st = gw.close(timeout=5)
    assert (st.sent, st.failed) == (1, 1)


def test_queued_signals_are_flushed_at_exit_and_losses_reported(fake: MockProvider) -> None:
    """A process that queues signals and exits at once still delivers them; what it had to
    drop is reported on stderr at exit."""
    script = textwrap.dedent(
        f"""
        from nm_gateway import Gateway
        gw = Gateway(url={fake.url!r}, key={FAKE_KEY!r}, background_signals=True, queue_size=3)
        for i in range(3):
            gw.signal("sess_exit", "accepted", custom_label=i)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(r.json()["custom_label"] for r in fake.signals()) == [0, 1, 2]
    assert "nm-gateway signals" not in done.stderr  # nothing lost, nothing to report
    # Now overflow on purpose: the sender is held, so 10 signals cannot all fit.
    fake.hold_signals()
    script = textwrap.dedent(
        f"""
        from nm_gateway import Gateway
        gw = Gateway(url={fake.url!r}, key={FAKE_KEY!r}, background_signals=True, queue_size=2,
                     flush_timeout=0.5)
        for i in range(10):
            gw.signal("sess_exit", "sent")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    fake.release_signals()
    assert done.returncode == 0, done.stderr
    report = [line for line in done.stderr.splitlines() if "nm-gateway signals:" in line]
    assert len(report) == 1, done.stderr
    # The line the TypeScript library writes for the same loss (wiring.test.ts).
    m = re.fullmatch(
        r"nm-gateway signals: 0 sent, 0 failed, (\d+) dropped \(queue full\), (\d+) unsent at exit", report[0]
    )
    assert m is not None, report[0]
    dropped, unsent = int(m.group(1)), int(m.group(2))
    # The held sender has the first signal in flight or still queued: 10 = queued + dropped.
    assert dropped + unsent == 10 and unsent in (2, 3)
