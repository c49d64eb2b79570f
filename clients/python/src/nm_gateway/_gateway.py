"""`Gateway`: the settings, the pre-wired SDK clients, sessions and signals.

How a wired client is made: the provider's own client class, with its base URL pointed at
`<gateway>/<provider prefix>` and two hooks installed on its HTTP client (httpx or httpx2,
whichever that SDK uses; the hooks only touch `request.headers` / `response.headers`, so they
fit both):

- request hook: adds `NM-Key`, `NM-Agent`, `NM-Env`, and under a session `NM-Session` and
  `NM-User`, read at send time (so SDK retries carry them too). A header the caller set
  explicitly (`extra_headers`) wins. It also drops the placeholder provider credential (see
  below), so the gateway adds the operator's `NM_PROVIDER_KEY_<PROVIDER>`.
- response hook: stores the answer's `NM-Request-Id`, `NM-Trace-Id` and `NM-Error` in the
  session current for that request.

Provider credentials: an `api_key` argument, else the SDK's own environment variable
(`OPENAI_API_KEY`, ...), is sent to the provider as usual. Without either, the SDKs would
refuse to start, so they get a placeholder that the request hook removes: the request goes
without a provider credential and the gateway injects the one its operator configured.

Everything the SDK does (streaming, tools, retries, timeouts, typed errors) is untouched.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple

from ._errors import ConfigError
from ._rules import (
    check_agent,
    check_env,
    check_session_id,
    check_user,
    new_session_id,
    printable,
)
from ._session import SessionScope, _State, current_state
from ._signals import DEFAULT_RETRY_DEADLINE_SECS, Sender, SignalQueue, SignalStats, build_signal

if TYPE_CHECKING:
    import anthropic as _anthropic
    import groq as _groq
    import openai as _openai
    from google import genai as _google_genai
    from mistralai.client import Mistral as _Mistral

__all__ = ["PROVIDER_KEY_PLACEHOLDER", "Gateway"]

#: Sent as the provider API key when none is configured; removed by the request hook.
PROVIDER_KEY_PLACEHOLDER = "nm-gateway-no-provider-key"
_CREDENTIAL_HEADERS = ("authorization", "x-api-key", "x-goog-api-key")
_HOOKED = "_nm_gateway_hooked"
_PROVIDER_RE = re.compile(r"[a-z0-9][a-z0-9_-]*")
# What a provider's SDK expects after the gateway's prefix. The OpenAI SDK takes a base URL
# that ends in the API version and appends `/chat/completions`; the OpenAI-compatible
# built-ins are used through it (their docs: api.x.ai/v1, api.together.xyz/v1,
# api.fireworks.ai/inference/v1, openrouter.ai/api/v1, api.deepseek.com/v1; the gateway's
# bases for them end before `/v1`). Anthropic's, Google's, Groq's and Mistral's SDKs append
# their own version path (`/v1/messages`, `/v1beta/models/...`, `/openai/v1/...`,
# `/v1/chat/completions`), so theirs is the bare prefix; so is a provider of your own.
_SDK_PATHS = {p: "/v1" for p in ("openai", "deepseek", "xai", "together", "fireworks", "openrouter")}


def _missing(extra: str, module: str) -> ImportError:
    return ImportError(f"the {module!r} package is not installed: pip install 'nm-gateway[{extra}]'")


class Gateway:
    """The gateway's address and this application's identity, set once.

    Every argument falls back to an environment variable: `url` to `NM_GATEWAY_URL`, `key`
    to `NM_KEY`, `agent` to `NM_AGENT`, `env` to `NM_ENV`. `url` and `key` are required.

    Signals: `timeout` per attempt (seconds); transient failures are retried until
    `retry_deadline` seconds after the first attempt (default 90: a gateway restart of a
    minute is ridden out), and at most `max_retries` times when set (default: no count).
    `background_signals=True` makes signal calls only check and queue (at most `queue_size`;
    beyond it they are dropped and counted); a daemon thread sends them, and they are flushed
    at interpreter exit for up to `flush_timeout` seconds. `environ` replaces `os.environ` as
    the source of the `NM_*` variables.
    """

    def __init__(
        self,
        url: Optional[str] = None,
        key: Optional[str] = None,
        *,
        agent: Optional[str] = None,
        env: Optional[str] = None,
        timeout: float = 10.0,
        max_retries: Optional[int] = None,
        retry_deadline: float = DEFAULT_RETRY_DEADLINE_SECS,
        background_signals: bool = False,
        queue_size: int = 10_000,
        flush_timeout: float = 10.0,
        environ: Optional[Mapping[str, str]] = None,
    ) -> None:
        environ = os.environ if environ is None else environ

        def pick(arg: Optional[str], name: str, argument: str) -> Tuple[Optional[str], str]:
            if arg is not None:
                return arg, f"argument {argument}"
            value = environ.get(name)
            return (value if value else None), name

        raw_url, url_src = pick(url, "NM_GATEWAY_URL", "url")
        if raw_url is None:
            raise ConfigError(
                "no gateway URL: pass url=... or set NM_GATEWAY_URL (e.g. http://localhost:8080)"
            )
        raw_url = raw_url.strip().rstrip("/")
        scheme, sep, rest = raw_url.partition("://")
        bad_url = not sep or scheme.lower() not in ("http", "https") or not rest
        if bad_url or rest.startswith("/") or "?" in rest or "#" in rest:
            raise ConfigError(
                f"{url_src}: the gateway URL must be http(s)://host[:port][/path]; got {raw_url!r}"
            )
        raw_key, key_src = pick(key, "NM_KEY", "key")
        if raw_key is None:
            raise ConfigError("no NM-Key: pass key=... or set NM_KEY (a service API key, nmk_...)")
        if not printable(raw_key, 1024) or " " in raw_key:
            raise ConfigError(f"{key_src}: the key must be visible ASCII without spaces")
        agent, agent_src = pick(agent, "NM_AGENT", "agent")
        env, env_src = pick(env, "NM_ENV", "env")
        if max_retries is not None and (
            isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0
        ):
            raise ConfigError(f"max_retries must be None or a non-negative integer; got {max_retries!r}")
        if (
            isinstance(retry_deadline, bool)
            or not isinstance(retry_deadline, (int, float))
            or not (0 <= retry_deadline < float("inf"))
        ):
            raise ConfigError(f"retry_deadline must be a number of seconds >= 0; got {retry_deadline!r}")
        if not timeout > 0:
            raise ConfigError(f"timeout must be positive; got {timeout!r}")
        if not isinstance(queue_size, int) or queue_size < 1:
            raise ConfigError(f"queue_size must be a positive integer; got {queue_size!r}")

        self.url: str = raw_url
        self._key: str = raw_key
        self.agent: Optional[str] = check_agent(agent, agent_src)
        self.env: Optional[str] = check_env(env, env_src)
        self._sender = Sender(
            self.url, self._key, timeout=timeout, max_retries=max_retries, retry_deadline=retry_deadline
        )
        self._queue: Optional[SignalQueue] = (
            SignalQueue(self._sender, maxsize=queue_size, flush_timeout=flush_timeout)
            if background_signals
            else None
        )

    def __repr__(self) -> str:
        return f"Gateway(url={self.url!r}, agent={self.agent!r}, env={self.env!r})"

    def base_url(self, provider: str) -> str:
        """The base URL to give the provider's SDK: `<gateway>/openai/v1` for the OpenAI SDK
        (and `/v1` after `deepseek`, `xai`, `together`, `fireworks`, `openrouter`, used
        through it); `<gateway>/<provider>` for the SDKs that add their version path
        themselves (`anthropic`, `gemini`, `groq`, `mistral`) and for providers of your own."""
        if not isinstance(provider, str) or _PROVIDER_RE.fullmatch(provider) is None:
            raise ValueError(f"a provider prefix is a lowercase name like 'openai'; got {provider!r}")
        return f"{self.url}/{provider}{_SDK_PATHS.get(provider, '')}"

    # === attribution ===

    def headers(self) -> Dict[str, str]:
        """The `NM-*` headers a request made here and now would carry."""
        state = current_state()
        out = {"NM-Key": self._key}
        agent = (state.agent if state is not None else None) or self.agent
        if agent:
            out["NM-Agent"] = agent
        if self.env:
            out["NM-Env"] = self.env
        if state is not None:
            out["NM-Session"] = state.id
            if state.user:
                out["NM-User"] = state.user
        return out

    def _on_request(self, request: Any) -> None:
        headers = request.headers
        for name, value in self.headers().items():
            if name not in headers:
                headers[name] = value
        for name in _CREDENTIAL_HEADERS:
            value = headers.get(name)
            if value is not None and PROVIDER_KEY_PLACEHOLDER in value:
                del headers[name]

    def _on_response(self, response: Any) -> None:
        # The request hook and the response hook run in the caller's context (thread or task).
        state = current_state()
        if state is not None:
            h = response.headers
            state.record(h.get("nm-request-id"), h.get("nm-trace-id"), h.get("nm-error"), h.get("nm-variant"))

    def event_hooks(self, *, is_async: bool) -> Dict[str, List[Any]]:
        """The gateway's request and response hooks, as httpx/httpx2 `event_hooks=` takes
        them: for an HTTP client you build yourself (`httpx.Client(event_hooks=...)`)."""
        if is_async:

            async def on_request(request: Any) -> None:
                self._on_request(request)

            async def on_response(response: Any) -> None:
                self._on_response(response)

            return {"request": [on_request], "response": [on_response]}
        return {"request": [self._on_request], "response": [self._on_response]}

    def _new_client(self, cls: Any, *, is_async: bool) -> Any:
        client = cls(event_hooks=self.event_hooks(is_async=is_async))
        setattr(client, _HOOKED, True)
        return client

    def wire(self, http_client: Any, *, is_async: bool) -> Any:
        """Adds the gateway's hooks to an existing httpx/httpx2 `Client` (or `AsyncClient`);
        returns it. Installing twice is a no-op. (A client that copies its hooks at
        construction, like google-genai's per-event-loop async client, needs
        `event_hooks(...)` at construction instead.)"""
        if getattr(http_client, _HOOKED, False):
            return http_client
        hooks = self.event_hooks(is_async=is_async)
        current = http_client.event_hooks
        http_client.event_hooks = {
            "request": [*current.get("request", []), *hooks["request"]],
            "response": [*current.get("response", []), *hooks["response"]],
        }
        setattr(http_client, _HOOKED, True)
        return http_client

    # === sessions ===

    def session(
        self, *, id: Optional[str] = None, user: Optional[str] = None, agent: Optional[str] = None
    ) -> SessionScope:
        """A session scope: `with gw.session(user="u-7") as s:` (or `async with`). Every
        request of every wired client inside carries `NM-Session` (a fresh `sess_<32 hex>`
        unless `id` is given) and `NM-User` when `user` is set; `agent` overrides the
        gateway's agent inside the scope."""
        return SessionScope(
            _State(
                self,
                check_session_id(id, "session id") or new_session_id(),
                check_user(user, "session user"),
                check_agent(agent, "session agent"),
            )
        )

    # === signals ===

    def signal(
        self,
        session_id: Optional[str],
        action: str,
        *,
        edit_distance: Optional[int] = None,
        custom_label: Any = None,
        idempotency_key: Optional[str] = None,
        agent: Optional[str] = None,
        request_id: Optional[str] = None,
    ) -> None:
        """Records a signal for any session, or for one answer (`request_id`: the answer's
        `NM-Request-Id`; then `session_id` may be None): checked here (`InvalidSignal`), sent with
        an `Idempotency-Key` (drawn unless given), retried on 503/429/connection errors; raises
        `SignalError` when not stored (code `session_mismatch` when the answer belongs to another
        session). In background mode: checked and queued only."""
        sig = build_signal(
            session_id,
            action,
            edit_distance=edit_distance,
            custom_label=custom_label,
            idempotency_key=idempotency_key,
            agent=check_agent(agent, "agent") or self.agent,
            request_id=request_id,
        )
        if self._queue is not None:
            self._queue.put(sig)
        else:
            self._sender.send(sig)

    async def asignal(
        self,
        session_id: Optional[str],
        action: str,
        *,
        edit_distance: Optional[int] = None,
        custom_label: Any = None,
        idempotency_key: Optional[str] = None,
        agent: Optional[str] = None,
        request_id: Optional[str] = None,
    ) -> None:
        """`signal` for asyncio code."""
        sig = build_signal(
            session_id,
            action,
            edit_distance=edit_distance,
            custom_label=custom_label,
            idempotency_key=idempotency_key,
            agent=check_agent(agent, "agent") or self.agent,
            request_id=request_id,
        )
        if self._queue is not None:
            self._queue.put(sig)
        else:
            await self._sender.send_async(sig)

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Background mode: waits until every queued signal is sent or failed (True), or the
        timeout ran out (False). Without background mode there is nothing to wait for."""
        return True if self._queue is None else self._queue.flush(timeout)

    def close(self, timeout: Optional[float] = None) -> SignalStats:
        """Background mode: flushes, stops taking signals, logs losses. Returns the counts."""
        if self._queue is None:
            return SignalStats(0, 0, 0, 0)
        return self._queue.close(timeout)

    def signal_stats(self) -> SignalStats:
        """Background mode: signals sent, failed, dropped (queue full) and still pending."""
        return SignalStats(0, 0, 0, 0) if self._queue is None else self._queue.stats()

    # === official SDK clients ===

    def _provider_key(self, api_key: Optional[str], env_names: Tuple[str, ...]) -> str:
        if api_key is not None:
            return api_key
        for name in env_names:
            if os.environ.get(name):
                return os.environ[name]
        return PROVIDER_KEY_PLACEHOLDER

    def _stainless(
        self, module: Any, cls: Any, base: str, env_key: str, is_async: bool, kwargs: Dict[str, Any]
    ) -> Any:
        kwargs["api_key"] = self._provider_key(kwargs.get("api_key"), (env_key,))
        kwargs.setdefault("base_url", base)
        http_client = kwargs.get("http_client")
        if http_client is None:
            cls_ = module.DefaultAsyncHttpxClient if is_async else module.DefaultHttpxClient
            kwargs["http_client"] = self._new_client(cls_, is_async=is_async)
        else:
            kwargs["http_client"] = self.wire(http_client, is_async=is_async)
        return cls(**kwargs)

    def openai(self, **kwargs: Any) -> _openai.OpenAI:
        """`openai.OpenAI` through the gateway (`/openai/v1`). Keyword arguments go to the
        client unchanged (`api_key`, `timeout`, `max_retries`, `http_client`, ...)."""
        try:
            import openai
        except ImportError:
            raise _missing("openai", "openai") from None
        return self._stainless(
            openai, openai.OpenAI, self.base_url("openai"), "OPENAI_API_KEY", False, kwargs
        )

    def async_openai(self, **kwargs: Any) -> _openai.AsyncOpenAI:
        """`openai.AsyncOpenAI` through the gateway."""
        try:
            import openai
        except ImportError:
            raise _missing("openai", "openai") from None
        return self._stainless(
            openai, openai.AsyncOpenAI, self.base_url("openai"), "OPENAI_API_KEY", True, kwargs
        )

    def anthropic(self, **kwargs: Any) -> _anthropic.Anthropic:
        """`anthropic.Anthropic` through the gateway (`/anthropic`)."""
        try:
            import anthropic
        except ImportError:
            raise _missing("anthropic", "anthropic") from None
        return self._stainless(
            anthropic, anthropic.Anthropic, self.base_url("anthropic"), "ANTHROPIC_API_KEY", False, kwargs
        )

    def async_anthropic(self, **kwargs: Any) -> _anthropic.AsyncAnthropic:
        """`anthropic.AsyncAnthropic` through the gateway."""
        try:
            import anthropic
        except ImportError:
            raise _missing("anthropic", "anthropic") from None
        return self._stainless(
            anthropic, anthropic.AsyncAnthropic, self.base_url("anthropic"), "ANTHROPIC_API_KEY", True, kwargs
        )

    def groq(self, **kwargs: Any) -> _groq.Groq:
        """`groq.Groq` through the gateway (`/groq`, the SDK adds `/openai/v1/...`)."""
        try:
            import groq
        except ImportError:
            raise _missing("groq", "groq") from None
        return self._stainless(groq, groq.Groq, self.base_url("groq"), "GROQ_API_KEY", False, kwargs)

    def async_groq(self, **kwargs: Any) -> _groq.AsyncGroq:
        """`groq.AsyncGroq` through the gateway."""
        try:
            import groq
        except ImportError:
            raise _missing("groq", "groq") from None
        return self._stainless(groq, groq.AsyncGroq, self.base_url("groq"), "GROQ_API_KEY", True, kwargs)

    def genai(
        self, *, api_key: Optional[str] = None, http_options: Any = None, **kwargs: Any
    ) -> _google_genai.Client:
        """`google.genai.Client` through the gateway (`/gemini`); its `.aio` side is wired too.
        `http_options` (a `types.HttpOptions` or dict) is honoured; its base URL defaults to
        the gateway's."""
        try:
            from google import genai
            from google.genai import types
        except ImportError:
            raise _missing("google", "google-genai") from None
        if http_options is None:
            opts = types.HttpOptions()
        elif isinstance(http_options, types.HttpOptions):
            opts = http_options.model_copy()
        else:
            opts = types.HttpOptions.model_validate(http_options)
        if opts.base_url is None:
            opts.base_url = self.base_url("gemini")
        sync_cls, async_cls = _genai_http_classes(opts)
        # Injected clients (rather than client_args) also keep google-genai off aiohttp,
        # which would bypass the hooks on the async side. Its async client keeps one inner
        # client per event loop, built from the constructor's arguments: hooks go there.
        if opts.httpx_client is None:
            opts.httpx_client = self._new_client(sync_cls, is_async=False)
        else:
            self.wire(opts.httpx_client, is_async=False)
        if opts.httpx_async_client is None:
            opts.httpx_async_client = self._new_client(async_cls, is_async=True)
        else:
            self.wire(opts.httpx_async_client, is_async=True)
        key = self._provider_key(api_key, ("GOOGLE_API_KEY", "GEMINI_API_KEY"))
        return genai.Client(api_key=key, http_options=opts, **kwargs)

    def mistral(self, *, api_key: Optional[str] = None, **kwargs: Any) -> _Mistral:
        """`mistralai.Mistral` through the gateway (`/mistral`); sync and `*_async` methods
        are both wired. Without `api_key` (or `MISTRAL_API_KEY`) it sends no credential."""
        try:
            try:
                from mistralai.client import Mistral
            except ImportError:  # mistralai 1.x
                from mistralai import Mistral
        except ImportError:
            raise _missing("mistral", "mistralai") from None
        if api_key is None:
            api_key = os.environ.get("MISTRAL_API_KEY") or None
        kwargs.setdefault("server_url", self.base_url("mistral"))
        client = Mistral(api_key=api_key, **kwargs)
        config = client.sdk_configuration
        self.wire(config.client, is_async=False)
        self.wire(config.async_client, is_async=True)
        return client


def _genai_http_classes(opts: Any) -> Tuple[Any, Any]:
    """The (sync, async) HTTP client classes google-genai itself would use: httpx2 or httpx."""
    try:
        from google.genai import _api_client

        classes: Tuple[Any, Any] = _api_client._get_http_client_classes(opts)
        return classes
    except (ImportError, AttributeError):  # an older google-genai: httpx only
        import httpx

        return httpx.Client, httpx.AsyncClient
