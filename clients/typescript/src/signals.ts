/**
 * `POST /v1/signal`: checked here, sent with an idempotency key, retried when that is safe.
 *
 * 1. `buildSignal` checks every field by the endpoint's rules and throws `InvalidSignal` (with
 *    the code the endpoint would answer); nothing invalid is sent. The body is serialized once
 *    and one `Idempotency-Key` is drawn for it.
 * 2. `Sender.send` posts it. 200 `{"ok": true}` means the controlplane committed it. 503
 *    `unavailable`, 429 and connection errors (refused, reset, timed out) are retried with the
 *    same body and key, so a resend of a signal that was in fact stored is counted once. The
 *    wait is the answer's `Retry-After`, else exponential backoff with full jitter (at most
 *    `BACKOFF_CAP_MS`); each wait is capped (`MAX_WAIT_MS`). What bounds the retries is time:
 *    none starts later than `retryDeadlineMs` (default 90 s) after the first attempt, so the
 *    default rides out a gateway restart of a minute, and a call settles within
 *    `retryDeadlineMs + timeoutMs`; `maxRetries`, when set, also bounds their number. Any
 *    other answer is final.
 * 3. Background mode (`SignalQueue`): the caller only runs step 1 and enqueues; one async
 *    loop sends in order. The queue is bounded; when full the signal is dropped and counted.
 *    Its pending work keeps Node running until the queue is drained; once only its backoff
 *    waits are left (`beforeExit`), it keeps going for at most `flushTimeoutMs`, then gives
 *    up; on `exit` it reports what was dropped, failed or left unsent on stderr.
 */

import { randomUUID } from "node:crypto";

import { InvalidSignal, SignalError } from "./errors.js";
import {
  type Action,
  ACTIONS,
  EDIT_DISTANCE_REQUIRED,
  isAction,
  isSessionId,
  MAX_CUSTOM_LABEL_BYTES,
  isRequestId,
  MAX_IDEMPOTENCY_KEY_LEN,
  printable,
  REQUEST_ID_RULE,
  SESSION_RULE,
} from "./rules.js";

export const MAX_WAIT_MS = 30_000;
const BACKOFF_BASE_MS = 250;
const BACKOFF_CAP_MS = 5_000;
/** No retry starts later than this after a signal's first attempt (unless set otherwise). */
export const DEFAULT_RETRY_DEADLINE_MS = 90_000;
const RETRY_STATUSES = new Set([429, 503]);
const USER_AGENT = "nm-gateway-typescript/0.1.0";

export interface SignalOptions {
  /** Characters changed; required for `edited`. */
  editDistance?: number | undefined;
  /** Any JSON value, at most 1 KiB serialized. */
  customLabel?: unknown;
  /** 1-255 visible ASCII characters; drawn at random when absent. */
  idempotencyKey?: string | undefined;
  /** `NM-Agent` of the signal request (defaults to the gateway's agent). */
  agent?: string | undefined;
  /**
   * The answer the signal is about: its `NM-Request-Id`. The gateway then counts the signal for
   * that answer's model alone; the session may then be left out.
   */
  requestId?: string | undefined;
}

/** A checked signal, ready to send (and resend unchanged). */
export interface Signal {
  /** The session named, or undefined when the signal names only an answer. */
  readonly sessionId: string | undefined;
  /** The answer named (its `NM-Request-Id`), if any. */
  readonly requestId: string | undefined;
  readonly action: Action;
  readonly body: string;
  readonly idempotencyKey: string;
  readonly agent: string | undefined;
}

/** Background-mode counters. */
export interface SignalStats {
  sent: number;
  failed: number;
  dropped: number;
  pending: number;
}

export function buildSignal(sessionId: unknown, action: unknown, opts: SignalOptions = {}): Signal {
  const requestId: unknown = opts.requestId;
  if ((sessionId === undefined || sessionId === null) && (requestId === undefined || requestId === null)) {
    throw new InvalidSignal(
      "missing_field",
      "a signal names a session (sessionId) or an answer (requestId), or both",
    );
  }
  if (sessionId !== undefined && sessionId !== null && !isSessionId(sessionId)) {
    throw new InvalidSignal("invalid_session_id", `${SESSION_RULE}; got ${JSON.stringify(sessionId)}`);
  }
  if (requestId !== undefined && requestId !== null && !isRequestId(requestId)) {
    throw new InvalidSignal("invalid_field", `${REQUEST_ID_RULE}; got ${JSON.stringify(requestId)}`);
  }
  const session = isSessionId(sessionId) ? sessionId : undefined;
  const answer = isRequestId(requestId) ? requestId : undefined;
  if (!isAction(action)) {
    throw new InvalidSignal(
      "invalid_action",
      `action must be one of ${ACTIONS.join(", ")}; got ${JSON.stringify(action)}`,
    );
  }
  const { editDistance, customLabel } = opts;
  if (
    editDistance !== undefined &&
    editDistance !== null &&
    !(typeof editDistance === "number" && Number.isSafeInteger(editDistance) && editDistance >= 0)
  ) {
    throw new InvalidSignal(
      "invalid_edit_distance",
      `editDistance must be a non-negative integer (characters changed); got ${String(editDistance)}`,
    );
  }
  if (EDIT_DISTANCE_REQUIRED.has(action) && (editDistance === undefined || editDistance === null)) {
    throw new InvalidSignal(
      "edit_distance_required",
      `editDistance is required when action is ${action}: pass { editDistance }, or { original, final } to have it computed`,
    );
  }
  const body: Record<string, unknown> = {};
  if (session !== undefined) body.session_id = session;
  if (answer !== undefined) body.request_id = answer;
  body.action = action;
  if (editDistance !== undefined && editDistance !== null) body.edit_distance = editDistance;
  if (customLabel !== undefined && customLabel !== null) {
    let label: string | undefined;
    try {
      label = JSON.stringify(customLabel);
    } catch (e) {
      throw new InvalidSignal("invalid_field", `customLabel must be a JSON value: ${(e as Error).message}`);
    }
    if (label === undefined || !isPlainJson(customLabel)) {
      throw new InvalidSignal(
        "invalid_field",
        "customLabel must be a JSON value (object, array, string, finite number, boolean)",
      );
    }
    const size = Buffer.byteLength(label, "utf8");
    if (size > MAX_CUSTOM_LABEL_BYTES) {
      throw new InvalidSignal(
        "invalid_field",
        `customLabel must be at most ${MAX_CUSTOM_LABEL_BYTES} bytes of JSON; got ${size}`,
      );
    }
    body.custom_label = customLabel;
  }
  let key = opts.idempotencyKey;
  if (key === undefined) {
    key = "sig_" + randomUUID().replace(/-/g, "");
  } else if (!printable(key, MAX_IDEMPOTENCY_KEY_LEN)) {
    throw new InvalidSignal(
      "invalid_field",
      `idempotencyKey must be 1 to ${MAX_IDEMPOTENCY_KEY_LEN} visible ASCII characters, without surrounding spaces; got ${JSON.stringify(key)}`,
    );
  }
  return {
    sessionId: session,
    requestId: answer,
    action,
    body: JSON.stringify(body),
    idempotencyKey: key,
    agent: opts.agent,
  };
}

/** Values JSON.stringify would silently turn into null or drop are refused instead. */
function isPlainJson(v: unknown, depth = 0): boolean {
  if (depth > 64) return false;
  if (v === null || typeof v === "string" || typeof v === "boolean") return true;
  if (typeof v === "number") return Number.isFinite(v);
  if (Array.isArray(v)) return v.every((x) => isPlainJson(x, depth + 1));
  if (typeof v === "object") {
    const proto = Object.getPrototypeOf(v);
    if (proto !== Object.prototype && proto !== null) return false;
    return Object.values(v as Record<string, unknown>).every((x) => isPlainJson(x, depth + 1));
  }
  return false;
}

/** `Retry-After` in milliseconds: delta-seconds or an HTTP-date (RFC 9110 §10.2.3). */
export function parseRetryAfter(
  value: string | null | undefined,
  now: number = Date.now(),
): number | undefined {
  if (value === null || value === undefined) return undefined;
  const v = value.trim();
  if (/^\d+$/.test(v)) return Number(v) * 1000;
  const when = Date.parse(v);
  if (Number.isNaN(when)) return undefined;
  return Math.max(0, when - now);
}

interface Outcome {
  ok: boolean;
  retryable: boolean;
  status?: number | undefined;
  code: string;
  message: string;
  retryAfterMs?: number | undefined;
  requestId?: string | undefined;
}

export interface SenderOptions {
  url: string;
  key: string;
  timeoutMs: number;
  /** Retries at most this many times; undefined: no count, only the deadline. */
  maxRetries: number | undefined;
  /** No retry starts later than this after the first attempt. */
  retryDeadlineMs: number;
  fetch: typeof fetch;
  /** Called before each retry wait (for logs; the tests use it to see a retry happen). */
  onRetry?: ((info: RetryInfo) => void) | undefined;
}

export interface RetryInfo {
  signal: Signal;
  attempt: number;
  delayMs: number;
  status: number | undefined;
  code: string;
}

function sleep(ms: number, unref: boolean, abort?: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    if (abort?.aborted) return resolve();
    const t = setTimeout(done, ms);
    if (unref) t.unref();
    function done(): void {
      clearTimeout(t);
      abort?.removeEventListener("abort", done);
      resolve();
    }
    abort?.addEventListener("abort", done, { once: true });
  });
}

export class Sender {
  readonly endpoint: string;
  constructor(readonly opts: SenderOptions) {
    this.endpoint = opts.url + "/v1/signal";
  }

  async attempt(sig: Signal): Promise<Outcome> {
    const headers: Record<string, string> = {
      "NM-Key": this.opts.key,
      "Content-Type": "application/json",
      "Idempotency-Key": sig.idempotencyKey,
      "User-Agent": USER_AGENT,
    };
    if (sig.agent !== undefined) headers["NM-Agent"] = sig.agent;
    let res: Response;
    let text: string;
    try {
      res = await this.opts.fetch(this.endpoint, {
        method: "POST",
        headers,
        body: sig.body,
        signal: AbortSignal.timeout(this.opts.timeoutMs),
      });
      text = await res.text();
    } catch (e) {
      // Refused, reset, timed out: nothing says it was stored, and the key makes a resend safe.
      const cause = (e as { cause?: { code?: string; message?: string } }).cause;
      const why = cause?.code ?? cause?.message ?? (e as Error).message;
      return {
        ok: false,
        retryable: true,
        code: "connection_error",
        message: `could not reach ${this.endpoint}: ${why}`,
      };
    }
    const requestId = res.headers.get("nm-request-id") ?? undefined;
    if (res.status === 200)
      return { ok: true, retryable: false, status: 200, code: "", message: "", requestId };
    let code = res.headers.get("nm-error") ?? "";
    let message = "";
    try {
      const err = (JSON.parse(text) as { error?: { code?: unknown; message?: unknown } }).error;
      if (!code && typeof err?.code === "string") code = err.code;
      if (typeof err?.message === "string") message = err.message;
    } catch {
      // not JSON: the status says enough
    }
    return {
      ok: false,
      retryable: RETRY_STATUSES.has(res.status),
      status: res.status,
      code: code || `http_${res.status}`,
      message: message || `the gateway answered ${res.status}`,
      retryAfterMs: parseRetryAfter(res.headers.get("retry-after")),
      requestId,
    };
  }

  delayMs(attempt: number, retryAfterMs: number | undefined): number {
    if (retryAfterMs !== undefined) return Math.min(retryAfterMs, MAX_WAIT_MS);
    return Math.random() * Math.min(BACKOFF_CAP_MS, BACKOFF_BASE_MS * 2 ** attempt);
  }

  /** Sends until stored; throws `SignalError` on a final answer or when retries run out. */
  async send(sig: Signal, opts: { unrefWaits?: boolean; abort?: AbortSignal } = {}): Promise<void> {
    const started = performance.now();
    for (let attempt = 0; ; attempt++) {
      const out = await this.attempt(sig);
      if (out.ok) return;
      const { maxRetries, retryDeadlineMs } = this.opts;
      const leftMs = retryDeadlineMs - (performance.now() - started);
      if (
        !out.retryable ||
        (maxRetries !== undefined && attempt >= maxRetries) ||
        leftMs <= 0 ||
        opts.abort?.aborted
      ) {
        const gaveUp = out.retryable
          ? ` (gave up after ${attempt + 1} attempt(s) in ${((performance.now() - started) / 1000).toFixed(1)}s)`
          : "";
        throw new SignalError(out.code, out.message + gaveUp, {
          status: out.status,
          retryable: out.retryable,
          requestId: out.requestId,
        });
      }
      const delayMs = Math.min(this.delayMs(attempt, out.retryAfterMs), leftMs);
      this.opts.onRetry?.({ signal: sig, attempt: attempt + 1, delayMs, status: out.status, code: out.code });
      await sleep(delayMs, opts.unrefWaits ?? false, opts.abort);
    }
  }
}

// === background mode ===

const liveQueues = new Set<SignalQueue>();
let processHooked = false;

function hookProcess(): void {
  if (processHooked) return;
  processHooked = true;
  process.on("beforeExit", () => {
    for (const q of liveQueues) q.finalFlush();
  });
  process.on("exit", () => {
    for (const q of liveQueues) q.report("exit");
  });
}

export class SignalQueue {
  private readonly queue: Signal[] = [];
  private sent = 0;
  private failed = 0;
  private dropped = 0;
  private inFlight = 0;
  private running = false;
  private closed = false;
  private reported = false;
  private finalizing = false;
  private readonly abort = new AbortController();
  private idleWaiters: Array<() => void> = [];

  constructor(
    private readonly sender: Sender,
    private readonly maxSize: number,
    private readonly flushTimeoutMs: number,
  ) {
    liveQueues.add(this);
    hookProcess();
  }

  put(sig: Signal): void {
    if (this.closed) throw new Error("the gateway's signal queue is closed");
    if (this.queue.length >= this.maxSize) {
      this.dropped++;
      if ((this.dropped & (this.dropped - 1)) === 0) {
        process.emitWarning(`signal queue full (${this.maxSize}): ${this.dropped} signal(s) dropped so far`, {
          code: "NM_GATEWAY_SIGNALS_DROPPED",
        });
      }
      return;
    }
    this.queue.push(sig);
    if (!this.running) void this.run();
  }

  private async run(): Promise<void> {
    this.running = true;
    while (this.queue.length > 0 && !this.abort.signal.aborted) {
      const sig = this.queue.shift() as Signal;
      this.inFlight++;
      try {
        await this.sender.send(sig, { unrefWaits: true, abort: this.abort.signal });
        this.sent++;
      } catch (e) {
        this.failed++;
        process.emitWarning(
          `signal ${sig.action} for ${sig.requestId ?? sig.sessionId} not stored: ${(e as Error).message}`,
          {
            code: "NM_GATEWAY_SIGNAL_FAILED",
          },
        );
      } finally {
        this.inFlight--;
      }
    }
    this.running = false;
    if (this.pending() === 0 || this.abort.signal.aborted) {
      const waiters = this.idleWaiters;
      this.idleWaiters = [];
      for (const w of waiters) w();
    }
  }

  private pending(): number {
    return this.queue.length + this.inFlight;
  }

  stats(): SignalStats {
    return { sent: this.sent, failed: this.failed, dropped: this.dropped, pending: this.pending() };
  }

  /** Resolves true once every queued signal was sent or failed, false after `timeoutMs`. */
  flush(timeoutMs?: number): Promise<boolean> {
    if (this.pending() === 0) return Promise.resolve(true);
    if (this.abort.signal.aborted && !this.running) return Promise.resolve(false);
    return new Promise((resolve) => {
      let timer: NodeJS.Timeout | undefined;
      const done = (): void => {
        if (timer) clearTimeout(timer);
        resolve(this.pending() === 0);
      };
      this.idleWaiters.push(done);
      if (timeoutMs !== undefined) {
        timer = setTimeout(() => {
          this.idleWaiters = this.idleWaiters.filter((w) => w !== done);
          resolve(false);
        }, timeoutMs);
      }
    });
  }

  /** Flushes for up to `timeoutMs`, stops taking signals, gives up on the rest, reports once. */
  async close(timeoutMs?: number): Promise<SignalStats> {
    await this.flush(timeoutMs);
    this.closed = true;
    this.abort.abort();
    this.report("close");
    liveQueues.delete(this);
    return this.stats();
  }

  /** `beforeExit`: only our backoff waits are left; keep going for at most flushTimeoutMs. */
  finalFlush(): void {
    if (this.finalizing || this.pending() === 0) return;
    this.finalizing = true;
    const deadline = setTimeout(() => this.abort.abort(), this.flushTimeoutMs);
    void this.flush().then(() => clearTimeout(deadline));
  }

  /** Reports losses once, on stderr: worded as the Python library's report (`LOSS_REPORT`). */
  report(at: "close" | "exit"): void {
    if (this.reported) return;
    const st = this.stats();
    if (st.dropped || st.failed || st.pending) {
      this.reported = true;
      process.stderr.write(
        `nm-gateway signals: ${st.sent} sent, ${st.failed} failed, ${st.dropped} dropped (queue full), ${st.pending} unsent at ${at}\n`,
      );
    }
  }
}
