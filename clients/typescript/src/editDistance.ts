/**
 * Character edit distance: Levenshtein over Unicode code points (not UTF-16 units), as
 * `edited({ original, final })` sends it. Insertions, deletions and substitutions of one code
 * point cost 1 each; no transpositions.
 *
 * Myers' bit-parallel algorithm (Hyyrö's formulation for the global distance) with BigInt bit
 * vectors: one pass over the longer text, a handful of operations over `shorter.length` bits
 * per step, after stripping the common prefix and suffix. The tests check it against the
 * textbook table with fast-check and against fixed cases shared with the Python library.
 */

export function editDistance(original: string, final: string): number {
  if (typeof original !== "string" || typeof final !== "string") {
    throw new TypeError("editDistance compares two strings");
  }
  let a = Array.from(original);
  let b = Array.from(final);
  let start = 0;
  const limit = Math.min(a.length, b.length);
  while (start < limit && a[start] === b[start]) start++;
  let endA = a.length;
  let endB = b.length;
  while (endA > start && endB > start && a[endA - 1] === b[endB - 1]) {
    endA--;
    endB--;
  }
  a = a.slice(start, endA);
  b = b.slice(start, endB);
  if (a.length < b.length) [a, b] = [b, a];
  const m = b.length;
  if (m === 0) return a.length;

  const peq = new Map<string, bigint>();
  for (let i = 0; i < m; i++) {
    const ch = b[i] as string;
    peq.set(ch, (peq.get(ch) ?? 0n) | (1n << BigInt(i)));
  }
  const mask = (1n << BigInt(m)) - 1n;
  const top = 1n << BigInt(m - 1);
  let pv = mask;
  let mv = 0n;
  let score = m;
  for (const ch of a) {
    const eq = peq.get(ch) ?? 0n;
    const xv = eq | mv;
    const xh = ((((eq & pv) + pv) & mask) ^ pv) | eq;
    let ph = mv | (~(xh | pv) & mask);
    let mh = pv & xh;
    if (ph & top) score++;
    else if (mh & top) score--;
    ph = ((ph << 1n) | 1n) & mask;
    mh = (mh << 1n) & mask;
    pv = mh | (~(xv | ph) & mask);
    mv = ph & xv;
  }
  return score;
}
