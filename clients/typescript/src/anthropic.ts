/**
 * `@nm-gateway/client/anthropic`: an `Anthropic` client through the gateway (`/anthropic`).
 * A separate entry point so that `@anthropic-ai/sdk` stays an optional peer dependency.
 */

import Anthropic, { type ClientOptions } from "@anthropic-ai/sdk";

import type { Gateway } from "./gateway.js";

/**
 * `new Anthropic(...)` with the gateway's base URL and wired fetch; every other option goes
 * to the SDK unchanged. With `authToken` and no `apiKey`, no placeholder key is added.
 */
export function anthropic(gw: Gateway, options: ClientOptions = {}): Anthropic {
  const given = options.apiKey;
  const apiKey =
    typeof given === "function" || (options.authToken && !given)
      ? given
      : gw.providerKey(given, "ANTHROPIC_API_KEY");
  return new Anthropic({
    ...options,
    apiKey,
    baseURL: options.baseURL ?? gw.baseURL("anthropic"),
    fetch: gw.wrapFetch(options.fetch as Parameters<Gateway["wrapFetch"]>[0]) as NonNullable<
      ClientOptions["fetch"]
    >,
  });
}
