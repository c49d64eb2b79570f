"""The edit distance `edited(original=..., final=...)` sends: checked against the textbook
dynamic programme and against rapidfuzz's Levenshtein (both over code points)."""

from __future__ import annotations

from typing import List

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rapidfuzz.distance import Levenshtein

from nm_gateway import edit_distance


def reference(a: str, b: str) -> int:
    """Wagner-Fischer over code points."""
    prev: List[int] = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


@pytest.mark.parametrize(
    "a, b, d",
    [
        ("", "", 0),
        ("", "abc", 3),
        ("abc", "", 3),
        ("kitten", "sitting", 3),
        ("flaw", "lawn", 2),
        ("Saturday", "Sunday", 3),
        ("ab", "ba", 2),  # no transpositions
        ("🌍🌍", "🌍", 1),  # one code point, not two UTF-16 units
        ("é", "e\u0301", 2),  # precomposed vs combining: code points, not glyphs
        ("Hallo, Welt!", "Hallo Welt", 2),
    ],
)
def test_known_distances(a: str, b: str, d: int) -> None:
    assert edit_distance(a, b) == d
    assert edit_distance(b, a) == d


# A small alphabet makes matches (the interesting case) likely; astral characters included.
texts = st.text(alphabet="abcde é🌍\n", max_size=90)


@given(texts, texts)
@settings(max_examples=400)
def test_matches_the_reference(a: str, b: str) -> None:
    assert edit_distance(a, b) == reference(a, b)


@given(st.text(max_size=300), st.text(max_size=300))
@settings(max_examples=300)
def test_matches_rapidfuzz(a: str, b: str) -> None:
    assert edit_distance(a, b) == Levenshtein.distance(a, b)


@given(texts, texts, texts)
@settings(max_examples=200)
def test_is_a_metric(a: str, b: str, c: str) -> None:
    assert edit_distance(a, a) == 0
    assert edit_distance(a, b) == edit_distance(b, a)
    assert edit_distance(a, c) <= edit_distance(a, b) + edit_distance(b, c)
    assert abs(len(a) - len(b)) <= edit_distance(a, b) <= max(len(a), len(b))


def test_long_drafts() -> None:
    import random

    rng = random.Random(7)
    a = "".join(rng.choice("abcdefgh ") for _ in range(5000))
    b = list(a)
    for _ in range(300):
        b[rng.randrange(len(b))] = rng.choice("xyz")
    final = "".join(b)
    assert edit_distance(a, final) == Levenshtein.distance(a, final)


def test_refuses_non_strings() -> None:
    with pytest.raises(TypeError):
        edit_distance(b"abc", "abc")  # type: ignore[arg-type]
