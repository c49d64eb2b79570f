/**
 * Each factory returns the SDK's own client, pointed at the gateway; every request carries the
 * session in force (AsyncLocalStorage), concurrent sessions never mix; signals go out with one
 * idempotency key and are retried. A stand-in gateway records exactly what was sent.
 */

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { after, afterEach, before, describe, it } from "node:test";
import { promisify } from "node:util";

import Anthropic from "@anthropic-ai/sdk";
import { GoogleGenAI } from "@google/genai";
import {
  currentSession,
  errorCode,
  Gateway,
  type RetryInfo,
  requestId,
  SignalError,
} from "@nm-gateway/client";
import { anthropic } from "@nm-gateway/client/anthropic";
import { genai } from "@nm-gateway/client/genai";
import { openai } from "@nm-gateway/client/openai";
import OpenAI from "openai";

import { MockProvider, type Received, TEXT } from "./helpers/mockProvider.js";
import { CALLS } from "./helpers/sdkCalls.js";

const KEY = "nmk_" + "0".repeat(48);
const CREDENTIALS = ["authorization", "x-api-key", "x-goog-api-key"];
const run = promisify(execFile);

let fake: MockProvider;
let retries: RetryInfo[] = [];
const newGateway = (extra: object = {}): Gateway =>
  new Gateway({
    url: fake.url,
    key: KEY,
    agent: "unit-agent",
    env: "development",
    environ: {},
    onSignalRetry: (r) => retries.push(r),
    ...extra,
  });

before(async () => {
  for (const name of ["OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY", "GOOGLE_API_KEY"])
    delete process.env[name];
  fake = await new MockProvider(true).start();
});
after(async () => fake.stop());
afterEach(() => {
  fake.clear();
  retries = [];
});

const nm = (r: Received): Record<string, string> =>
  Object.fromEntries(Object.entries(r.headers).filter(([k]) => k.startsWith("nm-")));

describe("wired SDK clients", () => {
  for (const call of CALLS) {
    it(`${call.name} carries the session`, async () => {
      const gw = newGateway();
      const s = await gw.session({ user: "user-7" }, async (s) => {
        assert.equal(await call.run(gw), TEXT);
        return s;
      });
      const recs = fake.received;
      assert.ok(recs.length > 0);
      for (const r of recs) {
        assert.ok(r.path.startsWith(`/${call.provider}/`), r.path);
        assert.deepEqual(nm(r), {
          "nm-key": KEY,
          "nm-agent": "unit-agent",
          "nm-env": "development",
          "nm-session": s.id,
          "nm-user": "user-7",
        });
        for (const h of CREDENTIALS) assert.equal(r.headers[h], undefined, `${h} sent`);
      }
      assert.equal(s.lastRequestId, `req-${recs.length}`);
      assert.equal(s.lastTraceId, recs.length.toString(16).padStart(32, "0"));
      assert.equal(s.lastErrorCode, undefined);
    });
  }

  it("send no session outside one", async () => {
    const gw = newGateway();
    assert.equal(currentSession(), undefined);
    for (const call of CALLS) assert.equal(await call.run(gw), TEXT);
    for (const r of fake.received)
      assert.deepEqual(nm(r), { "nm-key": KEY, "nm-agent": "unit-agent", "nm-env": "development" });
  });

  it("are the SDKs' own classes, pointed at the gateway", () => {
    const gw = newGateway();
    assert.ok(openai(gw) instanceof OpenAI);
    assert.ok(anthropic(gw) instanceof Anthropic);
    assert.ok(genai(gw) instanceof GoogleGenAI);
    assert.equal(openai(gw).baseURL, `${gw.url}/openai/v1`);
    assert.equal(anthropic(gw).baseURL, `${gw.url}/anthropic`);
    // The factories use what baseURL() says.
    assert.equal(openai(gw).baseURL, gw.baseURL("openai"));
    assert.equal(anthropic(gw).baseURL, gw.baseURL("anthropic"));
  });

  it("keep a provider key that was given", async () => {
    const gw = newGateway();
    await openai(gw, { apiKey: "sk-mine" }).chat.completions.create({ model: "m", messages: [] });
    assert.equal(fake.received.at(-1)?.headers.authorization, "Bearer sk-mine");
    await anthropic(gw, { apiKey: "sk-ant-mine" }).messages.create({
      model: "m",
      max_tokens: 1,
      messages: [],
    });
    const h = fake.received.at(-1)?.headers ?? {};
    assert.ok([h["x-api-key"], h.authorization?.replace("Bearer ", "")].includes("sk-ant-mine"));
    await genai(gw, { apiKey: "g-mine" }).models.generateContent({
      model: "gemini-2.0-flash",
      contents: "x",
    });
    assert.equal(fake.received.at(-1)?.headers["x-goog-api-key"], "g-mine");
    process.env.OPENAI_API_KEY = "sk-env";
    try {
      await openai(gw).chat.completions.create({ model: "m", messages: [] });
      assert.equal(fake.received.at(-1)?.headers.authorization, "Bearer sk-env");
    } finally {
      delete process.env.OPENAI_API_KEY;
    }
  });

  it("let headers set by the caller win", async () => {
    const gw = newGateway();
    await gw.session({ user: "u1" }, () =>
      openai(gw).chat.completions.create(
        { model: "m", messages: [] },
        { headers: { "NM-Session": "sess_explicit", "NM-User": "someone" } },
      ),
    );
    assert.equal(fake.received[0]?.headers["nm-session"], "sess_explicit");
    assert.equal(fake.received[0]?.headers["nm-user"], "someone");
  });

  it("carry the session through the SDK's own retries", async () => {
    const gw = newGateway();
    fake.scriptProxy({
      status: 503,
      headers: { "Content-Type": "application/json", "Retry-After": "0" },
      body: '{"error":{"message":"busy"}}',
    });
    const s = await gw.session({ user: "u3" }, async (s) => {
      const r = await openai(gw, { maxRetries: 2 }).chat.completions.create({ model: "m", messages: [] });
      assert.equal(r.choices[0]?.message.content, TEXT);
      return s;
    });
    assert.deepEqual(
      fake.received.map((r) => [r.headers["x-stainless-retry-count"], r.headers["nm-session"]]),
      [
        ["0", s.id],
        ["1", s.id],
      ],
    );
    assert.equal(s.lastRequestId, "req-2");
  });

  it("lastVariant is the last answer's NM-Variant", async () => {
    const gw = newGateway();
    await gw.session({}, async (s) => {
      assert.equal(s.lastVariant, undefined);
      fake.variant = "exp-1/groq";
      await openai(gw).chat.completions.create({ model: "m", messages: [] });
      assert.equal(s.lastVariant, "exp-1/groq");
      assert.equal(s.lastRequestId, `req-${fake.received.length}`);
      // An answer without the header (the request was in no experiment) clears it.
      fake.variant = undefined;
      await openai(gw).chat.completions.create({ model: "m", messages: [] });
      assert.equal(s.lastVariant, undefined);
    });
  });

  it("expose the gateway's error code", async () => {
    const gw = newGateway();
    const body =
      '{"error":{"message":"invalid NM-Key","type":"authentication_error","code":"invalid_api_key"}}';
    fake.scriptProxy({
      status: 401,
      headers: { "Content-Type": "application/json", "NM-Error": "invalid_api_key" },
      body,
    });
    await gw.session(async (s) => {
      const err = await openai(gw, { maxRetries: 0 })
        .chat.completions.create({ model: "m", messages: [] })
        .catch((e: unknown) => e);
      assert.ok(err instanceof OpenAI.AuthenticationError);
      assert.equal(errorCode(err), "invalid_api_key");
      assert.equal(requestId(err), "req-1");
      assert.equal(s.lastErrorCode, "invalid_api_key");
    });
    assert.equal(errorCode(new Error("plain")), undefined);
  });
});

describe("sessions", () => {
  it("nest and restore", async () => {
    const gw = newGateway();
    const client = openai(gw);
    const ask = () => client.chat.completions.create({ model: "m", messages: [] });
    const ids = await gw.session({ user: "outer-user" }, async (outer) => {
      await ask();
      const inner = await gw.session({ user: "inner-user", agent: "inner-agent" }, async (inner) => {
        await ask();
        assert.equal(currentSession()?.id, inner.id);
        return inner.id;
      });
      await ask();
      return [outer.id, inner];
    });
    await ask();
    assert.deepEqual(
      fake.received.map((r) => [r.headers["nm-session"], r.headers["nm-user"], r.headers["nm-agent"]]),
      [
        [ids[0], "outer-user", "unit-agent"],
        [ids[1], "inner-user", "inner-agent"],
        [ids[0], "outer-user", "unit-agent"],
        [undefined, undefined, "unit-agent"],
      ],
    );
  });

  it("run concurrently without mixing", async () => {
    const gw = newGateway();
    const client = openai(gw);
    const n = 8;
    const calls = 3;
    let open = 0;
    let allOpen!: () => void;
    const allIn = new Promise<void>((r) => (allOpen = r));
    const ids = await Promise.all(
      Array.from({ length: n }, (_, i) =>
        gw.session({ user: `task-${i}` }, async (s) => {
          if (++open === n) allOpen();
          await allIn; // every session open before any request
          for (let c = 0; c < calls; c++) {
            await client.chat.completions.create({ model: "m", messages: [] });
            await new Promise((r) => setImmediate(r)); // let the others interleave
            assert.equal(currentSession()?.id, s.id);
          }
          return [s.id, `task-${i}`] as const;
        }),
      ),
    );
    const want = new Map(ids);
    const count = new Map<string, number>();
    for (const r of fake.received) {
      const sid = r.headers["nm-session"] ?? "";
      assert.equal(r.headers["nm-user"], want.get(sid));
      count.set(sid, (count.get(sid) ?? 0) + 1);
    }
    assert.deepEqual([...count.values()], Array(n).fill(calls));
    assert.equal(currentSession(), undefined);
  });

  it("follow callbacks and timers started inside, not work started outside", async () => {
    const gw = newGateway();
    const client = openai(gw);
    let outside!: Promise<unknown>;
    let release!: () => void;
    const gate = new Promise<void>((r) => (release = r));
    // A promise chain created outside any session, resumed while one is open elsewhere.
    outside = gate.then(() => client.chat.completions.create({ model: "m", messages: [] }));
    const sid = await gw.session({ user: "u" }, async (s) => {
      await new Promise<void>((r) =>
        setTimeout(
          () => void client.chat.completions.create({ model: "m", messages: [] }).then(() => r()),
          0,
        ),
      );
      release();
      await outside;
      return s.id;
    });
    assert.deepEqual(
      fake.received.map((r) => r.headers["nm-session"]),
      [sid, undefined],
    );
    // s.run carries a session into a callback registered elsewhere.
    const s2 = await gw.session((s) => s);
    await s2.run(() => client.chat.completions.create({ model: "m", messages: [] }));
    assert.equal(fake.received.at(-1)?.headers["nm-session"], s2.id);
  });
});

const UNAVAILABLE = {
  status: 503,
  headers: { "Content-Type": "application/json", "NM-Error": "unavailable", "Retry-After": "0" },
  body: '{"ok":false,"error":{"code":"unavailable","message":"nothing was stored"}}',
};

describe("signals", () => {
  it("every action from a session", async () => {
    const gw = newGateway();
    const sid = await gw.session({ user: "u" }, async (s) => {
      await s.accepted();
      await s.edited({ editDistance: 37 });
      await s.edited({ original: "Hallo Welt", final: "Hallo, schöne Welt!" });
      await s.regenerated();
      await s.abandoned();
      await s.thumbsUp({ customLabel: { variant: "B" } });
      await s.thumbsDown();
      await s.published();
      await s.sent({ idempotencyKey: "my-key-1" });
      await s.signal("accepted", { customLabel: "via signal()" });
      return s.id;
    });
    const recs = fake.signals();
    const bodies = recs.map((r) => JSON.parse(r.body) as Record<string, unknown>);
    assert.deepEqual(
      bodies.map((b) => b.action),
      [
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
      ],
    );
    assert.ok(bodies.every((b) => b.session_id === sid));
    assert.equal(bodies[1]?.edit_distance, 37);
    assert.equal(bodies[2]?.edit_distance, 9);
    assert.deepEqual(bodies[5]?.custom_label, { variant: "B" });
    assert.deepEqual(Object.keys(bodies[0] ?? {}), ["session_id", "action"]);
    for (const r of recs) {
      assert.equal(r.headers["nm-key"], KEY);
      assert.equal(r.headers["nm-agent"], "unit-agent");
      assert.equal(r.headers["content-type"], "application/json");
    }
    const keys = recs.map((r) => r.headers["idempotency-key"]);
    assert.equal(new Set(keys).size, keys.length);
    assert.equal(keys[8], "my-key-1");
  });

  it("retries resend the same signal with the same key", async () => {
    const gw = newGateway();
    fake.scriptSignals(UNAVAILABLE, { status: 429, headers: { "Retry-After": "0" }, body: "" });
    await gw.signal("sess_1", "edited", { editDistance: 5, customLabel: { k: 1 } });
    const recs = fake.signals();
    assert.equal(recs.length, 3);
    assert.equal(new Set(recs.map((r) => r.headers["idempotency-key"])).size, 1);
    assert.equal(new Set(recs.map((r) => r.body)).size, 1);
    assert.deepEqual(
      retries.map((r) => [r.attempt, r.status, r.code]),
      [
        [1, 503, "unavailable"],
        [2, 429, "http_429"],
      ],
    );
  });

  it("a refusal is final and carries the code", async () => {
    const gw = newGateway();
    fake.scriptSignals({
      status: 401,
      headers: {
        "Content-Type": "application/json",
        "NM-Error": "invalid_api_key",
        "NM-Request-Id": "req-x",
      },
      body: '{"ok":false,"error":{"code":"invalid_api_key","message":"unknown key"}}',
    });
    const err = await gw.signal("sess_1", "accepted").catch((e: unknown) => e);
    assert.ok(err instanceof SignalError);
    assert.deepEqual(
      [err.code, err.status, err.retryable, err.detail],
      ["invalid_api_key", 401, false, "unknown key"],
    );
    assert.equal(errorCode(err), "invalid_api_key");
    assert.equal(requestId(err), "req-x");
    assert.equal(fake.signals().length, 1);
  });

  it("retries are bounded", async () => {
    const gw = newGateway({ maxRetries: 2 });
    fake.scriptSignals(UNAVAILABLE, UNAVAILABLE, UNAVAILABLE, UNAVAILABLE);
    const err = await gw.signal("sess_1", "accepted").catch((e: unknown) => e);
    assert.ok(err instanceof SignalError);
    assert.deepEqual([err.code, err.status, err.retryable], ["unavailable", 503, true]);
    assert.equal(fake.signals().length, 3);
  });

  it("with the defaults, retries run until a deadline, not a count", async () => {
    // 12 unavailable answers in a row (the old default gave up after 5 retries), then stored.
    const gw = new Gateway({ url: fake.url, key: KEY, environ: {} });
    fake.scriptSignals(...Array.from({ length: 12 }, () => UNAVAILABLE));
    await gw.signal("sess_1", "accepted");
    const recs = fake.signals();
    assert.equal(recs.length, 13);
    assert.equal(new Set(recs.map((r) => r.headers["idempotency-key"])).size, 1);
  });

  for (const [retryDeadlineMs, attempts] of [
    [0, 1],
    [500, 2],
  ] as const) {
    it(`retries stop at the deadline (${retryDeadlineMs} ms: ${attempts} attempt(s))`, async () => {
      // The gateway asks for 1 s each time: the one retry waits only until the deadline.
      const gw = new Gateway({ url: fake.url, key: KEY, environ: {}, retryDeadlineMs });
      const busy = { ...UNAVAILABLE, headers: { ...UNAVAILABLE.headers, "Retry-After": "1" } };
      fake.scriptSignals(...Array.from({ length: 5 }, () => busy));
      const err = await gw.signal("sess_1", "accepted").catch((e: unknown) => e);
      assert.ok(err instanceof SignalError);
      assert.deepEqual([err.code, err.retryable], ["unavailable", true]);
      assert.ok(err.detail.includes(`gave up after ${attempts} attempt(s)`), err.detail);
      assert.equal(fake.signals().length, attempts);
    });
  }

  it("connection errors are retried, then reported", async () => {
    const closed = await new MockProvider().start();
    const url = closed.url;
    await closed.stop();
    const gw = new Gateway({ url, key: KEY, environ: {}, maxRetries: 1 });
    const err = await gw.signal("sess_1", "accepted").catch((e: unknown) => e);
    assert.ok(err instanceof SignalError);
    assert.equal(err.code, "connection_error");
    assert.equal(err.retryable, true);
    assert.equal(err.status, undefined);
    assert.ok(err.detail.includes(url));
  });

  it("background mode queues and flushes", async () => {
    const gw = newGateway({ backgroundSignals: true });
    await gw.session(async (s) => {
      for (let i = 0; i < 20; i++) await s.accepted();
      await assert.rejects(s.edited({} as never), /editDistance is required/);
    });
    assert.equal(await gw.flush(30_000), true);
    assert.deepEqual(gw.signalStats(), { sent: 20, failed: 0, dropped: 0, pending: 0 });
    assert.equal(fake.signals().length, 20);
    await gw.close();
  });

  it("a full queue drops and counts", async () => {
    const gw = newGateway({ backgroundSignals: true, queueSize: 2 });
    fake.holdSignals();
    await gw.signal("sess_1", "accepted");
    await fake.waitForSignals(1); // the sender is busy with the first one
    for (let i = 0; i < 5; i++) await gw.signal("sess_1", "sent"); // 2 fit, 3 dropped
    assert.equal(gw.signalStats().dropped, 3);
    fake.releaseSignals();
    assert.equal(await gw.flush(30_000), true);
    const st = await gw.close();
    assert.deepEqual([st.sent, st.dropped, st.pending], [3, 3, 0]);
    assert.deepEqual(
      fake.signals().map((r) => (JSON.parse(r.body) as { action: string }).action),
      ["accepted", "sent", "sent"],
    );
    await assert.rejects(gw.signal("sess_1", "sent"), /closed/);
  });

  it("a process that queues signals and ends delivers them; losses are reported at exit", async () => {
    const lib = new URL("../../dist/index.js", import.meta.url).href;
    const script = (n: number, queueSize: number) => `
      const { Gateway } = await import(${JSON.stringify(lib)});
      const gw = new Gateway({ url: ${JSON.stringify(fake.url)}, key: ${JSON.stringify(KEY)}, environ: {},
                               backgroundSignals: true, queueSize: ${queueSize}, flushTimeoutMs: 500 });
      for (let i = 0; i < ${n}; i++) await gw.signal("sess_exit", "accepted", { customLabel: i });
    `;
    const ok = await run(process.execPath, ["--input-type=module", "-e", script(3, 3)], { timeout: 60_000 });
    assert.equal(ok.stderr, "");
    assert.deepEqual(
      fake
        .signals()
        .map((r) => (JSON.parse(r.body) as { custom_label: number }).custom_label)
        .sort(),
      [0, 1, 2],
    );
    // Now the gateway keeps answering 503 (Retry-After: 1): the process ends while the first
    // signal waits to be retried, with 2 queued and 7 dropped (queue of 2).
    fake.scriptSignals(
      ...Array.from({ length: 20 }, () => ({
        ...UNAVAILABLE,
        headers: { ...UNAVAILABLE.headers, "Retry-After": "1" },
      })),
    );
    const out = await run(process.execPath, ["--input-type=module", "-e", script(10, 2)], {
      timeout: 60_000,
    });
    const report = out.stderr.split("\n").filter((l) => l.startsWith("nm-gateway signals:"));
    assert.equal(report.length, 1, out.stderr);
    // The line the Python library writes for the same loss (test_signal_delivery.py).
    assert.equal(report[0], "nm-gateway signals: 0 sent, 1 failed, 7 dropped (queue full), 2 unsent at exit");
    // gw.close() reports the same way, once, and says so.
    const closing = await run(
      process.execPath,
      ["--input-type=module", "-e", script(10, 2) + "await gw.close(200);"],
      { timeout: 60_000 },
    );
    const closed = closing.stderr.split("\n").filter((l) => l.startsWith("nm-gateway signals:"));
    assert.deepEqual(closed, [
      "nm-gateway signals: 0 sent, 0 failed, 7 dropped (queue full), 3 unsent at close",
    ]);
  });
});
