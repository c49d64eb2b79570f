/**
 * The gateway's rules for the values a client sends, checked before anything is sent: the
 * same rules as the gateway's own parsers, so a value accepted here is never refused there,
 * and a refused one gets an error naming the rule at the line that made it.
 */

import { randomUUID } from "node:crypto";

import { ConfigError } from "./errors.js";

/**
 * The signal actions as declared in types/signal-actions.json (the one declaration, from which
 * the gateway's own parser is generated); test/actions.test.ts checks this list, the actions
 * needing an edit distance and the session methods (one per action) against it.
 */
export const ACTIONS = [
  "accepted",
  "edited",
  "regenerated",
  "abandoned",
  "thumbs_up",
  "thumbs_down",
  "published",
  "sent",
] as const;
/** What an end user did with an output. */
export type Action = (typeof ACTIONS)[number];
/** The actions a signal must carry an edit distance with. */
export const EDIT_DISTANCE_REQUIRED: ReadonlySet<Action> = new Set<Action>(["edited"]);

export const ENVS = ["production", "staging", "development"] as const;
/** `NM-Env`. */
export type Env = (typeof ENVS)[number];

export const MAX_AGENT_LEN = 128;
export const MAX_USER_LEN = 256;
export const MAX_IDEMPOTENCY_KEY_LEN = 255;
export const MAX_CUSTOM_LABEL_BYTES = 1024;

const SESSION_RE = /^sess_[A-Za-z0-9_-]{1,128}$/;
const PRINTABLE_RE = /^[\x20-\x7e]+$/;

/** An answer's `NM-Request-Id`: a UUIDv7 in lowercase hyphenated form, as the gateway writes it. */
const REQUEST_ID_RE = /^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/;
export const REQUEST_ID_RULE =
  "request_id must be an NM-Request-Id value: a UUIDv7 in lowercase hyphenated form (36 characters, e.g. 01890a5d-ac96-774b-bcce-b302099a8057)";

export function isRequestId(value: unknown): value is string {
  return typeof value === "string" && REQUEST_ID_RE.test(value);
}

export const SESSION_RULE =
  "a session id is sess_<id>, where <id> is 1 to 128 characters of A-Z, a-z, 0-9, '_' or '-'";

/** A fresh session id: `sess_` and 32 hex digits of a random UUID. */
export function newSessionId(): string {
  return "sess_" + randomUUID().replace(/-/g, "");
}

export function isSessionId(value: unknown): value is string {
  return typeof value === "string" && SESSION_RE.test(value);
}

export function isAction(value: unknown): value is Action {
  return typeof value === "string" && (ACTIONS as readonly string[]).includes(value);
}

/** 1..maxLen visible ASCII characters, not blank, no surrounding whitespace. */
export function printable(value: unknown, maxLen: number): value is string {
  return (
    typeof value === "string" &&
    value.length > 0 &&
    value.length <= maxLen &&
    value.trim() === value &&
    PRINTABLE_RE.test(value)
  );
}

export function checkAgent(value: string | undefined, where: string): string | undefined {
  if (value === undefined) return undefined;
  if (!printable(value, MAX_AGENT_LEN)) {
    throw new ConfigError(
      `${where}: an agent name is 1 to ${MAX_AGENT_LEN} visible ASCII characters, without surrounding spaces; got ${JSON.stringify(value)}`,
    );
  }
  return value;
}

export function checkUser(value: string | undefined, where: string): string | undefined {
  if (value === undefined) return undefined;
  if (!printable(value, MAX_USER_LEN)) {
    throw new ConfigError(
      `${where}: an end-user id is 1 to ${MAX_USER_LEN} visible ASCII characters, without surrounding spaces; got ${JSON.stringify(value)}`,
    );
  }
  return value;
}

export function checkEnv(value: string | undefined, where: string): Env | undefined {
  if (value === undefined) return undefined;
  if (!(ENVS as readonly string[]).includes(value)) {
    throw new ConfigError(`${where}: env must be one of ${ENVS.join(", ")}; got ${JSON.stringify(value)}`);
  }
  return value as Env;
}

export function checkSessionId(value: string | undefined, where: string): string | undefined {
  if (value === undefined) return undefined;
  if (!isSessionId(value)) throw new ConfigError(`${where}: ${SESSION_RULE}; got ${JSON.stringify(value)}`);
  return value;
}
