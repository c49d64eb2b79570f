/**
 * `@nm-gateway/client/openai`: an `OpenAI` client through the gateway (`/openai/v1`).
 * A separate entry point so that `openai` stays an optional peer dependency.
 */

import OpenAI, { type ClientOptions } from "openai";

import type { Gateway } from "./gateway.js";

/**
 * `new OpenAI(...)` with the gateway's base URL and wired fetch; every other option
 * (`apiKey`, `timeout`, `maxRetries`, `defaultHeaders`, ...) goes to the SDK unchanged.
 */
export function openai(gw: Gateway, options: ClientOptions = {}): OpenAI {
  return new OpenAI({
    ...options,
    apiKey:
      typeof options.apiKey === "function"
        ? options.apiKey
        : gw.providerKey(options.apiKey, "OPENAI_API_KEY"),
    baseURL: options.baseURL ?? gw.baseURL("openai"),
    fetch: gw.wrapFetch(options.fetch as Parameters<Gateway["wrapFetch"]>[0]) as NonNullable<
      ClientOptions["fetch"]
    >,
  });
}
