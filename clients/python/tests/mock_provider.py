"""A mock LLM provider (OpenAI, Anthropic, Gemini, Groq and Mistral shapes, JSON and SSE with
usage) that records every request it receives.

It answers by path suffix, so one server serves as every provider's upstream behind the real
gateway (`NM_UPSTREAM_<PROVIDER>=<its url>`), and also as a stand-in *gateway* for the unit
tests (`/openai/v1/chat/completions`, ...): there it adds `NM-Request-Id` / `NM-Trace-Id` to
each answer and answers `POST /v1/signal` from a script of responses.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional, Tuple

TEXT = "Hallo, Welt! 🌍"
CHUNKS = ["Hallo, ", "Welt! ", "🌍"]


@dataclass
class Received:
    method: str
    path: str
    headers: Dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body or b"null")


@dataclass
class Reply:
    status: int
    headers: Dict[str, str] = field(default_factory=dict)
    body: bytes = b""


def _openai_chat(model: str) -> Dict[str, Any]:
    return {
        "id": "chatcmpl-mock",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": TEXT},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }


def _openai_stream(model: str) -> List[bytes]:
    def chunk(delta: Dict[str, Any], finish: Optional[str], usage: Any = None) -> bytes:
        c: Dict[str, Any] = {
            "id": "chatcmpl-mock",
            "object": "chat.completion.chunk",
            "created": 1_700_000_000,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        if usage is not None:
            c["usage"] = usage
        return b"data: " + json.dumps(c).encode() + b"\n\n"

    out = [chunk({"role": "assistant", "content": ""}, None)]
    out += [chunk({"content": t}, None) for t in CHUNKS]
    out.append(chunk({}, "stop", {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}))
    out.append(b"data: [DONE]\n\n")
    return out


def _anthropic_message(model: str) -> Dict[str, Any]:
    return {
        "id": "msg_mock",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": TEXT}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 5, "output_tokens": 3},
    }


def _anthropic_stream(model: str) -> List[bytes]:
    def ev(name: str, data: Dict[str, Any]) -> bytes:
        return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()

    start = _anthropic_message(model)
    start["content"] = []
    start["stop_reason"] = None
    start["usage"] = {"input_tokens": 5, "output_tokens": 1}
    out = [
        ev("message_start", {"type": "message_start", "message": start}),
        ev(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        ),
    ]
    for t in CHUNKS:
        out.append(
            ev(
                "content_block_delta",
                {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}},
            )
        )
    out += [
        ev("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ev(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": 3},
            },
        ),
        ev("message_stop", {"type": "message_stop"}),
    ]
    return out


def _gemini(model: str, text: str, final: bool) -> Dict[str, Any]:
    cand: Dict[str, Any] = {"content": {"parts": [{"text": text}], "role": "model"}, "index": 0}
    if final:
        cand["finishReason"] = "STOP"
    return {
        "candidates": [cand],
        "usageMetadata": {"promptTokenCount": 5, "candidatesTokenCount": 3, "totalTokenCount": 8},
        "modelVersion": model,
    }


def _gemini_stream(model: str) -> List[bytes]:
    return [
        b"data: " + json.dumps(_gemini(model, t, i == len(CHUNKS) - 1)).encode() + b"\r\n\r\n"
        for i, t in enumerate(CHUNKS)
    ]


class MockProvider:
    """`with MockProvider() as mock:` serves on 127.0.0.1 on a free port."""

    def __init__(self, *, as_gateway: bool = False) -> None:
        self.as_gateway = as_gateway
        #: As a stand-in gateway: the `NM-Variant` of answers to requests with a session.
        self.variant: Optional[str] = None
        self._lock = threading.Lock()
        self._received: List[Received] = []
        self._signal_script: List[Reply] = []
        self._proxy_script: List[Reply] = []
        self._counter = 0
        self._arrived = threading.Condition(self._lock)
        self._gate = threading.Event()
        self._gate.set()
        mock = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self._handle()

            def do_POST(self) -> None:
                self._handle()

            def handle_one_request(self) -> None:
                try:
                    super().handle_one_request()
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True  # the client left (e.g. its process exited)

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                rec = Received(
                    self.command,
                    self.path,
                    {k.lower(): v for k, v in self.headers.items()},
                    body,
                )
                status, headers, chunks = mock._answer(rec)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                if isinstance(chunks, list):
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for c in chunks:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(c), c))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                else:
                    self.send_header("Content-Length", str(len(chunks)))
                    self.end_headers()
                    self.wfile.write(chunks)
                self.wfile.flush()

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self) -> MockProvider:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._gate.set()
        self._server.shutdown()
        self._server.server_close()

    # === what came in ===

    def received(self) -> List[Received]:
        with self._lock:
            return list(self._received)

    def clear(self) -> None:
        with self._lock:
            self._received.clear()

    def signals(self) -> List[Received]:
        return [r for r in self.received() if r.path == "/v1/signal"]

    def wait_for_signals(self, n: int, deadline: float = 30.0) -> List[Received]:
        """Blocks until `n` signal requests have arrived (notified, not polled)."""
        with self._arrived:
            ok = self._arrived.wait_for(
                lambda: sum(r.path == "/v1/signal" for r in self._received) >= n, deadline
            )
        if not ok:
            raise AssertionError(f"{n} signal requests did not arrive within {deadline}s")
        return self.signals()

    def hold_signals(self) -> None:
        """Signal requests wait (after being recorded) until `release_signals()`."""
        self._gate.clear()

    def release_signals(self) -> None:
        self._gate.set()

    def script_proxy(self, *replies: Reply) -> None:
        """The next answers to provider requests, in order (then the normal answers)."""
        with self._lock:
            self._proxy_script.extend(replies)

    def script_signals(self, *replies: Reply) -> None:
        """The next answers to `POST /v1/signal`, in order (then 200 `{"ok": true}`)."""
        with self._lock:
            self._signal_script.extend(replies)

    # === answers ===

    def _answer(self, rec: Received) -> Tuple[int, Dict[str, str], Any]:
        with self._lock:
            self._received.append(rec)
            self._arrived.notify_all()
            self._counter += 1
            n = self._counter
            if rec.path == "/v1/signal":
                scripted = self._signal_script.pop(0) if self._signal_script else None
            else:
                scripted = self._proxy_script.pop(0) if self._proxy_script else None
        extra: Dict[str, str] = {}
        if self.as_gateway:
            extra = {"NM-Request-Id": f"req-{n}", "NM-Trace-Id": f"{n:032x}"}
            # As the gateway does, only for a request in an experiment (it has a session).
            if self.variant is not None and rec.headers.get("nm-session"):
                extra["NM-Variant"] = self.variant
        path = rec.path.split("?", 1)[0]
        if path == "/v1/signal":
            self._gate.wait(60)
            if scripted is not None:
                return scripted.status, {**extra, **scripted.headers}, scripted.body
            return 200, {**extra, "Content-Type": "application/json"}, b'{"ok":true}'
        if scripted is not None:
            return scripted.status, {**extra, **scripted.headers}, scripted.body
        try:
            req = json.loads(rec.body or b"{}")
        except ValueError:
            req = {}
        model = str(req.get("model") or "mock-model") if isinstance(req, dict) else "mock-model"
        stream = isinstance(req, dict) and req.get("stream") is True
        sse = {**extra, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        js = {**extra, "Content-Type": "application/json"}
        if path.endswith("/chat/completions"):
            if stream:
                return 200, sse, _openai_stream(model)
            return 200, js, json.dumps(_openai_chat(model)).encode()
        if path.endswith("/v1/messages"):
            if stream:
                return 200, sse, _anthropic_stream(model)
            return 200, js, json.dumps(_anthropic_message(model)).encode()
        if ":streamGenerateContent" in path:
            model = path.rsplit("/", 1)[-1].split(":", 1)[0]
            return 200, sse, _gemini_stream(model)
        if ":generateContent" in path:
            model = path.rsplit("/", 1)[-1].split(":", 1)[0]
            return 200, js, json.dumps(_gemini(model, TEXT, True)).encode()
        return 404, js, b'{"error": {"message": "mock: no such route", "type": "not_found"}}'
