/**
 * The README's TypeScript, used as a new user uses it, in a project that has the package: each
 * ```ts block type-checked by tsc as `quickstart.mts` (strict, `nodenext`: the package's types
 * must resolve through its `exports`), and saved as `quickstart.mjs` and run by node, as the
 * README says, against a real gateway of its own, with only `NM_GATEWAY_URL` and `NM_KEY` set
 * (the README's `export` lines) and no provider key (the gateway adds its operator's).
 *
 * The project is `NM_QUICKSTART_PROJECT` when set (clients/ci.sh: a fresh `npm init` project
 * with the packed tarball and `openai` installed), else a directory inside this package, which
 * imports it by self-reference. What each block did is read back from the gateway.
 */

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, describe, it } from "node:test";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";

import { MockProvider } from "./helpers/mockProvider.js";
import { eventually, RealGateway } from "./helpers/realGateway.js";

const run = promisify(execFile);
const PACKAGE = fileURLToPath(new URL("../../", import.meta.url));
const PROJECT = process.env.NM_QUICKSTART_PROJECT ?? join(PACKAGE, "build", "quickstart");
const TSC = join(PACKAGE, "node_modules", "typescript", "bin", "tsc");
const AGENT = "support-bot";

function tsBlocks(): string[] {
  const text = readFileSync(join(PACKAGE, "README.md"), "utf8");
  return [...text.matchAll(/^```ts\n([\s\S]*?)^```$/gm)].map((m) => m[1] ?? "");
}

/** What each block must leave in the gateway, in README order. */
const BLOCKS = [{ provider: "openai", user: "user-7", signals: { edited: 1 }, printsIds: true }];

let upstream: MockProvider;

before(async () => {
  upstream = await new MockProvider().start();
});

after(async () => {
  await upstream?.stop();
});

describe("the README", () => {
  it("has exactly the ts blocks run here", () => {
    assert.equal(tsBlocks().length, BLOCKS.length);
  });

  for (const [i, want] of BLOCKS.entries()) {
    it(`block ${i} compiles and runs as written`, async () => {
      const code = tsBlocks()[i] ?? "";
      mkdirSync(PROJECT, { recursive: true });
      writeFileSync(join(PROJECT, "quickstart.mts"), code);
      writeFileSync(join(PROJECT, "quickstart.mjs"), code);
      const typecheck = [
        "--noEmit",
        "--strict",
        "--module",
        "nodenext",
        "--target",
        "es2022",
        "--skipLibCheck",
      ];
      await run(process.execPath, [TSC, ...typecheck, "quickstart.mts"], { cwd: PROJECT }).catch(
        (e: unknown) => {
          const out = e as { stdout?: string };
          throw new Error(`tsc refused README block ${i}:\n${code}\n${out.stdout ?? String(e)}`);
        },
      );

      const g = await new RealGateway(upstream.url).start();
      try {
        const env: Record<string, string> = { NM_GATEWAY_URL: g.url, NM_KEY: g.adminKey };
        for (const k of ["PATH", "HOME", "LANG", "TMPDIR"]) {
          const v = process.env[k];
          if (v !== undefined) env[k] = v;
        }
        const done = await run(process.execPath, ["quickstart.mjs"], { cwd: PROJECT, env, timeout: 120_000 });

        const row = await eventually(`the request of README block ${i}`, async () => {
          const rows = await g.usage(["session", "user", "provider"], { agent: AGENT });
          assert.ok(rows.length <= 1, JSON.stringify(rows));
          return rows[0];
        });
        assert.deepEqual([row.provider, row.user, row.requests], [want.provider, want.user, 1]);
        assert.match(String(row.session), /^sess_/);
        if (want.printsIds) {
          const [sessionId, requestId] = done.stdout.trim().split(/\s+/);
          assert.equal(sessionId, row.session, done.stdout);
          assert.ok(requestId, done.stdout);
        }
        const total = Object.values(want.signals).reduce((a, b) => a + b, 0);
        const got = await eventually(`${total} signal(s) of ${AGENT}`, async () => {
          const s = await g.agentSignals(AGENT);
          return s.total === total ? s : undefined;
        });
        assert.deepEqual(
          Object.fromEntries(Object.entries(got.by_action).filter(([, n]) => n)),
          want.signals,
        );
      } catch (e) {
        console.log(g.logs());
        throw e;
      } finally {
        await g.stop();
      }
    });
  }
});
