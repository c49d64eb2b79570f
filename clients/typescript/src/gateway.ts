/**
 * `Gateway`: the settings, the wired `fetch`, sessions and signals.
 *
 * A wired SDK client (see `./openai`, `./anthropic`, `./genai`) is the provider's own client
 * with its base URL pointed at `<gateway>/<provider prefix>` and its `fetch` option set to
 * `gw.wrapFetch()`, which, on every request (SDK retries included):
 *
 * - adds `NM-Key`, `NM-Agent`, `NM-Env`, and in a session `NM-Session` and `NM-User`; a header
 *   the caller set explicitly wins;
 * - drops the placeholder provider credential (below), so the gateway adds its operator's
 *   `NM_PROVIDER_KEY_<PROVIDER>`;
 * - stores the answer's `NM-Request-Id`, `NM-Trace-Id` and `NM-Error` in the session.
 *
 * Provider credentials: an `apiKey` option, else the SDK's environment variable, goes to the
 * provider as usual. Without either the SDKs refuse to start, so they get a placeholder that
 * the wired fetch removes before sending.
 */

import { ConfigError } from "./errors.js";
import {
  type Action,
  checkAgent,
  checkEnv,
  checkSessionId,
  checkUser,
  type Env,
  newSessionId,
  printable,
} from "./rules.js";
import { Session, SessionState, type SignalSink, storage } from "./session.js";
import {
  buildSignal,
  DEFAULT_RETRY_DEADLINE_MS,
  type RetryInfo,
  Sender,
  type SignalOptions,
  SignalQueue,
  type SignalStats,
} from "./signals.js";

/** Sent as the provider API key when none is configured; removed before the request leaves. */
export const PROVIDER_KEY_PLACEHOLDER = "nm-gateway-no-provider-key";
const CREDENTIAL_HEADERS = ["authorization", "x-api-key", "x-goog-api-key"];
/**
 * What a provider's SDK expects after the gateway's prefix. The OpenAI SDK takes a base URL
 * that ends in the API version and appends `/chat/completions`; the OpenAI-compatible
 * built-ins are used through it (their docs: api.x.ai/v1, api.together.xyz/v1,
 * api.fireworks.ai/inference/v1, openrouter.ai/api/v1, api.deepseek.com/v1; the gateway's
 * bases for them end before `/v1`). Anthropic's, Google's, Groq's and Mistral's SDKs append
 * their own version path, so theirs is the bare prefix; so is a provider of your own.
 */
const SDK_PATHS = new Map(
  ["openai", "deepseek", "xai", "together", "fireworks", "openrouter"].map((p) => [p, "/v1"]),
);

export interface GatewayOptions {
  /** Gateway base URL; default `NM_GATEWAY_URL`. */
  url?: string | undefined;
  /** Service API key (`NM-Key`); default `NM_KEY`. */
  key?: string | undefined;
  /** `NM-Agent`; default `NM_AGENT`. */
  agent?: string | undefined;
  /** `NM-Env`; default `NM_ENV`. */
  env?: Env | undefined;
  /** Per signal attempt. Default 10 s. */
  timeoutMs?: number | undefined;
  /**
   * Transient signal failures (503, 429, connection) are retried until this long after the
   * first attempt. Default 90 s: a gateway restart of a minute is ridden out.
   */
  retryDeadlineMs?: number | undefined;
  /** At most this many signal retries after the first attempt. Default: no count, only the deadline. */
  maxRetries?: number | undefined;
  /** Signal calls only check and queue; one background loop sends. Default false. */
  backgroundSignals?: boolean | undefined;
  /** Background queue bound; beyond it signals are dropped and counted. Default 10,000. */
  queueSize?: number | undefined;
  /** How long queued signals may still be retried once the process is otherwise done. Default 10 s. */
  flushTimeoutMs?: number | undefined;
  /** The fetch the library and wired clients use underneath. Default `globalThis.fetch`. */
  fetch?: typeof fetch | undefined;
  /** Called before each signal retry wait (for logs). */
  onSignalRetry?: ((info: RetryInfo) => void) | undefined;
  /** Where `NM_*` are read from. Default `process.env`. */
  environ?: Record<string, string | undefined> | undefined;
}

export interface SessionOptions {
  /** `sess_<id>`; a fresh one when absent. */
  id?: string | undefined;
  /** `NM-User` for every request in the session. */
  user?: string | undefined;
  /** Overrides the gateway's agent inside the session. */
  agent?: string | undefined;
}

type FetchLike = (input: string | URL | Request, init?: RequestInit) => Promise<Response>;

export class Gateway implements SignalSink {
  readonly url: string;
  readonly agent: string | undefined;
  readonly env: Env | undefined;
  readonly #key: string;
  readonly #fetch: typeof fetch;
  readonly #sender: Sender;
  readonly #queue: SignalQueue | undefined;

  constructor(opts: GatewayOptions = {}) {
    const environ = opts.environ ?? process.env;
    const pick = (arg: string | undefined, name: string, option: string): [string | undefined, string] =>
      arg !== undefined ? [arg, `option ${option}`] : [environ[name] || undefined, name];

    const [rawUrl, urlSrc] = pick(opts.url, "NM_GATEWAY_URL", "url");
    if (rawUrl === undefined) {
      throw new ConfigError(
        "no gateway URL: pass { url } or set NM_GATEWAY_URL (e.g. http://localhost:8080)",
      );
    }
    const url = rawUrl.trim().replace(/\/+$/, "");
    let parsed: URL | undefined;
    try {
      parsed = new URL(url);
    } catch {
      parsed = undefined;
    }
    if (
      !parsed ||
      !["http:", "https:"].includes(parsed.protocol) ||
      !parsed.host ||
      parsed.search ||
      parsed.hash
    ) {
      throw new ConfigError(
        `${urlSrc}: the gateway URL must be http(s)://host[:port][/path]; got ${JSON.stringify(rawUrl)}`,
      );
    }
    const [key, keySrc] = pick(opts.key, "NM_KEY", "key");
    if (key === undefined)
      throw new ConfigError("no NM-Key: pass { key } or set NM_KEY (a service API key, nmk_...)");
    if (!printable(key, 1024) || key.includes(" ")) {
      throw new ConfigError(`${keySrc}: the key must be visible ASCII without spaces`);
    }
    const [agent, agentSrc] = pick(opts.agent, "NM_AGENT", "agent");
    const [env, envSrc] = pick(opts.env, "NM_ENV", "env");
    const maxRetries = opts.maxRetries;
    if (maxRetries !== undefined && (!Number.isSafeInteger(maxRetries) || maxRetries < 0)) {
      throw new ConfigError(
        `maxRetries must be undefined or a non-negative integer; got ${String(maxRetries)}`,
      );
    }
    const retryDeadlineMs = opts.retryDeadlineMs ?? DEFAULT_RETRY_DEADLINE_MS;
    if (typeof retryDeadlineMs !== "number" || !(retryDeadlineMs >= 0 && retryDeadlineMs < Infinity)) {
      throw new ConfigError(
        `retryDeadlineMs must be a number of milliseconds >= 0; got ${String(retryDeadlineMs)}`,
      );
    }
    const timeoutMs = opts.timeoutMs ?? 10_000;
    if (!(timeoutMs > 0)) throw new ConfigError(`timeoutMs must be positive; got ${String(timeoutMs)}`);
    const queueSize = opts.queueSize ?? 10_000;
    if (!Number.isSafeInteger(queueSize) || queueSize < 1) {
      throw new ConfigError(`queueSize must be a positive integer; got ${String(queueSize)}`);
    }

    this.url = url;
    this.#key = key;
    this.agent = checkAgent(agent, agentSrc);
    this.env = checkEnv(env, envSrc);
    this.#fetch = opts.fetch ?? globalThis.fetch.bind(globalThis);
    this.#sender = new Sender({
      url,
      key,
      timeoutMs,
      maxRetries,
      retryDeadlineMs,
      fetch: this.#fetch,
      onRetry: opts.onSignalRetry,
    });
    this.#queue = opts.backgroundSignals
      ? new SignalQueue(this.#sender, queueSize, opts.flushTimeoutMs ?? 10_000)
      : undefined;
  }

  /**
   * The base URL to give the provider's SDK: `<gateway>/openai/v1` for the OpenAI SDK (and
   * `/v1` after `deepseek`, `xai`, `together`, `fireworks`, `openrouter`, used through it);
   * `<gateway>/<provider>` for the SDKs that add their version path themselves (`anthropic`,
   * `gemini`, `groq`, `mistral`) and for providers of your own.
   */
  baseURL(provider: string): string {
    if (!/^[a-z0-9][a-z0-9_-]*$/.test(provider)) {
      throw new Error(`a provider prefix is a lowercase name like 'openai'; got ${JSON.stringify(provider)}`);
    }
    return `${this.url}/${provider}${SDK_PATHS.get(provider) ?? ""}`;
  }

  toJSON(): { url: string; agent: string | undefined; env: string | undefined } {
    return { url: this.url, agent: this.agent, env: this.env };
  }

  // === attribution ===

  /** The `NM-*` headers a request made here and now would carry. */
  headers(): Record<string, string> {
    const state = storage.getStore();
    const out: Record<string, string> = { "NM-Key": this.#key };
    const agent = state?.agent ?? this.agent;
    if (agent) out["NM-Agent"] = agent;
    if (this.env) out["NM-Env"] = this.env;
    if (state) {
      out["NM-Session"] = state.id;
      if (state.user) out["NM-User"] = state.user;
    }
    return out;
  }

  /**
   * A `fetch` that adds the gateway's headers and records the answer in the current session:
   * pass it as the `fetch` option of any SDK pointed at the gateway.
   */
  wrapFetch(inner?: FetchLike): typeof fetch {
    const base: FetchLike = inner ?? this.#fetch;
    const wired = async (input: string | URL | Request, init?: RequestInit): Promise<Response> => {
      const state = storage.getStore();
      const headers = new Headers(init?.headers ?? (input instanceof Request ? input.headers : undefined));
      for (const [name, value] of Object.entries(this.headers())) {
        if (!headers.has(name)) headers.set(name, value);
      }
      for (const name of CREDENTIAL_HEADERS) {
        if (headers.get(name)?.includes(PROVIDER_KEY_PLACEHOLDER)) headers.delete(name);
      }
      const res = await base(input, { ...init, headers });
      state?.record(res.headers);
      return res;
    };
    return wired as typeof fetch;
  }

  // === sessions ===

  /**
   * Runs `fn` in a session: every request of every wired client made from it (and from the
   * async work it starts) carries `NM-Session` (a fresh `sess_<32 hex>` unless `id` is given)
   * and `NM-User` when `user` is set. Resolves to what `fn` returns.
   */
  session<T>(fn: (s: Session) => T | Promise<T>): Promise<T>;
  session<T>(opts: SessionOptions, fn: (s: Session) => T | Promise<T>): Promise<T>;
  session<T>(
    a: SessionOptions | ((s: Session) => T | Promise<T>),
    b?: (s: Session) => T | Promise<T>,
  ): Promise<T> {
    const opts: SessionOptions = typeof a === "function" ? {} : a;
    const fn = typeof a === "function" ? a : b;
    if (typeof fn !== "function") {
      return Promise.reject(new TypeError("gw.session(options, async (s) => ...) needs a callback"));
    }
    let state: SessionState;
    try {
      state = new SessionState(
        this,
        checkSessionId(opts.id, "session id") ?? newSessionId(),
        checkUser(opts.user, "session user"),
        checkAgent(opts.agent, "session agent"),
      );
    } catch (e) {
      return Promise.reject(e);
    }
    return storage.run(state, async () => fn(new Session(state)));
  }

  // === signals ===

  /**
   * Records a signal for any session, or for one answer (`{ requestId }`: the answer's
   * `NM-Request-Id`; `sessionId` may then be undefined): checked here (`InvalidSignal`), sent
   * with an `Idempotency-Key` (drawn unless given), retried on 503/429/connection errors;
   * rejects with `SignalError` when not stored (code `session_mismatch` when the answer belongs
   * to another session). In background mode: checked and queued only.
   */
  async signal(sessionId: string | undefined, action: Action, opts: SignalOptions = {}): Promise<void> {
    const sig = buildSignal(sessionId, action, {
      ...opts,
      agent: checkAgent(opts.agent, "agent") ?? this.agent,
    });
    if (this.#queue) {
      this.#queue.put(sig);
      return;
    }
    await this.#sender.send(sig);
  }

  /** Background mode: resolves true once the queue is empty, false if `timeoutMs` ran out. */
  flush(timeoutMs?: number): Promise<boolean> {
    return this.#queue ? this.#queue.flush(timeoutMs) : Promise.resolve(true);
  }

  /** Background mode: flushes, stops taking signals, reports losses. Resolves to the counts. */
  close(timeoutMs?: number): Promise<SignalStats> {
    return this.#queue
      ? this.#queue.close(timeoutMs)
      : Promise.resolve({ sent: 0, failed: 0, dropped: 0, pending: 0 });
  }

  /** Background mode: signals sent, failed, dropped (queue full) and still pending. */
  signalStats(): SignalStats {
    return this.#queue ? this.#queue.stats() : { sent: 0, failed: 0, dropped: 0, pending: 0 };
  }

  /** The provider key to give an SDK: the option, else its environment variables, else the placeholder. */
  providerKey(apiKey: string | null | undefined, ...envNames: string[]): string {
    if (apiKey) return apiKey;
    for (const name of envNames) {
      const v = process.env[name];
      if (v) return v;
    }
    return PROVIDER_KEY_PLACEHOLDER;
  }
}
