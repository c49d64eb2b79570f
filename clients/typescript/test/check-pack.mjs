// Checks `npm pack --dry-run --json` lists exactly the files the package should ship
// (clients/ci.sh runs it). Usage: node check-pack.mjs PACK_JSON
import { readFileSync } from "node:fs";

const [pack] = JSON.parse(readFileSync(process.argv[2], "utf8"));
const files = pack.files.map((f) => f.path).sort();
const modules = [
  "anthropic",
  "editDistance",
  "errors",
  "gateway",
  "genai",
  "index",
  "openai",
  "rules",
  "session",
  "signals",
];
const want = [
  "README.md",
  "package.json",
  ...modules.flatMap((m) => [`dist/${m}.d.ts`, `dist/${m}.js`]),
].sort();
const fail = (msg) => {
  console.error(`check-pack: ${msg}`);
  process.exit(1);
};
if (pack.name !== "@nm-gateway/client") fail(`name ${pack.name}`);
if (JSON.stringify(files) !== JSON.stringify(want)) {
  fail(
    `files differ\n  extra:   ${files.filter((f) => !want.includes(f))}\n  missing: ${want.filter((f) => !files.includes(f))}`,
  );
}
const manifest = JSON.parse(readFileSync(new URL("../package.json", import.meta.url), "utf8"));
for (const [entry, target] of Object.entries(manifest.exports)) {
  if (typeof target === "string") continue;
  for (const path of [target.types, target.import, target.default]) {
    if (!files.includes(path.replace(/^\.\//, ""))) fail(`exports ${entry} -> ${path} is not in the package`);
  }
}
console.log(`check-pack: ${pack.name}@${pack.version}, ${files.length} files ok`);
