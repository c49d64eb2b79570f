/**
 * Sessions: which `NM-Session` (and `NM-User`) the wired clients send right now.
 *
 * The current session lives in one `AsyncLocalStorage`, so it follows the async work started
 * under it and nothing else: `gw.session(opts, async (s) => ...)` runs the callback with the
 * session current; every promise, timer and callback continued from inside carries it
 * (including SDK retries and stream reads), concurrent sessions each see their own, and a
 * nested session is current only inside its own callback. Outside any, none is sent.
 *
 * The wired fetch reads the store on every request and writes the answer's `NM-Request-Id`,
 * `NM-Trace-Id` and `NM-Error` into the session that was current for it.
 *
 * A signal sent from a session (`s.accepted()`, ...) names, besides the session, the last answer
 * the session's wired clients received (its `NM-Request-Id`, as `request_id`), so the gateway
 * counts it for that answer's model alone; unless that answer was a gateway-made error
 * (`NM-Error`), or there was none yet (or its id is not of the gateway's form).
 * `{ requestId: "<id>" }` names another answer of the session; `{ requestId: null }` names the
 * session only.
 */

import { AsyncLocalStorage } from "node:async_hooks";

import { editDistance as computeEditDistance } from "./editDistance.js";
import { InvalidSignal } from "./errors.js";
import { type Action, isRequestId } from "./rules.js";
import type { SignalOptions } from "./signals.js";

/** What a session needs from its gateway. */
export interface SignalSink {
  readonly agent: string | undefined;
  signal(sessionId: string | undefined, action: Action, opts?: SignalOptions): Promise<void>;
}

export class SessionState {
  requestId: string | undefined;
  traceId: string | undefined;
  errorCode: string | undefined;
  variant: string | undefined;
  constructor(
    readonly gateway: SignalSink,
    readonly id: string,
    readonly user: string | undefined,
    readonly agent: string | undefined,
  ) {}

  record(headers: Headers): void {
    this.requestId = headers.get("nm-request-id") ?? undefined;
    this.traceId = headers.get("nm-trace-id") ?? undefined;
    this.errorCode = headers.get("nm-error") ?? undefined;
    this.variant = headers.get("nm-variant") ?? undefined;
  }
}

export const storage = new AsyncLocalStorage<SessionState>();

/** Options of one signal sent from a session. */
export interface SessionSignalOptions {
  /** Any JSON value, at most 1 KiB serialized. */
  customLabel?: unknown;
  /** 1-255 visible ASCII characters; drawn at random when absent. */
  idempotencyKey?: string | undefined;
  /**
   * The answer the signal is about (an `NM-Request-Id`). Absent: the session's last answer
   * (`lastRequestId`, unless that answer was a gateway error); `null`: the session only.
   */
  requestId?: string | null | undefined;
}

/** `edited(...)`: the distance, or the two texts to compute it from. */
export type EditedOptions = SessionSignalOptions &
  (
    | { editDistance: number; original?: undefined; final?: undefined }
    | { original: string; final: string; editDistance?: undefined }
  );

/** A session: its identity, what came back last, and its signals. */
export class Session {
  constructor(private readonly state: SessionState) {}

  /** The `NM-Session` value, `sess_<id>`. */
  get id(): string {
    return this.state.id;
  }
  /** The `NM-User` value sent in this session, if any. */
  get user(): string | undefined {
    return this.state.user;
  }
  /** The `NM-Agent` value sent in this session, if any. */
  get agent(): string | undefined {
    return this.state.agent ?? this.state.gateway.agent;
  }
  /** `NM-Request-Id` of the last answer a wired client received in this session. */
  get lastRequestId(): string | undefined {
    return this.state.requestId;
  }
  /** `NM-Trace-Id` of that answer (present when the gateway traces). */
  get lastTraceId(): string | undefined {
    return this.state.traceId;
  }
  /**
   * `NM-Variant` of that answer, `<experiment id>/<arm>`: the experiment arm that served it;
   * undefined when the request was in no experiment.
   */
  get lastVariant(): string | undefined {
    return this.state.variant;
  }
  /** `NM-Error` of that answer: the gateway's own error code, undefined on success. */
  get lastErrorCode(): string | undefined {
    return this.state.errorCode;
  }

  /** Runs `fn` with this session current (for callbacks registered elsewhere). */
  run<T>(fn: () => T): T {
    return storage.run(this.state, fn);
  }

  /** Records what the end user did with this session's output (any of the 8 actions). */
  signal(
    action: Action,
    opts: SessionSignalOptions & { editDistance?: number | undefined } = {},
  ): Promise<void> {
    const { requestId, ...rest } = opts;
    return this.state.gateway.signal(this.id, action, {
      ...rest,
      agent: this.agent,
      requestId: answerOf(this.state, requestId),
    });
  }

  /** The user used the output without changes. */
  accepted(opts?: SessionSignalOptions): Promise<void> {
    return this.signal("accepted", opts);
  }
  /** The user edited the output: `{ editDistance }`, or `{ original, final }` (computed here). */
  edited(opts: EditedOptions): Promise<void> {
    const o = (opts ?? {}) as Partial<{ editDistance: number; original: string; final: string }> &
      SessionSignalOptions;
    let distance = o.editDistance;
    if (o.original !== undefined || o.final !== undefined) {
      if (distance !== undefined) {
        return Promise.reject(
          new InvalidSignal(
            "invalid_edit_distance",
            "pass either editDistance or original and final, not both",
          ),
        );
      }
      if (typeof o.original !== "string" || typeof o.final !== "string") {
        return Promise.reject(
          new InvalidSignal("invalid_edit_distance", "original and final must both be given, as strings"),
        );
      }
      distance = computeEditDistance(o.original, o.final);
    }
    return this.signal("edited", {
      customLabel: o.customLabel,
      idempotencyKey: o.idempotencyKey,
      requestId: o.requestId,
      editDistance: distance,
    });
  }
  /** The user asked for another answer. */
  regenerated(opts?: SessionSignalOptions): Promise<void> {
    return this.signal("regenerated", opts);
  }
  /** The user left without using the output. */
  abandoned(opts?: SessionSignalOptions): Promise<void> {
    return this.signal("abandoned", opts);
  }
  /** Explicit positive feedback. */
  thumbsUp(opts?: SessionSignalOptions): Promise<void> {
    return this.signal("thumbs_up", opts);
  }
  /** Explicit negative feedback. */
  thumbsDown(opts?: SessionSignalOptions): Promise<void> {
    return this.signal("thumbs_down", opts);
  }
  /** The user published the output. */
  published(opts?: SessionSignalOptions): Promise<void> {
    return this.signal("published", opts);
  }
  /** The user sent the output. */
  sent(opts?: SessionSignalOptions): Promise<void> {
    return this.signal("sent", opts);
  }

  toJSON(): { id: string; user: string | undefined } {
    return { id: this.id, user: this.user };
  }
}

/** The request id a session's signal names: the one given, or the last answer's (`null`: none). */
function answerOf(state: SessionState, requestId: string | null | undefined): string | undefined {
  if (requestId === null) return undefined;
  if (requestId !== undefined) return requestId;
  // The default never makes a signal fail: an id not of the gateway's form (something else
  // answered) names no answer, and the signal names the session only.
  const last = state.requestId;
  return state.errorCode === undefined && isRequestId(last) ? last : undefined;
}

/** The session in force here (this async context), if any. */
export function currentSession(): Session | undefined {
  const state = storage.getStore();
  return state === undefined ? undefined : new Session(state);
}
