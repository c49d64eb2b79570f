/**
 * The library's errors, and reading the gateway's `NM-Error` code off an SDK's error.
 *
 * Proxy errors are never wrapped: a request through a wired SDK client throws that SDK's own
 * error (`OpenAI.AuthenticationError`, `Anthropic.AuthenticationError`, genai's `ApiError`),
 * because the gateway answers in each provider's native error shape. `errorCode(err)` reads
 * the gateway's contract code from the response headers the error carries (openai and
 * @anthropic-ai/sdk keep them; @google/genai's `ApiError` does not, so for it read
 * `session.lastErrorCode`, which the wired fetch records for every answer).
 */

/** Base class of every error this library throws itself. */
export class NMGatewayError extends Error {
  override name = "NMGatewayError";
}

/** A setting (option or `NM_*` environment variable) is missing or malformed. */
export class ConfigError extends NMGatewayError {
  override name = "ConfigError";
}

export interface SignalErrorInit {
  status?: number | undefined;
  retryable?: boolean | undefined;
  requestId?: string | undefined;
}

/**
 * A signal was not stored. `code` is the endpoint's error code (`invalid_session_id`,
 * `unavailable`, ...) or `connection_error`; `status` the HTTP status (undefined when no
 * answer came); `retryable` says the failure was transient and retries ran out.
 */
export class SignalError extends NMGatewayError {
  override name = "SignalError";
  readonly code: string;
  readonly status: number | undefined;
  readonly retryable: boolean;
  readonly requestId: string | undefined;
  readonly detail: string;

  constructor(code: string, message: string, init: SignalErrorInit = {}) {
    super(`${code}: ${message}`);
    this.code = code;
    this.detail = message;
    this.status = init.status;
    this.retryable = init.retryable ?? false;
    this.requestId = init.requestId;
  }
}

/**
 * The signal breaks one of the endpoint's rules and was never sent. `code` is the code the
 * endpoint would have answered (`invalid_session_id`, `invalid_action`,
 * `edit_distance_required`, `invalid_edit_distance`, `invalid_field`).
 */
export class InvalidSignal extends SignalError {
  override name = "InvalidSignal";
  constructor(code: string, message: string) {
    super(code, message);
  }
}

function headerOf(err: unknown, name: string): string | undefined {
  if (typeof err !== "object" || err === null) return undefined;
  const e = err as { headers?: unknown; response?: { headers?: unknown } };
  for (const h of [e.headers, e.response?.headers]) {
    if (h === undefined || h === null) continue;
    if (typeof (h as Headers).get === "function") {
      const v = (h as Headers).get(name);
      if (v) return v;
    } else if (typeof h === "object") {
      for (const [k, v] of Object.entries(h as Record<string, unknown>)) {
        if (k.toLowerCase() === name && typeof v === "string" && v) return v;
      }
    }
  }
  return undefined;
}

/**
 * The gateway's `NM-Error` code behind an SDK error (`invalid_api_key`, `budget_exceeded`,
 * ...), or undefined when the error came from the provider itself or carries no headers.
 * Also works on `SignalError`.
 */
export function errorCode(err: unknown): string | undefined {
  if (err instanceof SignalError) return err.code;
  return headerOf(err, "nm-error");
}

/** The `NM-Request-Id` of the answer behind an SDK error (or a `SignalError`). */
export function requestId(err: unknown): string | undefined {
  if (err instanceof SignalError) return err.requestId;
  return headerOf(err, "nm-request-id");
}
