"""`POST /v1/signal`: checked here, sent with an idempotency key, retried when that is safe.

Lifecycle of one signal:

1. `build_signal` checks every field by the endpoint's rules and raises `InvalidSignal` (with
   the code the endpoint would answer) at the caller's line; nothing invalid is ever sent.
   The body is serialized once, and one `Idempotency-Key` is drawn for it.
2. `Sender.send` posts it. 200 `{"ok": true}` means the controlplane committed it. 503
   `unavailable`, 429 and connection errors (refused, reset, timed out) are retried with the
   same body and the same key, so a retry of a signal that was in fact stored is acknowledged
   again and counted once. The wait is the answer's `Retry-After` when it gives one, else an
   exponential backoff with full jitter (at most `BACKOFF_CAP_SECS`); every wait is capped
   (`MAX_WAIT_SECS`). What bounds the retries is time: none starts later than
   `retry_deadline` seconds (default 90) after the first attempt, so the default rides out a
   gateway restart of a minute, and a call returns within `retry_deadline + timeout`;
   `max_retries`, when set, also bounds their number. Any other answer is final and raises
   `SignalError` with its code.
3. In background mode (`SignalQueue`), the caller only runs step 1 and enqueues; one daemon
   thread sends in order. The queue is bounded: when full, the signal is dropped and counted
   (never blocks the caller). At interpreter exit the queue is flushed for up to
   `flush_timeout` seconds, then what was dropped, failed or left unsent is reported on the
   `nm_gateway` logger.

The transport is the standard library's `urllib`: signals are small JSON posts, so a
dependency-free sender avoids pinning an HTTP library beside the SDKs' own (httpx or httpx2,
depending on the SDK and its version); async callers run it in a worker thread.
"""

from __future__ import annotations

import asyncio
import atexit
import email.utils
import http.client
import json
import logging
import queue
import random
import threading
import time
import urllib.error
import urllib.request
import uuid
import weakref
from dataclasses import dataclass, replace
from typing import Any, Dict, Optional, Protocol

from ._errors import InvalidSignal, SignalError
from ._rules import (
    ACTIONS,
    EDIT_DISTANCE_REQUIRED,
    MAX_CUSTOM_LABEL_BYTES,
    MAX_EDIT_DISTANCE,
    MAX_IDEMPOTENCY_KEY_LEN,
    REQUEST_ID_RULE,
    SESSION_RULE,
    is_request_id,
    is_session_id,
    printable,
)

log = logging.getLogger("nm_gateway")

MAX_WAIT_SECS = 30.0
BACKOFF_BASE_SECS = 0.25
BACKOFF_CAP_SECS = 5.0
#: No retry starts later than this after a signal's first attempt (unless set otherwise):
#: longer than a gateway restart of a minute.
DEFAULT_RETRY_DEADLINE_SECS = 90.0
RETRY_STATUSES = (429, 503)
USER_AGENT = "nm-gateway-python/0.1.0"
#: The one line that reports background signals lost (at `close()` or at exit).
LOSS_REPORT = (
    "nm-gateway signals: {st.sent} sent, {st.failed} failed, {st.dropped} dropped (queue full), "
    "{st.pending} unsent at {at}"
)


@dataclass(frozen=True)
class Signal:
    """A checked signal, ready to send (and to resend unchanged)."""

    #: The session named, or None when the signal names only an answer.
    session_id: Optional[str]
    action: str
    body: bytes
    idempotency_key: str
    agent: Optional[str]
    #: The answer named (its NM-Request-Id), if any.
    request_id: Optional[str] = None

    @property
    def about(self) -> str:
        """What the signal is about, for log lines."""
        return self.request_id or self.session_id or "?"


@dataclass(frozen=True)
class SignalStats:
    """Background-mode counters since the gateway object was made."""

    sent: int
    failed: int
    dropped: int
    pending: int


def build_signal(
    session_id: object,
    action: object,
    *,
    edit_distance: object = None,
    custom_label: object = None,
    idempotency_key: object = None,
    agent: Optional[str] = None,
    request_id: object = None,
) -> Signal:
    """Checks a signal by the endpoint's rules; raises `InvalidSignal` on the first broken one.
    It names a session, an answer (`request_id`: that answer's `NM-Request-Id`), or both."""
    if session_id is None and request_id is None:
        raise InvalidSignal(
            "missing_field", "a signal names a session (session_id) or an answer (request_id), or both"
        )
    if session_id is not None and not is_session_id(session_id):
        raise InvalidSignal("invalid_session_id", f"{SESSION_RULE}; got {session_id!r}")
    if request_id is not None and not is_request_id(request_id):
        raise InvalidSignal("invalid_field", f"{REQUEST_ID_RULE}; got {request_id!r}")
    assert session_id is None or isinstance(session_id, str)
    assert request_id is None or isinstance(request_id, str)
    if not isinstance(action, str) or action not in ACTIONS:
        raise InvalidSignal("invalid_action", f"action must be one of {', '.join(ACTIONS)}; got {action!r}")
    if edit_distance is not None and (
        isinstance(edit_distance, bool)
        or not isinstance(edit_distance, int)
        or not 0 <= edit_distance <= MAX_EDIT_DISTANCE
    ):
        raise InvalidSignal(
            "invalid_edit_distance",
            f"edit_distance must be a non-negative integer (characters changed); got {edit_distance!r}",
        )
    if action in EDIT_DISTANCE_REQUIRED and edit_distance is None:
        raise InvalidSignal(
            "edit_distance_required",
            f"edit_distance is required when action is {action}: pass edit_distance=N, "
            "or original=... and final=... to have it computed",
        )
    body: Dict[str, Any] = {}
    if session_id is not None:
        body["session_id"] = session_id
    if request_id is not None:
        body["request_id"] = request_id
    body["action"] = action
    if edit_distance is not None:
        body["edit_distance"] = edit_distance
    if custom_label is not None:
        try:
            label = json.dumps(custom_label, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        except (TypeError, ValueError) as e:
            raise InvalidSignal(
                "invalid_field", f"custom_label must be a JSON value (dict, list, str, number, bool): {e}"
            ) from None
        size = len(label.encode("utf-8"))
        if size > MAX_CUSTOM_LABEL_BYTES:
            raise InvalidSignal(
                "invalid_field",
                f"custom_label must be at most {MAX_CUSTOM_LABEL_BYTES} bytes of JSON; got {size}",
            )
        body["custom_label"] = custom_label
    if idempotency_key is None:
        idempotency_key = "sig_" + uuid.uuid4().hex
    elif not printable(idempotency_key, MAX_IDEMPOTENCY_KEY_LEN):
        raise InvalidSignal(
            "invalid_field",
            f"idempotency_key must be 1 to {MAX_IDEMPOTENCY_KEY_LEN} visible ASCII characters, "
            f"without surrounding spaces; got {idempotency_key!r}",
        )
    assert isinstance(idempotency_key, str)
    data = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return Signal(
        session_id=session_id,
        action=action,
        body=data.encode("utf-8"),
        idempotency_key=idempotency_key,
        agent=agent,
        request_id=request_id,
    )


@dataclass(frozen=True)
class _Outcome:
    ok: bool
    retryable: bool = False
    status: Optional[int] = None
    code: str = ""
    message: str = ""
    retry_after: Optional[float] = None
    request_id: Optional[str] = None

    def error(self) -> SignalError:
        return SignalError(
            self.code,
            self.message,
            status=self.status,
            retryable=self.retryable,
            request_id=self.request_id,
        )


def parse_retry_after(value: Optional[str], now: Optional[float] = None) -> Optional[float]:
    """`Retry-After` as seconds from now: delta-seconds or an HTTP-date (RFC 9110 §10.2.3)."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class Sender:
    """Posts signals to one gateway, with retries."""

    def __init__(
        self,
        url: str,
        key: str,
        *,
        timeout: float,
        max_retries: Optional[int] = None,
        retry_deadline: float = DEFAULT_RETRY_DEADLINE_SECS,
    ) -> None:
        self._endpoint = url + "/v1/signal"
        self._key = key
        self._timeout = timeout
        self.max_retries = max_retries
        self.retry_deadline = retry_deadline
        self._rng = random.Random()

    def _attempt(self, sig: Signal) -> _Outcome:
        headers = {
            "NM-Key": self._key,
            "Content-Type": "application/json",
            "Idempotency-Key": sig.idempotency_key,
            "User-Agent": USER_AGENT,
        }
        if sig.agent is not None:
            headers["NM-Agent"] = sig.agent
        req = urllib.request.Request(self._endpoint, data=sig.body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self._timeout) as resp:
                return _answer(resp.status, resp.headers, resp.read())
        except urllib.error.HTTPError as e:
            with e:
                return _answer(e.code, e.headers, e.read())
        except (OSError, http.client.HTTPException) as e:
            # Refused, reset, timed out, closed early: nothing says it was stored, and the
            # idempotency key makes a resend safe either way.
            reason = getattr(e, "reason", None) or e
            return _Outcome(
                ok=False,
                retryable=True,
                code="connection_error",
                message=f"could not reach {self._endpoint}: {reason}",
            )

    def _delay(self, attempt: int, retry_after: Optional[float]) -> float:
        if retry_after is not None:
            return min(retry_after, MAX_WAIT_SECS)
        return self._rng.uniform(0, min(BACKOFF_CAP_SECS, BACKOFF_BASE_SECS * 2**attempt))

    def _next_wait(self, sig: Signal, attempt: int, out: _Outcome, started: float) -> Optional[float]:
        """How long to wait before retry `attempt + 1` (the retry is logged), or None to give up."""
        if not out.retryable:
            return None
        if self.max_retries is not None and attempt >= self.max_retries:
            return None
        elapsed = time.monotonic() - started
        left = self.retry_deadline - elapsed
        if left <= 0:
            return None
        delay = min(self._delay(attempt, out.retry_after), left)
        log.info(
            "signal %s for %s not stored (%s%s), retry %d in %.2fs (retries until %.0fs after the first)",
            sig.action,
            sig.about,
            out.code,
            f" {out.status}" if out.status else "",
            attempt + 1,
            delay,
            self.retry_deadline,
            extra={"nm_signal_retry": attempt + 1, "nm_idempotency_key": sig.idempotency_key},
        )
        return delay

    def _give_up(self, out: _Outcome, attempts: int, started: float) -> SignalError:
        if not out.retryable:
            return out.error()
        took = time.monotonic() - started
        return replace(
            out, message=f"{out.message} (gave up after {attempts} attempt(s) in {took:.1f}s)"
        ).error()

    def send(self, sig: Signal) -> None:
        """Sends until stored; raises `SignalError` on a final answer or when retries run out."""
        started = time.monotonic()
        attempt = 0
        while True:
            out = self._attempt(sig)
            if out.ok:
                return
            delay = self._next_wait(sig, attempt, out, started)
            if delay is None:
                raise self._give_up(out, attempt + 1, started)
            time.sleep(delay)
            attempt += 1

    async def send_async(self, sig: Signal) -> None:
        """`send` for asyncio: the blocking post runs in a worker thread, waits are async."""
        started = time.monotonic()
        attempt = 0
        while True:
            out = await asyncio.get_running_loop().run_in_executor(None, self._attempt, sig)
            if out.ok:
                return
            delay = self._next_wait(sig, attempt, out, started)
            if delay is None:
                raise self._give_up(out, attempt + 1, started)
            await asyncio.sleep(delay)
            attempt += 1


class _Headers(Protocol):
    def get(self, name: str) -> Optional[str]: ...


def _answer(status: int, headers: _Headers, raw: bytes) -> _Outcome:
    request_id = headers.get("NM-Request-Id")
    if status == 200:
        return _Outcome(ok=True, status=status, request_id=request_id)
    code = headers.get("NM-Error") or ""
    message = ""
    try:
        err = json.loads(raw.decode("utf-8")).get("error") or {}
        code = code or str(err.get("code") or "")
        message = str(err.get("message") or "")
    except (ValueError, AttributeError, UnicodeDecodeError):
        pass
    return _Outcome(
        ok=False,
        retryable=status in RETRY_STATUSES,
        status=status,
        code=code or f"http_{status}",
        message=message or f"the gateway answered {status}",
        retry_after=parse_retry_after(headers.get("Retry-After")),
        request_id=request_id,
    )


# === background mode ===


class SignalQueue:
    """A bounded queue and one daemon thread that sends what is put in it, in order."""

    def __init__(self, sender: Sender, *, maxsize: int, flush_timeout: float) -> None:
        if maxsize < 1:
            raise ValueError("queue_size must be at least 1")
        self._sender = sender
        self._queue: queue.Queue[Signal] = queue.Queue(maxsize)
        self._flush_timeout = flush_timeout
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._sent = 0
        self._failed = 0
        self._dropped = 0
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        ref = weakref.ref(self)
        atexit.register(_flush_at_exit, ref)

    def put(self, sig: Signal) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the gateway's signal queue is closed")
            try:
                self._queue.put_nowait(sig)
            except queue.Full:
                self._dropped += 1
                dropped = self._dropped
            else:
                self._pending += 1
                dropped = 0
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="nm-gateway-signals", daemon=True)
                    self._thread.start()
        if dropped and dropped & (dropped - 1) == 0:  # 1, 2, 4, 8, ...: say so, not flood
            log.warning("signal queue full (%d): %d signal(s) dropped so far", self._queue.maxsize, dropped)

    def _run(self) -> None:
        while True:
            sig = self._queue.get()
            ok = False
            try:
                self._sender.send(sig)
                ok = True
            except SignalError as e:
                log.warning("signal %s for %s not stored: %s", sig.action, sig.about, e)
            except Exception:  # a bug must not kill the sender thread
                log.exception("signal %s for %s: unexpected error", sig.action, sig.about)
            with self._lock:
                self._pending -= 1
                if ok:
                    self._sent += 1
                else:
                    self._failed += 1
                if self._pending == 0:
                    self._idle.notify_all()

    def flush(self, timeout: Optional[float]) -> bool:
        """Waits until every queued signal was sent or failed; False if `timeout` ran out."""
        with self._lock:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def stats(self) -> SignalStats:
        with self._lock:
            return SignalStats(self._sent, self._failed, self._dropped, self._pending)

    def close(self, timeout: Optional[float], *, at: str = "close") -> SignalStats:
        """Flushes, stops taking signals and reports losses once (`at`: "close" or "exit")."""
        flushed = self.flush(timeout)
        with self._lock:
            already = self._closed
            self._closed = True
        st = self.stats()
        if not already and (st.dropped or st.failed or not flushed):
            # Worded as the TypeScript library's report (clients/typescript/src/signals.ts).
            log.warning(LOSS_REPORT.format(st=st, at=at))
        return st

    def flush_at_exit(self) -> None:
        self.close(self._flush_timeout, at="exit")


def _flush_at_exit(ref: weakref.ref[SignalQueue]) -> None:
    q = ref()
    if q is not None:
        q.flush_at_exit()
