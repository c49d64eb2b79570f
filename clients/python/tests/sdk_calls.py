"""One call (and one stream where the SDK has it) through every wired SDK client, sync and
async, each checking the text that came back. Shared by the fake-gateway and real-gateway
tests. `provider` is the gateway's provider prefix the call goes through."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, List, Optional

from mock_provider import TEXT

from nm_gateway import Gateway

MESSAGES: Any = [{"role": "user", "content": "Hallo"}]


@dataclass(frozen=True)
class Call:
    name: str
    provider: str
    run: Optional[Callable[[Gateway], str]] = None
    arun: Optional[Callable[[Gateway], Awaitable[str]]] = None


def _openai(gw: Gateway) -> str:
    r = gw.openai().chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    return r.choices[0].message.content or ""


def _openai_stream(gw: Gateway) -> str:
    chunks = gw.openai().chat.completions.create(
        model="gpt-4o-mini", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


async def _async_openai(gw: Gateway) -> str:
    r = await gw.async_openai().chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    return r.choices[0].message.content or ""


async def _async_openai_stream(gw: Gateway) -> str:
    chunks = await gw.async_openai().chat.completions.create(
        model="gpt-4o-mini", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])


def _anthropic(gw: Gateway) -> str:
    m = gw.anthropic().messages.create(model="claude-test", max_tokens=64, messages=MESSAGES)
    return "".join(b.text for b in m.content if b.type == "text")


def _anthropic_stream(gw: Gateway) -> str:
    with gw.anthropic().messages.stream(model="claude-test", max_tokens=64, messages=MESSAGES) as s:
        return "".join(s.text_stream)


async def _async_anthropic(gw: Gateway) -> str:
    m = await gw.async_anthropic().messages.create(model="claude-test", max_tokens=64, messages=MESSAGES)
    return "".join(b.text for b in m.content if b.type == "text")


async def _async_anthropic_stream(gw: Gateway) -> str:
    async with gw.async_anthropic().messages.stream(
        model="claude-test", max_tokens=64, messages=MESSAGES
    ) as s:
        return "".join([t async for t in s.text_stream])


def _genai(gw: Gateway) -> str:
    return gw.genai().models.generate_content(model="gemini-2.0-flash", contents="Hallo").text or ""


def _genai_stream(gw: Gateway) -> str:
    chunks = gw.genai().models.generate_content_stream(model="gemini-2.0-flash", contents="Hallo")
    return "".join(c.text or "" for c in chunks)


async def _async_genai(gw: Gateway) -> str:
    r = await gw.genai().aio.models.generate_content(model="gemini-2.0-flash", contents="Hallo")
    return r.text or ""


async def _async_genai_stream(gw: Gateway) -> str:
    chunks = await gw.genai().aio.models.generate_content_stream(model="gemini-2.0-flash", contents="Hallo")
    return "".join([c.text or "" async for c in chunks])


def _groq(gw: Gateway) -> str:
    r = gw.groq().chat.completions.create(model="llama-3.3-70b-versatile", messages=MESSAGES)
    return r.choices[0].message.content or ""


def _groq_stream(gw: Gateway) -> str:
    chunks = gw.groq().chat.completions.create(
        model="llama-3.3-70b-versatile", messages=MESSAGES, stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


async def _async_groq(gw: Gateway) -> str:
    r = await gw.async_groq().chat.completions.create(model="llama-3.3-70b-versatile", messages=MESSAGES)
    return r.choices[0].message.content or ""


def _mistral(gw: Gateway) -> str:
    r = gw.mistral().chat.complete(model="mistral-small-latest", messages=MESSAGES)
    content = r.choices[0].message.content
    return content if isinstance(content, str) else ""


def _mistral_stream(gw: Gateway) -> str:
    events = gw.mistral().chat.stream(model="mistral-small-latest", messages=MESSAGES)
    out: List[str] = []
    for e in events:
        delta = e.data.choices[0].delta.content if e.data.choices else None
        out.append(delta if isinstance(delta, str) else "")
    return "".join(out)


async def _async_mistral(gw: Gateway) -> str:
    r = await gw.mistral().chat.complete_async(model="mistral-small-latest", messages=MESSAGES)
    content = r.choices[0].message.content
    return content if isinstance(content, str) else ""


SYNC_CALLS = [
    Call("openai", "openai", run=_openai),
    Call("openai stream", "openai", run=_openai_stream),
    Call("anthropic", "anthropic", run=_anthropic),
    Call("anthropic stream", "anthropic", run=_anthropic_stream),
    Call("genai", "gemini", run=_genai),
    Call("genai stream", "gemini", run=_genai_stream),
    Call("groq", "groq", run=_groq),
    Call("groq stream", "groq", run=_groq_stream),
    Call("mistral", "mistral", run=_mistral),
    Call("mistral stream", "mistral", run=_mistral_stream),
]
ASYNC_CALLS = [
    Call("async openai", "openai", arun=_async_openai),
    Call("async openai stream", "openai", arun=_async_openai_stream),
    Call("async anthropic", "anthropic", arun=_async_anthropic),
    Call("async anthropic stream", "anthropic", arun=_async_anthropic_stream),
    Call("genai aio", "gemini", arun=_async_genai),
    Call("genai aio stream", "gemini", arun=_async_genai_stream),
    Call("async groq", "groq", arun=_async_groq),
    Call("mistral async", "mistral", arun=_async_mistral),
]
ALL_CALLS = SYNC_CALLS + ASYNC_CALLS
EXPECTED_TEXT = TEXT
