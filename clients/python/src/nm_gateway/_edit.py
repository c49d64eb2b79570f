"""Character edit distance: Levenshtein over Unicode code points.

`edited(original=..., final=...)` sends this as `edit_distance`. Insertions, deletions and
substitutions of one code point cost 1 each (no transpositions), so "é" precomposed against
"e" + combining accent is 2: the library counts what the user typed, not what a font shows.

Myers' bit-parallel algorithm (Hyyrö's formulation for the global distance) with Python's
arbitrary-precision integers as the bit vectors: one pass over the longer text, each step a
handful of integer operations over `len(shorter)` bits, so two 10,000-character drafts take
milliseconds rather than the 10^8 steps of the textbook table. Common prefix and suffix are
stripped first. The tests check it against the table and against rapidfuzz.
"""

from __future__ import annotations

from typing import Dict

__all__ = ["edit_distance"]


def edit_distance(original: str, final: str) -> int:
    """Levenshtein distance between two strings, counted in code points."""
    if not isinstance(original, str) or not isinstance(final, str):
        raise TypeError("edit_distance compares two str values")
    a, b = original, final
    # Common prefix and suffix never change the distance.
    start = 0
    limit = min(len(a), len(b))
    while start < limit and a[start] == b[start]:
        start += 1
    end_a, end_b = len(a), len(b)
    while end_a > start and end_b > start and a[end_a - 1] == b[end_b - 1]:
        end_a -= 1
        end_b -= 1
    a, b = a[start:end_a], b[start:end_b]
    if len(a) < len(b):
        a, b = b, a
    m = len(b)
    if m == 0:
        return len(a)

    # peq[c]: bit i set where b[i] == c.
    peq: Dict[str, int] = {}
    for i, ch in enumerate(b):
        peq[ch] = peq.get(ch, 0) | (1 << i)
    mask = (1 << m) - 1
    top = 1 << (m - 1)
    pv, mv, score = mask, 0, m
    for ch in a:
        eq = peq.get(ch, 0)
        xv = eq | mv
        xh = ((((eq & pv) + pv) & mask) ^ pv) | eq
        ph = mv | (~(xh | pv) & mask)
        mh = pv & xh
        if ph & top:
            score += 1
        elif mh & top:
            score -= 1
        ph = ((ph << 1) | 1) & mask
        mh = (mh << 1) & mask
        pv = mh | (~(xv | ph) & mask)
        mv = ph & xv
    return score
