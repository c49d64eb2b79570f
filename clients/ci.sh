#!/usr/bin/env bash
# The client libraries (issue 24): tests of clients/python and clients/typescript against the
# real gateway binary, then their packages. Run from anywhere; works on a fresh machine with
# CI=true and no stdin. Needs NM_GATEWAY_BIN (e.g. target/debug/nm-gateway), python3 >= 3.9
# with venv, node >= 18 with npm, and the PyPI and npm registries.
#
# Caches under target/ (reused while their inputs are unchanged):
#   target/clients-venv     the venv: clients/python/requirements-dev.txt + the package, editable
#   target/clients-node     npm ci of clients/typescript/package-lock.json; the package's
#                           node_modules is a symlink to it
#   target/clients-cache    pycache, mypy cache
#   target/clients-dist     the built wheel and sdist, and the npm tarball
# Made afresh each run, as a new user would (see "Packages" below):
#   target/clients-fresh-venv  a venv with only the built wheel and its openai extra
#   target/clients-fresh-npm   an `npm init` project with only the packed tarball and the SDKs
#   target/clients-pack        the TypeScript package as a clean checkout has it, packed there
# Generated inside clients/ (ignored by clients/.gitignore): typescript/{node_modules,dist,build}.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

if [ -z "${NM_GATEWAY_BIN:-}" ]; then
  echo "clients/ci.sh: set NM_GATEWAY_BIN to the nm-gateway binary (cargo build --bin nm-gateway; NM_GATEWAY_BIN=target/debug/nm-gateway)" >&2
  exit 2
fi
if [ ! -x "$NM_GATEWAY_BIN" ]; then
  echo "clients/ci.sh: NM_GATEWAY_BIN=$NM_GATEWAY_BIN is not an executable file" >&2
  exit 2
fi
NM_GATEWAY_BIN=$(realpath "$NM_GATEWAY_BIN")
export NM_GATEWAY_BIN
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 npm_config_fund=false npm_config_audit=false npm_config_update_notifier=false

py=clients/python
ts=clients/typescript
venv=target/clients-venv
cache=target/clients-cache
mkdir -p target "$cache"
export PYTHONPYCACHEPREFIX="$root/$cache/pycache" NM_CLIENTS_HYPOTHESIS_DIR="$root/$cache/hypothesis"
start=$(date +%s)
step() { echo "== [$(( $(date +%s) - start ))s] $*"; }

# === Python ===
step "python: venv $venv"
if [ ! -x "$venv/bin/python" ] || ! cmp -s "$py/requirements-dev.txt" "$venv/.requirements-dev.txt"; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  # --no-compile: byte-compiling every SDK up front takes minutes; imports compile what they use.
  "$venv/bin/python" -m pip install -q --no-compile -r "$py/requirements-dev.txt"
  cp "$py/requirements-dev.txt" "$venv/.requirements-dev.txt"
fi
# Editable, with every SDK extra (already satisfied by the pinned versions above).
"$venv/bin/python" -m pip install -q --no-compile --no-build-isolation -e "$py[all]"

step "python: ruff, mypy --strict, vermin (Python >= 3.9)"
(cd "$py" && "$root/$venv/bin/ruff" format --check --quiet --no-cache . && "$root/$venv/bin/ruff" check --quiet --no-cache .)
(cd "$py" && "$root/$venv/bin/python" -m mypy --cache-dir "$root/$cache/mypy")
"$venv/bin/vermin" -q --no-tips --violations -t=3.9- "$py/src"

step "python: pytest"
(cd "$py" && "$root/$venv/bin/python" -m pytest -p no:cacheprovider)

# === TypeScript ===
step "typescript: node_modules (target/clients-node)"
node_cache=target/clients-node
if [ ! -d "$node_cache/node_modules" ] || ! cmp -s "$ts/package-lock.json" "$node_cache/package-lock.json"; then
  rm -rf "$node_cache"
  mkdir -p "$node_cache"
  cp "$ts/package.json" "$ts/package-lock.json" "$node_cache/"
  (cd "$node_cache" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error)
fi
if [ -e "$ts/node_modules" ] && [ ! -L "$ts/node_modules" ]; then rm -rf "$ts/node_modules"; fi
ln -sfn ../../"$node_cache"/node_modules "$ts/node_modules"

step "typescript: prettier --check, tsc (library, then tests against the built package)"
(cd "$ts" && ./node_modules/.bin/prettier --check --log-level warn .)
rm -rf "$ts/dist" "$ts/build"
(cd "$ts" && ./node_modules/.bin/tsc -p tsconfig.json && ./node_modules/.bin/tsc -p tsconfig.test.json)

step "typescript: node --test"
(cd "$ts" && node --test build/test/*.test.js)

# === Packages, as a new user gets them ===
step "python: wheel and sdist (python -m build)"
dist=target/clients-dist
rm -rf "$dist"
"$venv/bin/python" -m build --no-isolation --outdir "$dist" "$py" >/dev/null
"$venv/bin/python" "$py/tests/check_dist.py" "$dist"

step "python: the wheel in a fresh venv runs the READMEs' Python"
fresh_venv=target/clients-fresh-venv
rm -rf "$fresh_venv"
python3 -m venv "$fresh_venv"
wheel=$(ls "$dist"/nm_gateway-*.whl)
# The SDK at the version tested here (-c), nothing else from the dev venv.
"$fresh_venv/bin/python" -m pip install -q --no-compile -c "$py/requirements-dev.txt" "$root/$wheel[openai]"
(cd "$py" && CLIENTS_QUICKSTART_PYTHON="$root/$fresh_venv/bin/python" \
  "$root/$venv/bin/python" -m pytest -p no:cacheprovider -q tests/test_readme.py)

step "typescript: npm pack from a clean copy (prepack builds dist/)"
pack=target/clients-pack
rm -rf "$pack"
mkdir -p "$pack/src-copy"
# What a clean checkout has: tracked and new files, none of the ignored ones (dist/, build/).
(cd "$ts" && git ls-files --cached --others --exclude-standard -z . | xargs -0 cp --parents -t "$root/$pack/src-copy")
ln -s "$root/$node_cache/node_modules" "$pack/src-copy/node_modules"  # devDependencies (tsc)
(cd "$pack/src-copy" && npm pack --json --pack-destination "$root/$dist" 2>"$root/$cache/npm-pack.log") \
  >"$cache/npm-pack.json" || { cat "$cache/npm-pack.log" >&2; exit 1; }
node "$ts/test/check-pack.mjs" "$cache/npm-pack.json"

step "typescript: the tarball in a fresh npm project runs the README's TypeScript"
fresh_npm=target/clients-fresh-npm
rm -rf "$fresh_npm"
mkdir -p "$fresh_npm"
tarball=$(ls "$dist"/nm-gateway-client-*.tgz)
# The SDKs at the versions tested here (package-lock.json), nothing else from node_modules.
sdks=$(node -e '
  const lock = require(process.argv[1]);
  console.log(["openai", "@anthropic-ai/sdk", "@google/genai"]
    .map((n) => `${n}@${lock.packages["node_modules/" + n].version}`).join(" "));' "$root/$ts/package-lock.json")
# shellcheck disable=SC2086 # $sdks: one word per package
(cd "$fresh_npm" && npm init -y >/dev/null &&
  npm install --no-audit --no-fund --loglevel=error "$root/$tarball" $sdks)
cp "$ts/test/check-install.mjs" "$fresh_npm/"
node "$fresh_npm/check-install.mjs"
(cd "$ts" && NM_QUICKSTART_PROJECT="$root/$fresh_npm" node --test build/test/readme.test.js)

step "clients: all passed"
