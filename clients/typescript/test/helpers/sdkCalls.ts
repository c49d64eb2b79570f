/** One call and one stream through each wired SDK, returning the text that came back. */

import type { Gateway } from "@nm-gateway/client";
import { anthropic } from "@nm-gateway/client/anthropic";
import { genai } from "@nm-gateway/client/genai";
import { openai } from "@nm-gateway/client/openai";

export interface Call {
  name: string;
  provider: string;
  run: (gw: Gateway) => Promise<string>;
}

const MESSAGES = [{ role: "user" as const, content: "Hallo" }];

export const CALLS: Call[] = [
  {
    name: "openai",
    provider: "openai",
    run: async (gw) => {
      const r = await openai(gw).chat.completions.create({ model: "gpt-4o-mini", messages: MESSAGES });
      return r.choices[0]?.message.content ?? "";
    },
  },
  {
    name: "openai stream",
    provider: "openai",
    run: async (gw) => {
      const stream = await openai(gw).chat.completions.create({
        model: "gpt-4o-mini",
        messages: MESSAGES,
        stream: true,
        stream_options: { include_usage: true },
      });
      let text = "";
      for await (const c of stream) text += c.choices[0]?.delta.content ?? "";
      return text;
    },
  },
  {
    name: "anthropic",
    provider: "anthropic",
    run: async (gw) => {
      const m = await anthropic(gw).messages.create({
        model: "claude-test",
        max_tokens: 64,
        messages: MESSAGES,
      });
      return m.content.map((b) => (b.type === "text" ? b.text : "")).join("");
    },
  },
  {
    name: "anthropic stream",
    provider: "anthropic",
    run: async (gw) => {
      const stream = anthropic(gw).messages.stream({
        model: "claude-test",
        max_tokens: 64,
        messages: MESSAGES,
      });
      return stream.finalText();
    },
  },
  {
    name: "genai",
    provider: "gemini",
    run: async (gw) =>
      (await genai(gw).models.generateContent({ model: "gemini-2.0-flash", contents: "Hallo" })).text ?? "",
  },
  {
    name: "genai stream",
    provider: "gemini",
    run: async (gw) => {
      let text = "";
      for await (const c of await genai(gw).models.generateContentStream({
        model: "gemini-2.0-flash",
        contents: "Hallo",
      })) {
        text += c.text ?? "";
      }
      return text;
    },
  },
];
