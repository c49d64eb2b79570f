/**
 * `@nm-gateway/client/genai`: a `GoogleGenAI` client through the gateway (`/gemini`).
 * A separate entry point so that `@google/genai` stays an optional peer dependency.
 */

import { GoogleGenAI, type GoogleGenAIOptions } from "@google/genai";

import type { Gateway } from "./gateway.js";

/**
 * `new GoogleGenAI(...)` with the gateway's base URL and wired fetch (`httpOptions.baseUrl`,
 * `httpOptions.fetch`); every other option goes to the SDK unchanged. @google/genai's
 * `ApiError` carries no headers: read the gateway's code from `session.lastErrorCode`.
 */
export function genai(gw: Gateway, options: GoogleGenAIOptions = {}): GoogleGenAI {
  const http = options.httpOptions ?? {};
  return new GoogleGenAI({
    ...options,
    apiKey: gw.providerKey(options.apiKey, "GEMINI_API_KEY", "GOOGLE_API_KEY"),
    httpOptions: {
      ...http,
      baseUrl: http.baseUrl ?? gw.baseURL("gemini"),
      fetch: gw.wrapFetch(http.fetch as Parameters<Gateway["wrapFetch"]>[0]) as NonNullable<
        typeof http.fetch
      >,
    },
  });
}
