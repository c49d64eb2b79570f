#!/usr/bin/env bash
# The first build as a new user runs it (README's first command), measured reproducibly: a
# `git archive` copy of a commit in a fresh temporary folder, a fresh target directory, the
# crates already downloaded (fetched before the clock starts), then
#
#   cargo build --release --bin nm-gateway --timings
#
# timed whole. Prints the wall, user and system seconds, the machine (CPU model, cores, load
# before the build), and the 10 longest units of cargo's timings report with when each started.
# Nothing else should run: on a shared machine the wall time says more about the neighbours than
# about the build (the units' CPU-bound durations less so).
#
#   bench/build-time.sh            # HEAD
#   bench/build-time.sh 36433fd    # another commit, for a before and after in one sitting
#
# KEEP=1 keeps the temporary folder (its target/cargo-timings/cargo-timing.html, the report).
# Needs git, tar, python3 and GNU time (/usr/bin/time).
set -euo pipefail

rev="${1:-HEAD}"
root="$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
commit="$(git -C "$root" rev-parse --short "$rev")"
dir="$(mktemp -d "${TMPDIR:-/tmp}/nm-build-time.XXXXXX")"
cleanup() { if [ "${KEEP:-0}" != 1 ]; then rm -rf "$dir"; fi; }
trap cleanup EXIT

git -C "$root" archive "$commit" | tar -x -C "$dir"
cd "$dir"
export CARGO_TARGET_DIR="$dir/target"
unset RUSTC_WRAPPER RUSTFLAGS CARGO_BUILD_RUSTFLAGS CARGO_INCREMENTAL
# Downloads are not part of the measure.
cargo fetch --locked --quiet

load="$(cut -d' ' -f1-3 /proc/loadavg)"
/usr/bin/time -f '%e %U %S' -o "$dir/time.txt" \
    cargo build --release --bin nm-gateway --timings --locked --quiet
read -r wall user sys < "$dir/time.txt"

cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
echo "commit $commit, $(rustc --version)"
echo "machine: $cpu, $(nproc) cores; load average before the build: $load"
python3 - "$wall" "$user" "$sys" "$dir/target/cargo-timings/cargo-timing.html" <<'EOF'
import json, re, sys

wall, user, sys_s, report = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
print(f"wall {int(wall // 60)} min {wall % 60:.0f} s ({wall:.0f} s), user {user:.0f} s, system {sys_s:.0f} s")
html = open(report).read()
units = json.loads(re.search(r"const UNIT_DATA = (\[.*?\]);\n", html, re.S).group(1))
print(f"{len(units)} units, their durations summed: {sum(u['duration'] for u in units):.0f} s")
print("the 10 longest units (seconds):")
print(f"  {'unit':<42} {'start':>7} {'duration':>9}")
for u in sorted(units, key=lambda u: -u["duration"])[:10]:
    name = u["name"] + (f" ({u['target'].strip()})" if u["target"].strip() else "")
    print(f"  {name:<42} {u['start']:>7.1f} {u['duration']:>9.1f}")
EOF
if [ "${KEEP:-0}" = 1 ]; then echo "kept: $dir"; fi
