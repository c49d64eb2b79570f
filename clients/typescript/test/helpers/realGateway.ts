/**
 * The real `nm-gateway` binary (from `NM_GATEWAY_BIN`): `serve`, or a split controlplane +
 * dataplane, on ports they pick themselves (read from their "listening on" log lines), a
 * temporary SQLite database, every provider's upstream pointed at one mock, and an admin key
 * of generated strength. What it recorded is read back with its own CLI, polling with a
 * deadline (records reach the controlplane in batches).
 */

import assert from "node:assert/strict";
import { type ChildProcess, execFile, spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { accessSync, constants, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { promisify } from "node:util";

const run = promisify(execFile);
const PROVIDERS = [
  "openai",
  "anthropic",
  "gemini",
  "groq",
  "mistral",
  "deepseek",
  "xai",
  "together",
  "fireworks",
  "openrouter",
];
export const OPERATOR_OPENAI_KEY = "sk-operator-openai";

export function binary(): string {
  const path = process.env.NM_GATEWAY_BIN;
  if (!path) {
    throw new Error(
      "NM_GATEWAY_BIN is not set: point it at the nm-gateway binary (cargo build --bin nm-gateway; NM_GATEWAY_BIN=target/debug/nm-gateway)",
    );
  }
  accessSync(path, constants.X_OK);
  return resolve(path);
}

/** Polls `fn` until it returns a value other than undefined, for at most `deadlineMs`. */
export async function eventually<T>(
  what: string,
  fn: () => Promise<T | undefined>,
  deadlineMs = 30_000,
): Promise<T> {
  const end = Date.now() + deadlineMs;
  let pause = 20;
  let last: unknown;
  for (;;) {
    try {
      const got = await fn();
      if (got !== undefined) return got;
    } catch (e) {
      last = e;
    }
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}: ${String(last ?? "")}`);
    await new Promise((r) => setTimeout(r, pause));
    pause = Math.min(pause * 2, 250);
  }
}

class Proc {
  readonly lines: string[] = [];
  private readonly child: ChildProcess;
  private waiters: Array<() => void> = [];
  exited = false;

  constructor(
    args: string[],
    env: Record<string, string>,
    readonly name: string,
  ) {
    this.child = spawn(binary(), args, { env, stdio: ["ignore", "pipe", "pipe"] });
    let buf = "";
    const onData = (d: Buffer): void => {
      buf += d.toString("utf8");
      const parts = buf.split("\n");
      buf = parts.pop() ?? "";
      this.lines.push(...parts);
      for (const w of [...this.waiters]) w();
    };
    this.child.stdout?.on("data", onData);
    this.child.stderr?.on("data", onData);
    this.child.on("exit", () => {
      this.exited = true;
      for (const w of [...this.waiters]) w();
    });
  }

  /** Resolves with the first capture of `pattern` in the output (notified, not polled). */
  waitForLine(pattern: RegExp, deadlineMs = 60_000): Promise<string> {
    return new Promise((resolveLine, reject) => {
      const timer = setTimeout(() => {
        cleanup();
        reject(new Error(`${this.name}: no line matching ${pattern}:\n${this.output()}`));
      }, deadlineMs);
      const check = (): void => {
        for (const line of this.lines) {
          const m = pattern.exec(line);
          if (m) {
            cleanup();
            return resolveLine(m[1] ?? m[0]);
          }
        }
        if (this.exited) {
          cleanup();
          reject(new Error(`${this.name} exited:\n${this.output()}`));
        }
      };
      const cleanup = (): void => {
        clearTimeout(timer);
        this.waiters = this.waiters.filter((w) => w !== check);
      };
      this.waiters.push(check);
      check();
    });
  }

  output(): string {
    return this.lines.slice(-60).join("\n");
  }

  async stop(): Promise<void> {
    if (this.exited) return;
    const gone = new Promise<void>((r) => this.child.once("exit", () => r()));
    this.child.kill("SIGTERM");
    const timer = setTimeout(() => this.child.kill("SIGKILL"), 20_000);
    await gone;
    clearTimeout(timer);
  }
}

const listening = (what: string): RegExp => new RegExp(`${what} listening on (\\S+?)[\\s",]`);

export class RealGateway {
  readonly adminKey = "nmk_" + randomBytes(24).toString("hex");
  readonly linkSecret = randomBytes(24).toString("hex");
  url = "";
  grpcAddr = "";
  private readonly dir = mkdtempSync(join(tmpdir(), "nm-clients-ts-"));
  private readonly env: Record<string, string>;
  private controlplane: Proc | undefined;
  private dataplane: Proc | undefined;

  constructor(
    upstream: string,
    readonly split = false,
  ) {
    const base: Record<string, string> = {};
    for (const k of ["PATH", "HOME", "LANG", "TMPDIR"]) {
      const v = process.env[k];
      if (v !== undefined) base[k] = v;
    }
    Object.assign(base, {
      NM_DATABASE_URL: `sqlite://${this.dir}/nm.db?mode=rwc`,
      NM_SPOOL_DIR: `${this.dir}/spool`,
      NM_BOOTSTRAP_KEY: this.adminKey,
      NM_HTTP_ADDR: "127.0.0.1:0",
      NM_GRPC_ADDR: "127.0.0.1:0",
      NM_ANALYTICS_INTERVAL_SECS: "0",
      NM_SHUTDOWN_GRACE_SECS: "2",
      NM_LOG: "info",
      NM_PROVIDER_KEY_OPENAI: OPERATOR_OPENAI_KEY,
    });
    for (const p of PROVIDERS) base[`NM_UPSTREAM_${p.toUpperCase()}`] = upstream;
    if (split) base.NM_LINK_SECRET = this.linkSecret;
    this.env = base;
  }

  async start(): Promise<this> {
    if (this.split) {
      this.controlplane = new Proc(["controlplane"], { ...this.env }, "controlplane");
      this.grpcAddr = await this.controlplane.waitForLine(listening("controlplane gRPC"));
      this.dataplane = new Proc(
        ["dataplane"],
        { ...this.env, NM_CONTROLPLANE_URL: `http://${this.grpcAddr}` },
        "dataplane",
      );
    } else {
      this.dataplane = new Proc(["serve"], { ...this.env }, "serve");
      this.grpcAddr = await this.dataplane.waitForLine(listening("controlplane gRPC"));
    }
    this.url = `http://${await this.dataplane.waitForLine(listening("dataplane HTTP"))}`;
    await this.waitHealthy();
    return this;
  }

  async health(): Promise<number> {
    try {
      return (await fetch(`${this.url}/health`)).status;
    } catch {
      return 0;
    }
  }

  async waitHealthy(): Promise<void> {
    await eventually("/health = 200", async () => ((await this.health()) === 200 ? true : undefined), 60_000);
  }

  async stopControlplane(): Promise<void> {
    await this.controlplane?.stop();
  }

  async startControlplane(): Promise<void> {
    this.controlplane = new Proc(
      ["controlplane"],
      { ...this.env, NM_GRPC_ADDR: this.grpcAddr },
      "controlplane (restarted)",
    );
    await this.controlplane.waitForLine(listening("controlplane gRPC"));
  }

  /** `serve` only: the whole gateway goes away (clients get connection errors). */
  async stopServe(): Promise<void> {
    assert(!this.split);
    await this.dataplane?.stop();
  }

  /** `serve` only: the gateway comes back on the same addresses and database. */
  async startServe(): Promise<void> {
    assert(!this.split);
    const http = this.url.replace(/^http:\/\//, "");
    this.dataplane = new Proc(
      ["serve"],
      { ...this.env, NM_HTTP_ADDR: http, NM_GRPC_ADDR: this.grpcAddr },
      "serve (restarted)",
    );
    await this.dataplane.waitForLine(listening("dataplane HTTP"));
  }

  async stop(): Promise<void> {
    await this.dataplane?.stop();
    await this.controlplane?.stop();
    rmSync(this.dir, { recursive: true, force: true });
  }

  logs(): string {
    return [this.controlplane, this.dataplane]
      .filter((p): p is Proc => p !== undefined)
      .map((p) => `--- ${p.name}\n${p.output()}`)
      .join("\n");
  }

  async cli(...args: string[]): Promise<unknown> {
    const { stdout } = await run(binary(), [...args, "--json"], {
      env: { ...this.env, NM_CONTROLPLANE_URL: `http://${this.grpcAddr}`, NM_ADMIN_KEY: this.adminKey },
      timeout: 60_000,
    });
    return JSON.parse(stdout);
  }

  async usage(by: string[], filters: Record<string, string> = {}): Promise<Array<Record<string, unknown>>> {
    const args = ["usage", "--by", by.join(","), "--limit", "10000"];
    for (const [k, v] of Object.entries(filters)) args.push(`--${k}`, v);
    return ((await this.cli(...args)) as { rows: Array<Record<string, unknown>> }).rows;
  }

  async agentSignals(agent: string): Promise<{ total: number; by_action: Record<string, number> }> {
    return (await this.cli("agents", "show", agent)) as { total: number; by_action: Record<string, number> };
  }
}
