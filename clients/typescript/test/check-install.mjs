// Copied into a fresh `npm init` project where the packed tarball is installed, and run there
// (clients/ci.sh), so that its imports resolve as the project's own code's would: every entry
// point imports as an ES module, and loads with `require` where Node can `require` ES modules
// (20.19+, 22.12+), as the README says. Usage: cp check-install.mjs PROJECT && node PROJECT/check-install.mjs
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const project = dirname(fileURLToPath(import.meta.url));
const manifest = JSON.parse(readFileSync(join(project, "package.json"), "utf8"));
assert.equal(manifest.type ?? "commonjs", "commonjs", "npm init makes a CommonJS project");
const entries = {
  "@nm-gateway/client": "Gateway",
  "@nm-gateway/client/openai": "openai",
  "@nm-gateway/client/anthropic": "anthropic",
  "@nm-gateway/client/genai": "genai",
};
for (const [entry, name] of Object.entries(entries)) {
  const esm = await import(entry);
  assert.equal(typeof esm[name], "function", `${entry} exports ${name}`);
}
const require = createRequire(import.meta.url);
const [major, minor] = process.versions.node.split(".").map(Number);
const requiresEsm = major > 22 || (major === 22 && minor >= 12) || (major === 20 && minor >= 19);
if (requiresEsm) {
  for (const [entry, name] of Object.entries(entries)) {
    assert.equal(typeof require(entry)[name], "function", `require("${entry}").${name}`);
  }
}
console.log(
  `check-install: ${Object.keys(entries).length} entry points import${requiresEsm ? " and require" : ""} on Node ${process.versions.node}`,
);
