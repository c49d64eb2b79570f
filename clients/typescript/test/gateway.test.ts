/**
 * Against the real `nm-gateway` (NM_GATEWAY_BIN) and a mock provider. The gateway strips every
 * NM-* header before forwarding, so what it *recorded* (read back with `nm-gateway usage` /
 * `agents show`) proves what the SDKs sent.
 */

import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { setTimeout as sleep } from "node:timers/promises";
import { after, before, describe, it } from "node:test";

import { ApiError, GoogleGenAI } from "@google/genai";
import {
  errorCode,
  Gateway,
  InvalidSignal,
  type RetryInfo,
  requestId,
  SignalError,
} from "@nm-gateway/client";
import { anthropic } from "@nm-gateway/client/anthropic";
import { genai } from "@nm-gateway/client/genai";
import { openai } from "@nm-gateway/client/openai";
import Anthropic from "@anthropic-ai/sdk";
import OpenAI from "openai";

import { MockProvider, TEXT } from "./helpers/mockProvider.js";
import { eventually, OPERATOR_OPENAI_KEY, RealGateway } from "./helpers/realGateway.js";
import { CALLS } from "./helpers/sdkCalls.js";

type Row = Record<string, unknown> & { session: string | null; user: string | null; requests: number };

let upstream: MockProvider;
let real: RealGateway;
let failed = false;

const unique = (prefix: string): string => `${prefix}-${randomUUID().slice(0, 8)}`;

async function rowsFor(gw: RealGateway, agent: string, expected: number): Promise<Row[]> {
  return eventually(`${expected} requests of ${agent}`, async () => {
    const rows = (await gw.usage(["session", "user", "agent", "env", "provider"], { agent })) as Row[];
    const total = rows.reduce((n, r) => n + r.requests, 0);
    assert.ok(total <= expected, JSON.stringify(rows));
    return total === expected ? rows : undefined;
  });
}

async function signalsOf(gw: RealGateway, agent: string, total: number): Promise<Record<string, number>> {
  return eventually(`${total} signals of ${agent}`, async () => {
    const got = await gw.agentSignals(agent);
    assert.ok(got.total <= total, JSON.stringify(got));
    return got.total === total ? got.by_action : undefined;
  });
}

before(async () => {
  for (const name of ["OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY", "GOOGLE_API_KEY"])
    delete process.env[name];
  upstream = await new MockProvider().start();
  real = await new RealGateway(upstream.url).start();
});

after(async () => {
  await real?.stop();
  await upstream?.stop();
  if (failed) console.log(real?.logs());
});

const test = (name: string, fn: () => Promise<void>) =>
  it(name, async () => {
    try {
      await fn();
    } catch (e) {
      failed = true;
      throw e;
    }
  });

describe("the real gateway", () => {
  test("records every wired SDK's requests under the session, user, agent and env", async () => {
    const agent = unique("ts-sdks");
    const gw = new Gateway({ url: real.url, key: real.adminKey, agent, env: "staging", environ: {} });
    upstream.clear();
    const expected = new Map<string, { user: string; provider: string; name: string }>();
    for (const [i, call] of CALLS.entries()) {
      const user = `user-${i}`;
      await gw.session({ user }, async (s) => {
        assert.equal(await call.run(gw), TEXT, call.name);
        assert.ok(s.lastRequestId, call.name);
        expected.set(s.id, { user, provider: call.provider, name: call.name });
      });
    }
    await openai(gw).chat.completions.create({ model: "gpt-4o-mini", messages: [] }); // outside a session

    const rows = await rowsFor(real, agent, CALLS.length + 1);
    for (const [sid, want] of expected) {
      const row = rows.find((r) => r.session === sid);
      assert.ok(row, `${want.name}: session ${sid} not recorded: ${JSON.stringify(rows)}`);
      assert.deepEqual(
        [row.user, row.agent, row.env, row.provider, row.requests],
        [want.user, agent, "staging", want.provider, 1],
        want.name,
      );
    }
    const outside = rows.filter((r) => !expected.has(r.session ?? ""));
    assert.deepEqual(
      outside.map((r) => [r.session, r.user, r.requests]),
      [[null, null, 1]],
    );
    assert.equal(upstream.received.length, CALLS.length + 1);
    for (const r of upstream.received) {
      assert.ok(!Object.keys(r.headers).some((k) => k.startsWith("nm-")), JSON.stringify(r.headers));
      assert.ok(!JSON.stringify(r.headers).includes("nm-gateway-no-provider-key"));
    }
    const openaiAuth = upstream.received
      .filter((r) => r.path.startsWith("/v1/chat"))
      .map((r) => r.headers.authorization);
    assert.ok(openaiAuth.includes(`Bearer ${OPERATOR_OPENAI_KEY}`));
  });

  test("lastRequestId is the gateway's NM-Request-Id", async () => {
    const gw = new Gateway({ url: real.url, key: real.adminKey, agent: unique("ts-ids"), environ: {} });
    await gw.session(async (s) => {
      const { response } = await openai(gw)
        .chat.completions.create({ model: "gpt-4o-mini", messages: [] })
        .withResponse();
      assert.equal(s.lastRequestId, response.headers.get("nm-request-id"));
      assert.match(s.lastRequestId ?? "", /^[0-9a-f-]{36}$/);
      assert.equal(s.lastTraceId, undefined); // tracing is off in this gateway
    });
  });

  test("gateway errors are the SDKs' own, with the code readable", async () => {
    const bad = new Gateway({ url: real.url, key: "nmk_" + "f".repeat(48), agent: "ts-errors", environ: {} });
    await bad.session(async (s) => {
      const oe = await openai(bad, { maxRetries: 0 })
        .chat.completions.create({ model: "m", messages: [] })
        .catch((e: unknown) => e);
      assert.ok(oe instanceof OpenAI.AuthenticationError);
      assert.equal(errorCode(oe), "invalid_api_key");
      assert.ok(requestId(oe));
      const ae = await anthropic(bad, { maxRetries: 0 })
        .messages.create({ model: "m", max_tokens: 1, messages: [{ role: "user", content: "x" }] })
        .catch((e: unknown) => e);
      assert.ok(ae instanceof Anthropic.AuthenticationError);
      assert.equal(errorCode(ae), "invalid_api_key");
      const ge = await genai(bad)
        .models.generateContent({ model: "gemini-2.0-flash", contents: "x" })
        .catch((e: unknown) => e);
      assert.ok(ge instanceof ApiError);
      assert.equal(ge.status, 401);
      assert.equal(s.lastErrorCode, "invalid_api_key"); // genai's ApiError carries no headers
    });
  });

  test("signals are counted for the agent", async () => {
    const agent = unique("ts-signals");
    const gw = new Gateway({ url: real.url, key: real.adminKey, agent, env: "production", environ: {} });
    const sid = await gw.session({ user: "u-sig" }, async (s) => {
      await openai(gw).chat.completions.create({ model: "gpt-4o-mini", messages: [] });
      await s.accepted();
      await s.edited({ editDistance: 12 });
      await s.edited({ original: "Dear team, the release is ready.", final: "Hi all, release ready!" });
      await s.regenerated();
      await s.abandoned();
      await s.thumbsUp({ customLabel: { variant: "B" } });
      await s.thumbsDown();
      await s.published();
      await s.sent();
      return s.id;
    });
    await gw.signal(sid, "accepted", { customLabel: "general call" });
    assert.deepEqual(await signalsOf(real, agent, 10), {
      accepted: 2,
      edited: 2,
      regenerated: 1,
      abandoned: 1,
      thumbs_up: 1,
      thumbs_down: 1,
      published: 1,
      sent: 1,
    });
  });

  test("a session's signals name its last answer; an explicit requestId or null overrides", async () => {
    const agent = unique("ts-answer");
    const gw = new Gateway({ url: real.url, key: real.adminKey, agent, environ: {} });
    const client = openai(gw);
    const [sid, first, second] = await gw.session(async (s) => {
      await client.chat.completions.create({ model: "model-a", messages: [] });
      const a = s.lastRequestId;
      await client.chat.completions.create({ model: "model-b", messages: [] });
      const b = s.lastRequestId;
      await s.accepted(); // the last answer: model-b
      await s.thumbsDown({ requestId: a }); // an earlier one: model-a
      await s.sent({ requestId: null }); // the session only (two models: none)
      return [s.id, a, b] as const;
    });
    assert.ok(first && second && first !== second);
    await rowsFor(real, agent, 2);
    const err = await gw
      .signal("sess_" + randomUUID().replace(/-/g, ""), "accepted", { requestId: second })
      .catch((e: unknown) => e);
    assert.ok(err instanceof SignalError);
    assert.deepEqual([err.code, err.status, err.retryable], ["session_mismatch", 409, false]);
    const bad = await gw
      .signal(undefined, "accepted", { requestId: second.toUpperCase() })
      .catch((e: unknown) => e);
    assert.ok(bad instanceof InvalidSignal && bad.code === "invalid_field");
    const none = await gw.signal(undefined, "accepted").catch((e: unknown) => e);
    assert.ok(none instanceof InvalidSignal && none.code === "missing_field");
    await gw.signal(undefined, "published", { requestId: second });
    await signalsOf(real, agent, 4);
    type Rate = { model: string | null; sessions: number; successes: number };
    const rates = await eventually("outcomes by model", async () => {
      const rows = (await real.cli("agents", "outcomes", agent, "--by", "model")) as
        { rows?: Rate[] } | Rate[];
      const list = (Array.isArray(rows) ? rows : (rows.rows ?? [])).map((r) => [
        r.model,
        r.sessions,
        r.successes,
      ]);
      list.sort((x, y) => String(x[0]).localeCompare(String(y[0])));
      return list.length === 3 ? list : undefined;
    });
    assert.deepEqual(rates, [
      ["model-a", 1, 0],
      ["model-b", 1, 1],
      [null, 1, 1],
    ]);
    assert.ok(sid.startsWith("sess_"));
  });

  test("a refusal surfaces with its code", async () => {
    const bad = new Gateway({ url: real.url, key: "nmk_" + "e".repeat(48), environ: {} });
    const err = await bad.signal("sess_1", "accepted").catch((e: unknown) => e);
    assert.ok(err instanceof SignalError);
    assert.deepEqual([err.code, err.status, err.retryable], ["invalid_api_key", 401, false]);
    assert.ok(err.requestId);
  });

  test("the same idempotency key counts once", async () => {
    const agent = unique("ts-idem");
    const gw = new Gateway({ url: real.url, key: real.adminKey, agent, environ: {} });
    const key = "idem-" + randomUUID();
    await gw.session(async (s) => {
      await openai(gw).chat.completions.create({ model: "gpt-4o-mini", messages: [] });
      await s.accepted({ idempotencyKey: key });
      await s.accepted({ idempotencyKey: key });
      await s.sent();
    });
    const by = await signalsOf(real, agent, 2);
    assert.deepEqual([by.accepted, by.sent], [1, 1]);
  });

  test("concurrent sessions do not mix", async () => {
    const agent = unique("ts-concurrent");
    const gw = new Gateway({ url: real.url, key: real.adminKey, agent, environ: {} });
    const oa = openai(gw);
    const an = anthropic(gw);
    const n = 8;
    const calls = 3;
    let open = 0;
    let allOpen!: () => void;
    const allIn = new Promise<void>((r) => (allOpen = r));
    const pairs = await Promise.all(
      Array.from({ length: n }, (_, i) =>
        gw.session({ user: `task-${i}` }, async (s) => {
          if (++open === n) allOpen();
          await allIn;
          for (let c = 0; c < calls; c++) {
            if (i % 2 === 0) await oa.chat.completions.create({ model: "gpt-4o-mini", messages: [] });
            else
              await an.messages.create({
                model: "claude-test",
                max_tokens: 8,
                messages: [{ role: "user", content: "x" }],
              });
          }
          return [s.id, `task-${i}`] as const;
        }),
      ),
    );
    const users = new Map(pairs);
    const rows = await rowsFor(real, agent, n * calls);
    assert.equal(rows.length, n);
    for (const row of rows) {
      assert.equal(users.get(row.session ?? ""), row.user, JSON.stringify(row));
      assert.equal(row.requests, calls);
    }
  });
});

describe("a controlplane outage", () => {
  test("is ridden out with retries, counted once", async () => {
    const split = await new RealGateway(upstream.url, true).start();
    try {
      const agent = unique("ts-outage");
      let firstRetry!: (r: RetryInfo) => void;
      const retried = new Promise<RetryInfo>((r) => (firstRetry = r));
      const gw = new Gateway({
        url: split.url,
        key: split.adminKey,
        agent,
        environ: {}, // the default retries
        onSignalRetry: (r) => firstRetry(r),
      });
      const bg = new Gateway({
        url: split.url,
        key: split.adminKey,
        agent,
        environ: {},
        backgroundSignals: true,
      });
      const s = await gw.session(async (s) => {
        await openai(gw).chat.completions.create({ model: "gpt-4o-mini", messages: [] });
        return s;
      });
      await rowsFor(split, agent, 1); // the session is known to the controlplane

      await split.stopControlplane();
      const sending = s.edited({ original: "draft", final: "drafted" });
      const info = await retried; // the gateway answered 503 and the library is waiting
      assert.deepEqual([info.status, info.code], [503, "unavailable"]);
      await bg.signal(s.id, "sent"); // queued during the outage
      await split.startControlplane();
      await sending;
      assert.equal(await bg.flush(120_000), true);
      assert.equal((await bg.close()).sent, 1);
      const by = await signalsOf(split, agent, 2);
      assert.deepEqual([by.edited, by.sent], [1, 1]);
    } catch (e) {
      console.log(split.logs());
      throw e;
    } finally {
      await split.stop();
    }
  });
});

/** How long the gateway stays away: the README promises the defaults ride out a restart of a minute. */
const OUTAGE_MS = 60_000;

describe("a gateway restart of a minute", () => {
  test("is ridden out by a foreground signal with the default settings", async () => {
    // The whole gateway (`serve`) stops for a minute, then starts again on the same address and
    // database: the signal keeps retrying (connection refused), is still waiting when the minute
    // is over, and is stored once when the gateway is back.
    const g = await new RealGateway(upstream.url).start();
    try {
      const agent = unique("ts-restart");
      const retries: RetryInfo[] = [];
      let firstRetry!: () => void;
      const retried = new Promise<void>((r) => (firstRetry = r));
      const gw = new Gateway({
        url: g.url,
        key: g.adminKey,
        agent,
        environ: {}, // nothing about retries
        onSignalRetry: (r) => {
          retries.push(r);
          firstRetry();
        },
      });
      const s = await gw.session(async (s) => {
        await openai(gw).chat.completions.create({ model: "gpt-4o-mini", messages: [] });
        return s;
      });
      await rowsFor(g, agent, 1); // the session is known to the controlplane

      await g.stopServe();
      let settled: string | undefined;
      const sending = s.accepted().then(
        () => (settled = "stored"),
        (e: unknown) => (settled = `failed: ${String(e)}`),
      );
      await retried;
      assert.equal(retries[0]?.code, "connection_error");
      await sleep(OUTAGE_MS); // not a synchronisation: the outage's length
      assert.equal(settled, undefined, "gave up within the outage");
      await g.startServe();
      await sending;
      assert.equal(settled, "stored");
      assert.ok(retries.length > 5, "more retries than the old default's 5");
      const by = await signalsOf(g, agent, 1);
      assert.equal(by.accepted, 1);
    } catch (e) {
      console.log(g.logs());
      throw e;
    } finally {
      await g.stop();
    }
  });
});

/**
 * The path the provider's real API has under the gateway's base for it (api.openai.com,
 * api.anthropic.com, generativelanguage.googleapis.com, api.deepseek.com, api.x.ai,
 * api.together.xyz, api.fireworks.ai/inference, openrouter.ai/api) for the call each SDK makes.
 */
const NATIVE_PATHS: Record<string, string> = {
  openai: "/v1/chat/completions",
  anthropic: "/v1/messages",
  gemini: "/v1beta/models/gemini-2.0-flash:generateContent",
  deepseek: "/v1/chat/completions",
  xai: "/v1/chat/completions",
  together: "/v1/chat/completions",
  fireworks: "/v1/chat/completions",
  openrouter: "/v1/chat/completions",
};

describe("baseURL", () => {
  test("is what each provider's SDK takes", async () => {
    // Each SDK built by hand with baseURL = gw.baseURL(provider) (the OpenAI SDK for OpenAI and
    // the OpenAI-compatible providers) reaches the provider's native path through the gateway,
    // which records the request under that provider.
    const agent = unique("ts-base-url");
    const gw = new Gateway({ url: real.url, key: real.adminKey, agent, environ: {} });
    const messages = [{ role: "user" as const, content: "Hi" }];
    upstream.clear();
    for (const p of ["openai", "deepseek", "xai", "together", "fireworks", "openrouter"]) {
      const client = new OpenAI({
        baseURL: gw.baseURL(p),
        apiKey: "sk-test",
        fetch: gw.wrapFetch(),
        maxRetries: 0,
      });
      const r = await client.chat.completions.create({ model: "m", messages });
      assert.ok(r.choices[0]?.message.content, p);
    }
    const claude = new Anthropic({
      baseURL: gw.baseURL("anthropic"),
      apiKey: "sk-test",
      fetch: gw.wrapFetch(),
      maxRetries: 0,
    });
    await claude.messages.create({ model: "claude-test", max_tokens: 8, messages });
    const gemini = new GoogleGenAI({
      apiKey: "g-test",
      httpOptions: { baseUrl: gw.baseURL("gemini"), headers: gw.headers() },
    });
    assert.ok((await gemini.models.generateContent({ model: "gemini-2.0-flash", contents: "Hi" })).text);

    assert.deepEqual(upstream.received.map((r) => r.path).sort(), Object.values(NATIVE_PATHS).sort());
    const rows = await rowsFor(real, agent, Object.keys(NATIVE_PATHS).length);
    assert.deepEqual(rows.map((r) => r.provider).sort(), Object.keys(NATIVE_PATHS).sort());
  });
});
