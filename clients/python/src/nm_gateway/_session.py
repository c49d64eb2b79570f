"""Session scopes: which `NM-Session` (and `NM-User`) the wired clients send right now.

The current session lives in one `contextvars.ContextVar`, so it follows the code that runs
under it and nothing else:

- `with gw.session(): ...` sets it for the block and restores the previous value on exit, so
  nested sessions come back to the outer one and never leak out.
- asyncio tasks copy the context when created: a task started inside a session keeps it, and
  concurrent tasks each see their own (`async with gw.session()` in each task).
- Threads start with an empty context, so a session never leaks into another thread by
  accident; `s.run(fn, ...)` / `s.wrap(fn)` carry it into one on purpose (e.g. through
  `executor.submit(s.run, fn, arg)`); `asyncio.to_thread` copies the context by itself.

The wired clients' request hook reads the variable on every request (retries included), and
their response hook writes the answer's `NM-Request-Id` / `NM-Trace-Id` into the session that
was current for that request.

A signal sent from a session (`s.accepted()`, ...) names, besides the session, the last answer
the session's wired clients received (its `NM-Request-Id`, as `request_id`), so the gateway
counts it for that answer's model alone; unless that answer was a gateway-made error
(`NM-Error`), or there was none yet (or its id is not of the gateway's form).
`request_id="<id>"` names another answer of the session; `request_id=None` names the session
only.
"""

from __future__ import annotations

import contextvars
import functools
import threading
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, Optional, Type, TypeVar, Union

from ._edit import edit_distance as _edit_distance
from ._errors import InvalidSignal
from ._rules import is_request_id

if TYPE_CHECKING:
    from ._gateway import Gateway

T = TypeVar("T")

__all__ = ["LAST_ANSWER", "AsyncSession", "LastAnswer", "Session", "SessionScope", "current_session"]


class LastAnswer:
    """The type of `LAST_ANSWER`: a signal's default `request_id`, the session's last answer."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "LAST_ANSWER"


#: The default `request_id` of a session's signals: the last answer the session's wired clients
#: received (none when there was none, or when it was a gateway-made error).
LAST_ANSWER = LastAnswer()

#: What a session's signal methods take as `request_id`.
RequestIdArg = Union[str, None, LastAnswer]


class _State:
    """One session's identity and what came back last. Shared by its sync and async handles."""

    __slots__ = (
        "_error",
        "_lock",
        "_request_id",
        "_trace_id",
        "_variant",
        "agent",
        "gateway",
        "id",
        "user",
    )

    def __init__(self, gateway: Gateway, id: str, user: Optional[str], agent: Optional[str]) -> None:
        self.gateway = gateway
        self.id = id
        self.user = user
        self.agent = agent
        self._lock = threading.Lock()
        self._request_id: Optional[str] = None
        self._trace_id: Optional[str] = None
        self._error: Optional[str] = None
        self._variant: Optional[str] = None

    def record(
        self,
        request_id: Optional[str],
        trace_id: Optional[str],
        error: Optional[str],
        variant: Optional[str] = None,
    ) -> None:
        with self._lock:
            self._request_id = request_id
            self._trace_id = trace_id
            self._error = error
            self._variant = variant

    def variant(self) -> Optional[str]:
        with self._lock:
            return self._variant

    def last(self) -> tuple[Optional[str], Optional[str], Optional[str]]:
        with self._lock:
            return self._request_id, self._trace_id, self._error


_CURRENT: contextvars.ContextVar[Optional[_State]] = contextvars.ContextVar(
    "nm_gateway_session", default=None
)


def current_state() -> Optional[_State]:
    return _CURRENT.get()


def current_session() -> Optional[Session]:
    """The session in force here (this thread or task), or None."""
    state = _CURRENT.get()
    return None if state is None else Session(state)


def _edited_distance(
    edit_distance: Optional[int], original: Optional[str], final: Optional[str]
) -> Optional[int]:
    if original is None and final is None:
        return edit_distance
    if edit_distance is not None:
        raise InvalidSignal(
            "invalid_edit_distance", "pass either edit_distance or original and final, not both"
        )
    if not isinstance(original, str) or not isinstance(final, str):
        raise InvalidSignal("invalid_edit_distance", "original and final must both be given, as str")
    return _edit_distance(original, final)


class _Handle:
    """What both session handles share: identity, last answer, carrying the scope along."""

    __slots__ = ("_state",)

    def __init__(self, state: _State) -> None:
        self._state = state

    @property
    def id(self) -> str:
        """The `NM-Session` value, `sess_<id>`."""
        return self._state.id

    @property
    def user(self) -> Optional[str]:
        """The `NM-User` value sent in this session, if any."""
        return self._state.user

    @property
    def agent(self) -> Optional[str]:
        """The `NM-Agent` value sent in this session, if any."""
        return self._state.agent or self._state.gateway.agent

    @property
    def last_request_id(self) -> Optional[str]:
        """`NM-Request-Id` of the last answer a wired client received in this session."""
        return self._state.last()[0]

    @property
    def last_trace_id(self) -> Optional[str]:
        """`NM-Trace-Id` of that answer (present when the gateway traces)."""
        return self._state.last()[1]

    @property
    def last_error_code(self) -> Optional[str]:
        """`NM-Error` of that answer: the gateway's own error code, None on success."""
        return self._state.last()[2]

    @property
    def last_variant(self) -> Optional[str]:
        """`NM-Variant` of that answer, `<experiment id>/<arm>`: the experiment arm that served
        it, None when the request was in no experiment."""
        return self._state.variant()

    def _answer(self, request_id: RequestIdArg) -> Optional[str]:
        """The request id a signal names: `request_id` as given, or the last answer's."""
        if not isinstance(request_id, LastAnswer):
            return request_id
        last, _, error = self._state.last()
        # The default never makes a signal fail: an id not of the gateway's form (something
        # else answered) names no answer, and the signal names the session only.
        return last if error is None and is_request_id(last) else None

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Calls `fn(*args, **kwargs)` with this session current, in the calling thread.

        For threads, which do not inherit it: `executor.submit(s.run, fn, arg)`."""
        token = _CURRENT.set(self._state)
        try:
            return fn(*args, **kwargs)
        finally:
            _CURRENT.reset(token)

    def wrap(self, fn: Callable[..., T]) -> Callable[..., T]:
        """`fn`, made to run with this session current wherever it is called."""

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> T:
            return self.run(fn, *args, **kwargs)

        return wrapped

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, user={self.user!r})"


class Session(_Handle):
    """A session, for synchronous code. Signal methods block until the signal is stored
    (or, with `background_signals=True`, only until it is queued)."""

    __slots__ = ()

    def signal(
        self,
        action: str,
        *,
        edit_distance: Optional[int] = None,
        custom_label: Any = None,
        idempotency_key: Optional[str] = None,
        request_id: RequestIdArg = LAST_ANSWER,
    ) -> None:
        """Records what the end user did with this session's output (any of the 8 actions):
        by default with the last answer's request id (`request_id=None`: the session only)."""
        self._state.gateway.signal(
            self.id,
            action,
            edit_distance=edit_distance,
            custom_label=custom_label,
            idempotency_key=idempotency_key,
            agent=self.agent,
            request_id=self._answer(request_id),
        )

    def accepted(
        self,
        *,
        custom_label: Any = None,
        idempotency_key: Optional[str] = None,
        request_id: RequestIdArg = LAST_ANSWER,
    ) -> None:
        """The user used the output without changes."""
        self.signal(
            "accepted", custom_label=custom_label, idempotency_key=idempotency_key, request_id=request_id
        )

    def edited(
        self,
        edit_distance: Optional[int] = None,
        *,
        original: Optional[str] = None,
        final: Optional[str] = None,
        custom_label: Any = None,
        idempotency_key: Optional[str] = None,
        request_id: RequestIdArg = LAST_ANSWER,
    ) -> None:
        """The user edited the output: pass `edit_distance`, or `original` and `final` (the
        library counts the characters changed)."""
        self.signal(
            "edited",
            edit_distance=_edited_distance(edit_distance, original, final),
            custom_label=custom_label,
            idempotency_key=idempotency_key,
            request_id=request_id,
        )

    def regenerated(
        self,
        *,
        custom_label: Any = None,
        idempotency_key: Optional[str] = None,
        request_id: RequestIdArg = LAST_ANSWER,
    ) -> None:
        """The user asked for another answer."""
        self.signal(
            "regenerated", custom_label=custom_label, idempotency_key=idempotency_key, request_id=request_id
        )

    def abandoned(
        self,
        *,
        custom_label: Any = None,
        idempotency_key: Optional[str] = None,
        request_id: RequestIdArg = LAST_ANSWER,
    ) -> None:
        """The user left without using the output."""
        self.signal(
            "abandoned", custom_label=custom_label, idempotency_key=idempotency_key, request_id=request_id
        )

    def thumbs_up(
        self,
        *,
        custom_label: Any = None,
        idempotency_key: Optional[str] = None,
        request_id: RequestIdArg = LAST_ANSWER,
    ) -> None:
        """Explicit positive feedback."""
        self.signal(
            "thumbs_up", custom_label=custom_label, idempotency_key=idempotency_key, request_id=request_id
        )

    def thumbs_down(
        self,
        *,
        custom_label: Any = None,
        idempotency_key: Optional[str] = None,
        request_id: RequestIdArg = LAST_ANSWER,
    ) -> None:
        """Explicit negative feedback."""
        self.signal(
            "thumbs_down", custom_label=custom_label, idempotency_key=idempotency_key, request_id=request_id
        )

    def published(
        self,
        *,
        custom_label: Any = None,
        idempotency_key: Optional[str] = None,
        request_id: RequestIdArg = LAST_ANSWER,
    ) -> None:
        """The user published the output."""
        self.signal(
            "published", custom_label=custom_label, idempotency_key=idempotency_key, request_id=request_id
        )

    def sent(
        self,
        *,
        custom_label: Any = None,
        idempotency_key: Optional[str] = None,
        request_id: RequestIdArg = LAST_ANSWER,
    ) -> None:
        """The user sent the output."""
        self.signal("sent", custom_label=custom_label, idempotency_key=idempotency_key, request_id=request_id)


class AsyncSession(_Handle):
    """A session, for asyncio code: the same methods as `Session`, as coroutines."""

    __slots__ = ()

    async def signal(
        self,
        action: str,
        *,
        edit_distance: Optional[int] = None,
        custom_label: Any = None,
        idempotency_key: Optional[str] = None,
        request_id: RequestIdArg = LAST_ANSWER,
    ) -> None:
        """Records what the end user did with this session's output (any of the 8 actions):
        by default with the last answer's request id (`request_id=None`: the session only)."""
        await self._state.gateway.asignal(
            self.id,
            action,
            edit_distance=edit_distance,
            custom_label=custom_label,
            idempotency_key=idempotency_key,
            agent=self.agent,
            request_id=self._answer(request_id),
        )

    async def accepted(
        self,
        *,
        custom_label: Any = None,
        idempotency_key: Optional[str] = None,
        request_id: RequestIdArg = LAST_ANSWER,
    ) -> None:
        """The user used the output without changes."""
        await self.signal(
            "accepted", custom_label=custom_label, idempotency_key=idempotency_key, request_id=request_id
        )

    async def edited(
        self,
        edit_distance: Optional[int] = None,
        *,
        original: Optional[str] = None,
        final: Optional[str] = None,
        custom_label: Any = None,
        idempotency_key: Optional[str] = None,
        request_id: RequestIdArg = LAST_ANSWER,
    ) -> None:
        """The user edited the output: pass `edit_distance`, or `original` and `final`."""
        await self.signal(
            "edited",
            edit_distance=_edited_distance(edit_distance, original, final),
            custom_label=custom_label,
            idempotency_key=idempotency_key,
            request_id=request_id,
        )

    async def regenerated(
        self,
        *,
        custom_label: Any = None,
        idempotency_key: Optional[str] = None,
        request_id: RequestIdArg = LAST_ANSWER,
    ) -> None:
        """The user asked for another answer."""
        await self.signal(
            "regenerated", custom_label=custom_label, idempotency_key=idempotency_key, request_id=request_id
        )

    async def abandoned(
        self,
        *,
        custom_label: Any = None,
        idempotency_key: Optional[str] = None,
        request_id: RequestIdArg = LAST_ANSWER,
    ) -> None:
        """The user left without using the output."""
        await self.signal(
            "abandoned", custom_label=custom_label, idempotency_key=idempotency_key, request_id=request_id
        )

    async def thumbs_up(
        self,
        *,
        custom_label: Any = None,
        idempotency_key: Optional[str] = None,
        request_id: RequestIdArg = LAST_ANSWER,
    ) -> None:
        """Explicit positive feedback."""
        await self.signal(
            "thumbs_up", custom_label=custom_label, idempotency_key=idempotency_key, request_id=request_id
        )

    async def thumbs_down(
        self,
        *,
        custom_label: Any = None,
        idempotency_key: Optional[str] = None,
        request_id: RequestIdArg = LAST_ANSWER,
    ) -> None:
        """Explicit negative feedback."""
        await self.signal(
            "thumbs_down", custom_label=custom_label, idempotency_key=idempotency_key, request_id=request_id
        )

    async def published(
        self,
        *,
        custom_label: Any = None,
        idempotency_key: Optional[str] = None,
        request_id: RequestIdArg = LAST_ANSWER,
    ) -> None:
        """The user published the output."""
        await self.signal(
            "published", custom_label=custom_label, idempotency_key=idempotency_key, request_id=request_id
        )

    async def sent(
        self,
        *,
        custom_label: Any = None,
        idempotency_key: Optional[str] = None,
        request_id: RequestIdArg = LAST_ANSWER,
    ) -> None:
        """The user sent the output."""
        await self.signal(
            "sent", custom_label=custom_label, idempotency_key=idempotency_key, request_id=request_id
        )


class SessionScope:
    """What `gw.session(...)` returns: enter it with `with` (a `Session`) or `async with` (an
    `AsyncSession`). Entered once; to carry it elsewhere, use the handle's `run`/`wrap`."""

    __slots__ = ("_state", "_token")

    def __init__(self, state: _State) -> None:
        self._state = state
        self._token: Optional[contextvars.Token[Optional[_State]]] = None

    @property
    def id(self) -> str:
        return self._state.id

    def _enter(self) -> None:
        if self._token is not None:
            raise RuntimeError(
                "this session scope is already entered; make a new one with gw.session(id=...), "
                "or carry the entered one into other threads with s.run(fn) / s.wrap(fn)"
            )
        self._token = _CURRENT.set(self._state)

    def _exit(self) -> None:
        token, self._token = self._token, None
        if token is not None:
            _CURRENT.reset(token)

    def __enter__(self) -> Session:
        self._enter()
        return Session(self._state)

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self._exit()

    async def __aenter__(self) -> AsyncSession:
        self._enter()
        return AsyncSession(self._state)

    async def __aexit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self._exit()
