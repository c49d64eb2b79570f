//! The edit distance of `history_edit`: Levenshtein distance (insertions, deletions and
//! substitutions of one character each) between two texts, in Unicode scalar values.
//!
//! Cost: the common prefix and suffix are skipped first (an edit is usually local), then the
//! rest is compared with Myers' bit-vector algorithm in Hyyrö's blocked form (as edlib does): one
//! pass over the longer text, `ceil(m / 64)` words of work per character, `m` the shorter rest.
//! The texts compared are at most [`crate::usage::text::MAX_KEPT_CHARS`] (4,096) characters each,
//! so the worst case is 64 × 4,096 word steps (a few million instructions, about a millisecond),
//! met only by a request whose history rewrote the previous answer completely.

use std::collections::HashMap;

/// The Levenshtein distance between `a` and `b`, in characters.
pub fn levenshtein(a: &str, b: &str) -> u64 {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let prefix = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let (a, b) = (&a[prefix..], &b[prefix..]);
    let suffix = a
        .iter()
        .rev()
        .zip(b.iter().rev())
        .take_while(|(x, y)| x == y)
        .count();
    let (a, b) = (&a[..a.len() - suffix], &b[..b.len() - suffix]);
    // The pattern (bit vectors) is the shorter one.
    let (p, t) = if a.len() <= b.len() { (a, b) } else { (b, a) };
    if p.is_empty() {
        return t.len() as u64;
    }
    myers(p, t)
}

/// Hyyrö's blocked bit-vector Levenshtein: `p` down the rows, `t` along the columns.
fn myers(p: &[char], t: &[char]) -> u64 {
    let m = p.len();
    let words = m.div_ceil(64);
    // For each distinct character of `p`, its match bits, `words` words each.
    let mut index: HashMap<char, usize> = HashMap::new();
    let mut peq: Vec<u64> = Vec::new();
    for (i, c) in p.iter().enumerate() {
        let slot = *index.entry(*c).or_insert_with(|| {
            peq.resize(peq.len() + words, 0);
            peq.len() / words - 1
        });
        peq[slot * words + i / 64] |= 1 << (i % 64);
    }
    let mut pv = vec![!0u64; words];
    let mut mv = vec![0u64; words];
    let last = 1u64 << ((m - 1) % 64);
    let mut score = m as u64;
    let zeros = vec![0u64; words];
    for c in t {
        let eq = match index.get(c) {
            Some(&slot) => &peq[slot * words..(slot + 1) * words],
            None => &zeros[..],
        };
        // The top row's horizontal delta: +1 per column (the distance to an empty prefix).
        let mut hin: i8 = 1;
        for w in 0..words {
            let (mut ph, mut mh);
            let e = eq[w] | u64::from(hin < 0);
            let xv = eq[w] | mv[w];
            let xh = (((e & pv[w]).wrapping_add(pv[w])) ^ pv[w]) | e;
            ph = mv[w] | !(xh | pv[w]);
            mh = pv[w] & xh;
            let high = if w + 1 == words { last } else { 1 << 63 };
            let hout: i8 = if ph & high != 0 {
                1
            } else if mh & high != 0 {
                -1
            } else {
                0
            };
            if w + 1 == words {
                match hout {
                    1 => score += 1,
                    -1 => score -= 1,
                    _ => {}
                }
            }
            ph <<= 1;
            mh <<= 1;
            if hin < 0 {
                mh |= 1;
            } else if hin > 0 {
                ph |= 1;
            }
            pv[w] = mh | !(xv | ph);
            mv[w] = ph & xv;
            hin = hout;
        }
    }
    score
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The textbook dynamic programme.
    fn naive(a: &str, b: &str) -> u64 {
        let a: Vec<char> = a.chars().collect();
        let b: Vec<char> = b.chars().collect();
        let mut prev: Vec<u64> = (0..=b.len() as u64).collect();
        for (i, x) in a.iter().enumerate() {
            let mut row = vec![i as u64 + 1];
            for (j, y) in b.iter().enumerate() {
                let sub = prev[j] + u64::from(x != y);
                row.push(sub.min(prev[j + 1] + 1).min(row[j] + 1));
            }
            prev = row;
        }
        prev[b.len()]
    }

    #[test]
    fn known_distances() {
        assert_eq!(levenshtein("", ""), 0);
        assert_eq!(levenshtein("abc", ""), 3);
        assert_eq!(levenshtein("kitten", "sitting"), 3);
        assert_eq!(levenshtein("héllo wörld", "hello world"), 2);
        assert_eq!(levenshtein("日本語", "日本"), 1);
        assert_eq!(levenshtein("🎉a", "a🎉"), 2);
    }

    #[test]
    fn long_texts_cross_word_boundaries() {
        let a: String = (0..300)
            .map(|i| char::from(b'a' + (i % 26) as u8))
            .collect();
        let mut b = a.clone();
        b.replace_range(10..11, "Z");
        b.insert_str(150, "inserted");
        b.replace_range(250..260, "");
        assert_eq!(levenshtein(&a, &b), naive(&a, &b));
        let c: String = a.chars().rev().collect();
        assert_eq!(levenshtein(&a, &c), naive(&a, &c));
    }

    proptest! {
        #[test]
        fn matches_the_textbook(a in "[ab日é]{0,150}", b in "[ab日é]{0,150}") {
            prop_assert_eq!(levenshtein(&a, &b), naive(&a, &b));
        }

        #[test]
        fn matches_the_textbook_on_near_copies(a in "[a-e ]{60,200}", at in 0usize..60, ins in "[a-z]{0,70}") {
            let mut b = a.clone();
            b.insert_str(at, &ins);
            let b: String = b.chars().filter(|c| *c != 'c').collect();
            prop_assert_eq!(levenshtein(&a, &b), naive(&a, &b));
        }
    }
}
