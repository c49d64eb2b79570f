#!/usr/bin/env python3
"""A callgrind profile by function, inlined code folded into its function, per request.

callgrind_annotate names each cost by file and function, so a function whose callees were
inlined from other files is split in many rows (and its exclusive listing of these profiles
puts everything under `clone`). This reads the profile itself and adds the rows up by function.

  bench/cg-functions.py PROFILE[,PROFILE...] REQUESTS top [N] [self|incl]
  bench/cg-functions.py PROFILE[,PROFILE...] REQUESTS callees REGEX
  bench/cg-functions.py PROFILE[,PROFILE...] REQUESTS callers REGEX

PROFILE: a file kept by `KEEP=FILE bench/callgrind.sh` (with THREADS=1, give the threads wanted,
comma-separated: FILE.1-07,FILE.1-08); REQUESTS: the requests the run served, which the figures
are divided by. `top`: the costliest functions, self cost (default) or inclusive; `callees`: what
the costliest function matching REGEX calls, with calls per request; `callers`: who calls it.
Inclusive cost is the function's own plus its calls to other functions (a recursive call of a
function to itself is not added twice).
"""
import collections
import re
import signal
import sys

signal.signal(signal.SIGPIPE, signal.SIG_DFL)


def main():
    paths, reqs = sys.argv[1].split(","), float(sys.argv[2])
    mode = sys.argv[3] if len(sys.argv) > 3 else "top"
    arg = sys.argv[4] if len(sys.argv) > 4 else "40"
    own = collections.Counter()
    calls = collections.defaultdict(collections.Counter)  # caller -> callee -> inclusive
    count = collections.defaultdict(collections.Counter)  # caller -> callee -> calls
    for path in paths:
        names = {}

        def name(text):
            m = re.match(r"\((\d+)\)(?: (.*))?", text)
            if not m:
                return text
            if m.group(2) is not None:
                names[m.group(1)] = m.group(2)
            return names.get(m.group(1), m.group(1))

        fn = callee = pending = None
        for line in open(path, errors="replace"):
            line = line.rstrip("\n")
            if line.startswith("fn="):
                fn = name(line[3:])
            elif line.startswith("cfn="):
                callee = name(line[4:])
            elif line.startswith("calls="):
                pending = int(line[6:].split()[0])
            elif line and (line[0].isdigit() or line[0] in "+-*"):
                parts = line.split()
                if len(parts) < 2:
                    continue
                cost = int(parts[1])
                if pending is not None:
                    if callee != fn:
                        calls[fn][callee] += cost
                        count[fn][callee] += pending
                    pending = None
                else:
                    own[fn] += cost
    incl = {f: own[f] + sum(calls[f].values()) for f in set(own) | set(calls)}
    if mode == "top":
        table = own if (sys.argv[5] if len(sys.argv) > 5 else "self") == "self" else incl
        for f, c in sorted(table.items(), key=lambda x: -x[1])[: int(arg)]:
            print(f"{c / reqs:9.0f}  {f[:150]}")
        return
    match = [f for f in sorted(incl, key=lambda f: -incl[f]) if re.search(arg, f)]
    if not match:
        sys.exit(f"no function matches {arg}")
    f = match[0]
    print(f"{incl[f] / reqs:.0f} inclusive, {own[f] / reqs:.0f} self: {f[:150]}")
    if mode == "callees":
        rows = [(c, g, count[f][g]) for g, c in calls[f].items()]
    else:
        rows = [(calls[g][f], g, count[g][f]) for g in calls if f in calls[g]]
    for c, g, n in sorted(rows, reverse=True)[:25]:
        if c / reqs >= 20:
            print(f"  {c / reqs:8.0f} ({n / reqs:5.1f}x) {g[:150]}")


main()
