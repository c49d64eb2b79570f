/**
 * The signal actions agree with their one declaration, types/signal-actions.json (from which the
 * gateway's own parser is generated): `ACTIONS`, the actions that need an edit distance, and one
 * session method per action (camelCase), each sending its own action.
 */

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { after, afterEach, before, describe, it } from "node:test";

import { ACTIONS, Gateway, InvalidSignal, Session } from "@nm-gateway/client";

import { MockProvider } from "./helpers/mockProvider.js";

interface Declared {
  name: string;
  requires_edit_distance: boolean;
}

// From build/test/ (the compiled test) up to the repository root.
const DECLARATION = new URL("../../../../types/signal-actions.json", import.meta.url);
const DECLARED = (JSON.parse(readFileSync(DECLARATION, "utf8")) as { actions: Declared[] }).actions;
const NAMES = DECLARED.map((a) => a.name);
const REQUIRED = new Set(DECLARED.filter((a) => a.requires_edit_distance).map((a) => a.name));
/** Public methods of a session that are not one action each. */
const GENERAL_METHODS = new Set(["constructor", "signal", "run", "toJSON"]);
const KEY = "nmk_" + "0".repeat(48);

/** `thumbs_up` -> `thumbsUp`. */
const camel = (name: string): string => name.replace(/_([a-z0-9])/g, (_, c: string) => c.toUpperCase());

/** The methods of a class (not getters) that stand for one action each. */
function actionMethods(cls: { prototype: object }): Set<string> {
  const names = Object.getOwnPropertyNames(cls.prototype).filter((n) => {
    const d = Object.getOwnPropertyDescriptor(cls.prototype, n);
    return typeof d?.value === "function" && !GENERAL_METHODS.has(n);
  });
  return new Set(names);
}

function sameSet(what: string, copy: Iterable<string>, declared: Iterable<string>): void {
  const c = new Set(copy);
  const d = new Set(declared);
  const missing = [...d].filter((n) => !c.has(n));
  const extra = [...c].filter((n) => !d.has(n));
  assert.ok(
    missing.length === 0 && extra.length === 0,
    `${what} disagrees with types/signal-actions.json: missing [${missing}], not declared [${extra}]`,
  );
}

describe("signal actions", () => {
  let fake: MockProvider;
  before(async () => {
    fake = await new MockProvider(true).start();
  });
  after(async () => fake.stop());
  afterEach(() => fake.clear());

  it("ACTIONS are the declared ones, in order", () => {
    assert.ok(NAMES.length >= 8);
    sameSet("ACTIONS", ACTIONS, NAMES);
    assert.deepEqual([...ACTIONS], NAMES);
  });

  it("one session method per action", () => {
    sameSet("Session's methods", actionMethods(Session), NAMES.map(camel));
  });

  it("a method added or missing is seen", () => {
    const methodsOf = (names: string[]) => ({
      prototype: Object.fromEntries(names.map((n) => [n, () => {}])),
    });
    const wanted = NAMES.map(camel);
    sameSet("copy", actionMethods(methodsOf([...wanted, "run", "signal"])), wanted);
    assert.throws(
      () => sameSet("copy", actionMethods(methodsOf(wanted.slice(1))), wanted),
      /missing \[accepted\]/,
    );
    assert.throws(
      () => sameSet("copy", actionMethods(methodsOf([...wanted, "notAnAction"])), wanted),
      /not declared \[notAnAction\]/,
    );
  });

  it("edit distance is required exactly for the declared actions", async () => {
    const gw = new Gateway({ url: fake.url, key: KEY, agent: "a", environ: {} });
    for (const name of NAMES) {
      const sent = gw.signal("sess_1", name as (typeof ACTIONS)[number]);
      if (REQUIRED.has(name)) {
        await assert.rejects(
          sent,
          (e: unknown) => e instanceof InvalidSignal && e.code === "edit_distance_required",
        );
      } else {
        await sent;
      }
    }
    const bodies = fake.signals().map((r) => JSON.parse(r.body) as Record<string, unknown>);
    assert.deepEqual(
      bodies.map((b) => b.action),
      NAMES.filter((n) => !REQUIRED.has(n)),
    );
  });

  it("each method sends its action", async () => {
    const gw = new Gateway({ url: fake.url, key: KEY, agent: "a", environ: {} });
    await gw.session({}, async (s) => {
      for (const name of NAMES) {
        const method = (s as unknown as Record<string, (opts?: object) => Promise<void>>)[camel(name)];
        assert.ok(method, `Session has no ${camel(name)}()`);
        await method.call(s, REQUIRED.has(name) ? { editDistance: 3 } : undefined);
      }
    });
    const bodies = fake.signals().map((r) => JSON.parse(r.body) as Record<string, unknown>);
    assert.deepEqual(
      bodies.map((b) => b.action),
      NAMES,
    );
  });
});
