/** Settings from options and environment; the client-side checks and their codes; edit distance. */

import assert from "node:assert/strict";
import { describe, it } from "node:test";

import {
  ACTIONS,
  ConfigError,
  editDistance,
  Gateway,
  InvalidSignal,
  newSessionId,
  PROVIDER_KEY_PLACEHOLDER,
} from "@nm-gateway/client";
import fc from "fast-check";

const KEY = "nmk_" + "0".repeat(48);
const GATEWAY_SESSION = /^sess_[A-Za-z0-9_-]{1,128}$/;

describe("settings", () => {
  it("come from the environment, options win", () => {
    const environ = {
      NM_GATEWAY_URL: "http://gw.internal:8080/",
      NM_KEY: KEY,
      NM_AGENT: "env-agent",
      NM_ENV: "staging",
    };
    let g = new Gateway({ environ });
    assert.deepEqual([g.url, g.agent, g.env], ["http://gw.internal:8080", "env-agent", "staging"]);
    assert.deepEqual(g.headers(), { "NM-Key": KEY, "NM-Agent": "env-agent", "NM-Env": "staging" });
    g = new Gateway({
      environ,
      url: "https://other/llm",
      key: "nmk_x",
      agent: "opt-agent",
      env: "production",
    });
    assert.deepEqual([g.url, g.agent, g.env], ["https://other/llm", "opt-agent", "production"]);
    // What each provider's SDK takes as its base URL (run through a real gateway in gateway.test.ts).
    assert.deepEqual(
      Object.fromEntries(
        ["openai", "xai", "anthropic", "gemini", "groq", "acme"].map((p) => [p, g.baseURL(p)]),
      ),
      {
        openai: "https://other/llm/openai/v1",
        xai: "https://other/llm/xai/v1",
        anthropic: "https://other/llm/anthropic",
        gemini: "https://other/llm/gemini",
        groq: "https://other/llm/groq",
        acme: "https://other/llm/acme",
      },
    );
    for (const bad of ["OpenAI", "", "../x", "a/b"]) assert.throws(() => g.baseURL(bad), /provider prefix/);
    assert.ok(!JSON.stringify(g).includes("nmk_x"));
  });

  it("read process.env by default", () => {
    const saved = { ...process.env };
    try {
      process.env.NM_GATEWAY_URL = "http://127.0.0.1:9";
      process.env.NM_KEY = KEY;
      process.env.NM_AGENT = "from-env";
      delete process.env.NM_ENV;
      const g = new Gateway();
      assert.deepEqual([g.url, g.agent, g.env], ["http://127.0.0.1:9", "from-env", undefined]);
    } finally {
      process.env = saved;
    }
  });

  const bad: Array<[Record<string, string>, object, RegExp]> = [
    [{}, { key: KEY }, /NM_GATEWAY_URL/],
    [{ NM_GATEWAY_URL: "http://gw" }, {}, /NM_KEY/],
    [{ NM_GATEWAY_URL: "gw:8080", NM_KEY: KEY }, {}, /NM_GATEWAY_URL: the gateway URL must be/],
    [{ NM_GATEWAY_URL: "ftp://gw", NM_KEY: KEY }, {}, /must be http\(s\)/],
    [{ NM_GATEWAY_URL: "http://gw/?x=1", NM_KEY: KEY }, {}, /must be http\(s\)/],
    [{ NM_GATEWAY_URL: "http://gw", NM_KEY: KEY }, { url: "gw" }, /option url: the gateway URL/],
    [{ NM_GATEWAY_URL: "http://gw", NM_KEY: KEY, NM_ENV: "prod" }, {}, /NM_ENV: env must be one of/],
    [{ NM_GATEWAY_URL: "http://gw", NM_KEY: KEY }, { env: "Production" }, /option env/],
    [{ NM_GATEWAY_URL: "http://gw", NM_KEY: KEY, NM_AGENT: "a\nb" }, {}, /NM_AGENT: an agent name/],
    [{ NM_GATEWAY_URL: "http://gw", NM_KEY: KEY }, { agent: "x".repeat(129) }, /1 to 128/],
    [{ NM_GATEWAY_URL: "http://gw", NM_KEY: KEY }, { agent: "café" }, /visible ASCII/],
    [{ NM_GATEWAY_URL: "http://gw", NM_KEY: "nmk with space" }, {}, /NM_KEY: the key must be/],
    [{ NM_GATEWAY_URL: "http://gw", NM_KEY: KEY }, { maxRetries: -1 }, /maxRetries/],
    [{ NM_GATEWAY_URL: "http://gw", NM_KEY: KEY }, { maxRetries: 1.5 }, /maxRetries/],
    [{ NM_GATEWAY_URL: "http://gw", NM_KEY: KEY }, { retryDeadlineMs: -1 }, /retryDeadlineMs/],
    [{ NM_GATEWAY_URL: "http://gw", NM_KEY: KEY }, { retryDeadlineMs: Infinity }, /retryDeadlineMs/],
    [{ NM_GATEWAY_URL: "http://gw", NM_KEY: KEY }, { retryDeadlineMs: "9" }, /retryDeadlineMs/],
  ];
  for (const [environ, opts, message] of bad) {
    it(`refuse ${JSON.stringify({ ...environ, ...opts })}`, () => {
      assert.throws(
        () => new Gateway({ environ, ...opts }),
        (e: unknown) => e instanceof ConfigError && message.test(e.message),
      );
    });
  }
});

describe("sessions ids", () => {
  it("follow the gateway's grammar", async () => {
    const ids = new Set(Array.from({ length: 1000 }, newSessionId));
    assert.equal(ids.size, 1000);
    for (const id of ids) assert.match(id, GATEWAY_SESSION);
    const gw = new Gateway({ url: "http://127.0.0.1:9", key: KEY, environ: {} });
    assert.match(await gw.session((s) => s.id), GATEWAY_SESSION);
    assert.equal(await gw.session({ id: "sess_my-own_1" }, (s) => s.id), "sess_my-own_1");
    for (const bad of ["42", "sess_", "sess_a b", "sess_é", "SESS_x", "sess_" + "a".repeat(129)]) {
      await assert.rejects(
        gw.session({ id: bad }, () => 0),
        (e: unknown) => e instanceof ConfigError && /sess_<id>/.test(e.message),
      );
    }
    await assert.rejects(
      gw.session({ user: "" }, () => 0),
      /end-user id/,
    );
    await assert.rejects(
      gw.session({ user: "u".repeat(257) }, () => 0),
      /end-user id/,
    );
    assert.equal(await gw.session({ user: "u".repeat(256) }, () => 1), 1);
  });
});

describe("signal checks", () => {
  const gw = new Gateway({ url: "http://127.0.0.1:9", key: KEY, environ: {} });
  const cases: Array<[string, unknown, object, string]> = [
    ["abc", "accepted", {}, "invalid_session_id"],
    [42 as unknown as string, "accepted", {}, "invalid_session_id"],
    [undefined as unknown as string, "accepted", {}, "missing_field"],
    [undefined as unknown as string, "accepted", { requestId: "req_1" }, "invalid_field"],
    ["sess_1", "accepted", { requestId: "01890A5D-AC96-774B-BCCE-B302099A8057" }, "invalid_field"],
    ["sess_1", "accepted", { requestId: "01890a5d-ac96-474b-bcce-b302099a8057" }, "invalid_field"],
    ["bad", "accepted", { requestId: "01890a5d-ac96-774b-bcce-b302099a8057" }, "invalid_session_id"],
    ["sess_1", "liked", {}, "invalid_action"],
    ["sess_1", "Accepted", {}, "invalid_action"],
    ["sess_1", "edited", {}, "edit_distance_required"],
    ["sess_1", "edited", { editDistance: -1 }, "invalid_edit_distance"],
    ["sess_1", "edited", { editDistance: 1.5 }, "invalid_edit_distance"],
    ["sess_1", "edited", { editDistance: "3" }, "invalid_edit_distance"],
    ["sess_1", "edited", { editDistance: Number.NaN }, "invalid_edit_distance"],
    ["sess_1", "sent", { editDistance: -3 }, "invalid_edit_distance"],
    ["sess_1", "sent", { customLabel: "x".repeat(1100) }, "invalid_field"],
    ["sess_1", "sent", { customLabel: new Map() }, "invalid_field"],
    ["sess_1", "sent", { customLabel: Number.POSITIVE_INFINITY }, "invalid_field"],
    ["sess_1", "sent", { customLabel: { f: () => 1 } }, "invalid_field"],
    ["sess_1", "sent", { idempotencyKey: "" }, "invalid_field"],
    ["sess_1", "sent", { idempotencyKey: "k".repeat(256) }, "invalid_field"],
    ["sess_1", "sent", { idempotencyKey: "ключ" }, "invalid_field"],
  ];
  for (const [sid, action, opts, code] of cases) {
    it(`${code}: ${JSON.stringify([sid, action, opts])}`, async () => {
      await assert.rejects(
        gw.signal(sid as string, action as "accepted", opts),
        (e: unknown) => e instanceof InvalidSignal && e.code === code && e.detail.length > 0,
      );
    });
  }
  it("edited takes a distance or two texts", async () => {
    await gw.session(async (s) => {
      await assert.rejects(s.edited({ editDistance: 3, original: "a", final: "b" } as never), /not both/);
      await assert.rejects(s.edited({ original: "a" } as never), /both be given/);
      await assert.rejects(
        s.edited({} as never),
        (e: unknown) => e instanceof InvalidSignal && e.code === "edit_distance_required",
      );
    });
  });
  it("exports the eight actions and the placeholder", () => {
    assert.deepEqual(
      [...ACTIONS],
      ["accepted", "edited", "regenerated", "abandoned", "thumbs_up", "thumbs_down", "published", "sent"],
    );
    assert.equal(typeof PROVIDER_KEY_PLACEHOLDER, "string");
  });
});

/** Wagner-Fischer over code points: the reference. */
function reference(x: string, y: string): number {
  const a = Array.from(x);
  const b = Array.from(y);
  let prev = Array.from({ length: b.length + 1 }, (_, j) => j);
  for (let i = 1; i <= a.length; i++) {
    const cur = [i];
    for (let j = 1; j <= b.length; j++) {
      cur.push(
        Math.min(
          (prev[j] as number) + 1,
          (cur[j - 1] as number) + 1,
          (prev[j - 1] as number) + (a[i - 1] === b[j - 1] ? 0 : 1),
        ),
      );
    }
    prev = cur;
  }
  return prev[b.length] as number;
}

describe("edit distance", () => {
  // The same fixed cases as the Python library's tests.
  const known: Array<[string, string, number]> = [
    ["", "", 0],
    ["", "abc", 3],
    ["kitten", "sitting", 3],
    ["flaw", "lawn", 2],
    ["Saturday", "Sunday", 3],
    ["ab", "ba", 2],
    ["🌍🌍", "🌍", 1],
    ["é", "e\u0301", 2],
    ["Hallo, Welt!", "Hallo Welt", 2],
    ["Hallo Welt", "Hallo, schöne Welt!", 9],
  ];
  for (const [a, b, d] of known) {
    it(`${JSON.stringify(a)} -> ${JSON.stringify(b)} = ${d}`, () => {
      assert.equal(editDistance(a, b), d);
      assert.equal(editDistance(b, a), d);
    });
  }
  const text = fc.string({ unit: fc.constantFrom("a", "b", "c", "d", " ", "é", "🌍", "\n"), maxLength: 90 });
  it("matches the reference (property)", () => {
    fc.assert(
      fc.property(text, text, (a, b) => editDistance(a, b) === reference(a, b)),
      { numRuns: 500 },
    );
  });
  it("matches the reference on any Unicode (property)", () => {
    const any = fc.string({ unit: "grapheme", maxLength: 40 });
    fc.assert(
      fc.property(any, any, (a, b) => editDistance(a, b) === reference(a, b)),
      { numRuns: 300 },
    );
  });
  it("is a metric (property)", () => {
    fc.assert(
      fc.property(text, text, text, (a, b, c) => {
        const ab = editDistance(a, b);
        return (
          editDistance(a, a) === 0 &&
          ab === editDistance(b, a) &&
          editDistance(a, c) <= ab + editDistance(b, c) &&
          ab >= Math.abs(Array.from(a).length - Array.from(b).length)
        );
      }),
      { numRuns: 200 },
    );
  });
  it("handles long drafts", () => {
    let seed = 7;
    const rnd = (): number => (seed = (seed * 1103515245 + 12345) % 2 ** 31) / 2 ** 31;
    const a = Array.from({ length: 3000 }, () => "abcdefgh "[Math.floor(rnd() * 9)]).join("");
    const b = Array.from(a);
    for (let i = 0; i < 200; i++) b[Math.floor(rnd() * b.length)] = "xyz"[Math.floor(rnd() * 3)] as string;
    const final = b.join("");
    assert.equal(editDistance(a, final), reference(a, final));
  });
  it("refuses non-strings", () => {
    assert.throws(() => editDistance(1 as unknown as string, "a"), TypeError);
  });
});
