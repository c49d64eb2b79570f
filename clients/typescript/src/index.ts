/**
 * nm-gateway client: the official provider SDKs pre-wired to the gateway, sessions set
 * automatically, signals in one line.
 *
 * ```ts
 * import { Gateway } from "@nm-gateway/client";
 * import { openai } from "@nm-gateway/client/openai";
 *
 * const gw = new Gateway({ agent: "support-bot" }); // NM_GATEWAY_URL, NM_KEY, NM_ENV from the environment
 * const client = openai(gw);                          // an OpenAI client, through the gateway
 * await gw.session({ user: "user-7" }, async (s) => {
 *   await client.chat.completions.create({ model: "gpt-4o-mini", messages: [...] });
 *   await s.accepted();                               // POST /v1/signal, idempotent, retried
 * });
 * ```
 */

export { editDistance } from "./editDistance.js";
export { ConfigError, errorCode, InvalidSignal, NMGatewayError, requestId, SignalError } from "./errors.js";
export { Gateway, type GatewayOptions, PROVIDER_KEY_PLACEHOLDER, type SessionOptions } from "./gateway.js";
export { ACTIONS, type Action, ENVS, type Env, newSessionId } from "./rules.js";
export { currentSession, type EditedOptions, Session, type SessionSignalOptions } from "./session.js";
export type { RetryInfo, SignalOptions, SignalStats } from "./signals.js";
