#!/usr/bin/env bash
# The Helm chart's checks (no cluster needed): helm lint --strict, the ci/*-values.yaml render
# matrix through the real Helm engine (helm-python-sdk), kubernetes-validate --strict, golden
# renders, checkov, the README parameter table (readme-generator-for-helm), yamllint, a smoke test
# that runs the default and PostgreSQL renders as processes, and the offline OCI image. All of it
# is one pytest run under helm/nm-gateway/tests/.
#
#   helm/ci.sh                  # check
#   helm/ci.sh --update-golden  # rewrite tests/golden/ and the README table, then check
#
# Env: NM_GATEWAY_BIN (default target/debug/nm-gateway), NM_TEST_POSTGRES_URL (default
# postgres://postgres@127.0.0.1:5432/test; the smoke test creates and drops its own database).
# Tools are installed once into target/helm-venv, target/checkov-venv and target/helm-npm.
set -euo pipefail
cd "$(dirname "$0")/.."

update=0
for arg in "$@"; do
  case "$arg" in
    --update-golden) update=1 ;;
    *) echo "usage: helm/ci.sh [--update-golden]" >&2; exit 64 ;;
  esac
done

export NM_GATEWAY_BIN="${NM_GATEWAY_BIN:-target/debug/nm-gateway}"
export NM_TEST_POSTGRES_URL="${NM_TEST_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/test}"
if [ ! -x "$NM_GATEWAY_BIN" ]; then
  echo "helm/ci.sh: no nm-gateway binary at $NM_GATEWAY_BIN (build it, or set NM_GATEWAY_BIN)" >&2
  exit 1
fi
NM_GATEWAY_BIN="$(cd "$(dirname "$NM_GATEWAY_BIN")" && pwd)/$(basename "$NM_GATEWAY_BIN")"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PYTHONDONTWRITEBYTECODE=1

# A venv at $1 with the packages $2..; reinstalled only when the list changes.
venv() {
  local dir="$1"; shift
  local want="$*"
  if [ -x "$dir/bin/python" ] && [ "$(cat "$dir/.nm-requirements" 2>/dev/null)" = "$want" ]; then
    return
  fi
  echo "== installing into $dir: $want"
  rm -rf "$dir"
  python3 -m venv "$dir"
  "$dir/bin/pip" install -q "$@"
  echo "$want" > "$dir/.nm-requirements"
}

venv target/helm-venv helm-python-sdk==0.2.2 kubernetes-validate==1.37.0 yamllint==1.38.0 \
  pytest==9.2.0 PyYAML==6.0.4 jsonschema grpcio==1.85.3 grpcio-health-checking==1.85.1
# checkov pins dependencies of its own: a venv to itself.
venv target/checkov-venv checkov==3.3.30

npm_dir=target/helm-npm
generator="$npm_dir/node_modules/.bin/readme-generator"
if [ ! -x "$generator" ] || ! "$generator" --version 2>/dev/null | grep -q '2\.7\.2'; then
  echo "== installing @bitnami/readme-generator-for-helm into $npm_dir"
  mkdir -p "$npm_dir"
  [ -f "$npm_dir/package.json" ] || echo '{"private": true}' > "$npm_dir/package.json"
  npm install --prefix "$npm_dir" --no-audit --no-fund --no-progress --silent @bitnami/readme-generator-for-helm@2.7.2
fi
export NM_README_GENERATOR="$PWD/$generator"
export NM_CHECKOV="$PWD/target/checkov-venv/bin/checkov"

if [ "$update" = 1 ]; then
  echo "== regenerating the README parameter table"
  "$generator" --values helm/nm-gateway/values.yaml --readme helm/nm-gateway/README.md > /dev/null
  export UPDATE_GOLDEN=1
fi

if command -v pg_isready > /dev/null && ! pg_isready -q -d "$NM_TEST_POSTGRES_URL"; then
  echo "helm/ci.sh: PostgreSQL does not answer at $NM_TEST_POSTGRES_URL (the smoke test needs it)" >&2
fi

echo "== chart tests (binary $NM_GATEWAY_BIN)"
exec target/helm-venv/bin/python -m pytest helm/nm-gateway/tests -q
