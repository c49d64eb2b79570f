/**
 * A mock LLM provider (OpenAI, Anthropic and Gemini shapes, JSON and SSE with usage) that
 * records every request. It answers by path suffix, so one server is every provider's
 * upstream behind the real gateway, and also a stand-in *gateway* for the unit tests
 * (`/openai/v1/chat/completions`, ...): then it adds `NM-Request-Id` / `NM-Trace-Id` and
 * answers `POST /v1/signal` from a script.
 */

import { createServer, type IncomingMessage, type Server, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";

export const TEXT = "Hallo, Welt! 🌍";
const CHUNKS = ["Hallo, ", "Welt! ", "🌍"];

export interface Received {
  method: string;
  path: string;
  headers: Record<string, string>;
  body: string;
}

export interface Reply {
  status: number;
  headers?: Record<string, string>;
  body?: string;
}

function openaiChat(model: string): unknown {
  return {
    id: "chatcmpl-mock",
    object: "chat.completion",
    created: 1_700_000_000,
    model,
    choices: [{ index: 0, message: { role: "assistant", content: TEXT }, finish_reason: "stop" }],
    usage: { prompt_tokens: 5, completion_tokens: 3, total_tokens: 8 },
  };
}

function openaiStream(model: string): string[] {
  const chunk = (delta: unknown, finish: string | null, usage?: unknown): string =>
    "data: " +
    JSON.stringify({
      id: "chatcmpl-mock",
      object: "chat.completion.chunk",
      created: 1_700_000_000,
      model,
      choices: [{ index: 0, delta, finish_reason: finish }],
      ...(usage ? { usage } : {}),
    }) +
    "\n\n";
  return [
    chunk({ role: "assistant", content: "" }, null),
    ...CHUNKS.map((t) => chunk({ content: t }, null)),
    chunk({}, "stop", { prompt_tokens: 5, completion_tokens: 3, total_tokens: 8 }),
    "data: [DONE]\n\n",
  ];
}

function anthropicMessage(model: string): Record<string, unknown> {
  return {
    id: "msg_mock",
    type: "message",
    role: "assistant",
    model,
    content: [{ type: "text", text: TEXT }],
    stop_reason: "end_turn",
    stop_sequence: null,
    usage: { input_tokens: 5, output_tokens: 3 },
  };
}

function anthropicStream(model: string): string[] {
  const ev = (name: string, data: unknown): string => `event: ${name}\ndata: ${JSON.stringify(data)}\n\n`;
  const start = {
    ...anthropicMessage(model),
    content: [],
    stop_reason: null,
    usage: { input_tokens: 5, output_tokens: 1 },
  };
  return [
    ev("message_start", { type: "message_start", message: start }),
    ev("content_block_start", {
      type: "content_block_start",
      index: 0,
      content_block: { type: "text", text: "" },
    }),
    ...CHUNKS.map((t) =>
      ev("content_block_delta", {
        type: "content_block_delta",
        index: 0,
        delta: { type: "text_delta", text: t },
      }),
    ),
    ev("content_block_stop", { type: "content_block_stop", index: 0 }),
    ev("message_delta", {
      type: "message_delta",
      delta: { stop_reason: "end_turn", stop_sequence: null },
      usage: { output_tokens: 3 },
    }),
    ev("message_stop", { type: "message_stop" }),
  ];
}

function gemini(model: string, text: string, final: boolean): unknown {
  return {
    candidates: [
      { content: { parts: [{ text }], role: "model" }, index: 0, ...(final ? { finishReason: "STOP" } : {}) },
    ],
    usageMetadata: { promptTokenCount: 5, candidatesTokenCount: 3, totalTokenCount: 8 },
    modelVersion: model,
  };
}

function geminiStream(model: string): string[] {
  return CHUNKS.map(
    (t, i) => "data: " + JSON.stringify(gemini(model, t, i === CHUNKS.length - 1)) + "\r\n\r\n",
  );
}

export class MockProvider {
  readonly received: Received[] = [];
  url = "";
  private readonly server: Server;
  private counter = 0;
  private readonly signalScript: Reply[] = [];
  private readonly proxyScript: Reply[] = [];
  private held: Array<() => void> | undefined;
  private arrivalWaiters: Array<() => void> = [];

  /** As a stand-in gateway: the `NM-Variant` of answers to requests with a session. */
  variant: string | undefined;

  constructor(readonly asGateway = false) {
    this.server = createServer((req, res) => {
      const parts: Buffer[] = [];
      req.on("data", (c: Buffer) => parts.push(c));
      req.on("end", () => void this.handle(req, Buffer.concat(parts).toString("utf8"), res));
    });
  }

  async start(): Promise<this> {
    await new Promise<void>((resolve) => this.server.listen(0, "127.0.0.1", resolve));
    this.url = `http://127.0.0.1:${(this.server.address() as AddressInfo).port}`;
    return this;
  }

  async stop(): Promise<void> {
    this.releaseSignals();
    this.server.closeAllConnections();
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
  }

  signals(): Received[] {
    return this.received.filter((r) => r.path === "/v1/signal");
  }

  /** Forgets what was received and any scripted answers not yet used. */
  clear(): void {
    this.received.length = 0;
    this.counter = 0;
    this.signalScript.length = 0;
    this.proxyScript.length = 0;
  }

  scriptSignals(...replies: Reply[]): void {
    this.signalScript.push(...replies);
  }

  scriptProxy(...replies: Reply[]): void {
    this.proxyScript.push(...replies);
  }

  /** Signal requests are recorded, then wait for `releaseSignals()`. */
  holdSignals(): void {
    this.held ??= [];
  }

  releaseSignals(): void {
    const held = this.held ?? [];
    this.held = undefined;
    for (const go of held) go();
  }

  /** Resolves once `n` signal requests have arrived (notified, not polled). */
  waitForSignals(n: number): Promise<Received[]> {
    return new Promise((resolve) => {
      const check = (): void => {
        if (this.signals().length >= n) {
          this.arrivalWaiters = this.arrivalWaiters.filter((w) => w !== check);
          resolve(this.signals());
        }
      };
      this.arrivalWaiters.push(check);
      check();
    });
  }

  private async handle(req: IncomingMessage, body: string, res: ServerResponse): Promise<void> {
    const headers: Record<string, string> = {};
    for (const [k, v] of Object.entries(req.headers))
      headers[k] = Array.isArray(v) ? v.join(", ") : String(v);
    const rec: Received = { method: req.method ?? "", path: req.url ?? "", headers, body };
    this.received.push(rec);
    for (const w of [...this.arrivalWaiters]) w();
    const n = ++this.counter;
    const extra: Record<string, string> = this.asGateway
      ? { "NM-Request-Id": `req-${n}`, "NM-Trace-Id": n.toString(16).padStart(32, "0") }
      : {};
    // As the gateway does, only for a request in an experiment (it has a session).
    if (this.asGateway && this.variant !== undefined && headers["nm-session"])
      extra["NM-Variant"] = this.variant;
    const path = rec.path.split("?")[0] ?? "";
    const send = (status: number, h: Record<string, string>, payload: string | string[]): void => {
      res.writeHead(status, { ...extra, ...h });
      if (Array.isArray(payload)) {
        for (const c of payload) res.write(c);
        res.end();
      } else {
        res.end(payload);
      }
    };
    if (path === "/v1/signal") {
      if (this.held) await new Promise<void>((go) => this.held?.push(go));
      const s = this.signalScript.shift();
      if (s) return send(s.status, s.headers ?? {}, s.body ?? "");
      return send(200, { "Content-Type": "application/json" }, '{"ok":true}');
    }
    const scripted = this.proxyScript.shift();
    if (scripted) return send(scripted.status, scripted.headers ?? {}, scripted.body ?? "");
    let parsed: { model?: unknown; stream?: unknown } = {};
    try {
      parsed = JSON.parse(body || "{}") as typeof parsed;
    } catch {
      parsed = {};
    }
    let model = typeof parsed.model === "string" ? parsed.model : "mock-model";
    const stream = parsed.stream === true;
    const sse = { "Content-Type": "text/event-stream", "Cache-Control": "no-cache" };
    const js = { "Content-Type": "application/json" };
    if (path.endsWith("/chat/completions")) {
      return stream ? send(200, sse, openaiStream(model)) : send(200, js, JSON.stringify(openaiChat(model)));
    }
    if (path.endsWith("/v1/messages")) {
      return stream
        ? send(200, sse, anthropicStream(model))
        : send(200, js, JSON.stringify(anthropicMessage(model)));
    }
    if (path.includes(":streamGenerateContent")) {
      model = path.split("/").pop()?.split(":")[0] ?? model;
      return send(200, sse, geminiStream(model));
    }
    if (path.includes(":generateContent")) {
      model = path.split("/").pop()?.split(":")[0] ?? model;
      return send(200, js, JSON.stringify(gemini(model, TEXT, true)));
    }
    return send(404, js, '{"error": {"message": "mock: no such route", "type": "not_found"}}');
  }
}
