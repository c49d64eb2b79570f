//! The outcome model: what each signal action says about an output.
//!
//! A signal records what an end user did with a model output. Analytics turns each one into a
//! **score** in `[-1, 1]` (how good the output turned out to be) and a binary **success** (the
//! output was worth having), which is what the success rates in [`super::stats`] count.
//!
//! | Action        | Score                   | Success      | Reading                                    |
//! |---------------|-------------------------|--------------|--------------------------------------------|
//! | `accepted`    | `+1.0`                  | yes          | used as is                                 |
//! | `sent`        | `+1.0`                  | yes          | used as is, and sent on                    |
//! | `published`   | `+1.0`                  | yes          | used as is, and made public                |
//! | `thumbs_up`   | `+0.6`                  | yes          | approved, but a rating is not proof of use |
//! | `edited`      | `0.8 · 200 / (200 + d)` | if `d < 200` | used after changing `d` characters         |
//! | `regenerated` | `-0.6`                  | no           | this output was rejected, the user stayed  |
//! | `thumbs_down` | `-0.6`                  | no           | disapproved                                |
//! | `abandoned`   | `-1.0`                  | no           | the user gave up                           |
//!
//! Why these values:
//!
//! - **Use beats opinion.** Accepting, sending or publishing an output is revealed preference,
//!   so it gets the full `+1`; a thumbs-up is cheaper to give and gets `+0.6`. The negatives
//!   mirror this: abandoning is the strongest failure (`-1`), a regeneration or a thumbs-down
//!   rejects one output while the user keeps going (`-0.6`).
//! - **Edits are partial credit that shrinks with the edit.** An edited output was used, so its
//!   score is never negative, but the more the user rewrote, the less the model contributed. The
//!   curve is hyperbolic: `0.8` for an edit of 0 characters, half of that (`0.4`) at
//!   [`EDIT_HALF_CHARS`] = 200 characters (about three sentences, 35 words, rewritten), `0.16` at
//!   800 and tending to `0` for very heavy edits. It is smooth, strictly decreasing, and never
//!   reaches the negative range of a rejection: even a heavily edited output was kept. The
//!   signal carries no output length, so the distance is absolute characters, not a fraction.
//! - **An edit of [`HEAVY_EDIT_CHARS`] (200) characters or more is a heavy edit** and not a
//!   success: past the half-point the user did more of the work than the model. So success is
//!   exactly "score above `0.4`", the score of an edit at the half-point (a unit test checks that
//!   the two definitions agree).
//!
//! An `edited` signal without `edit_distance` cannot come through `POST /v1/signal` (it is
//! required there); should one appear, it is scored as an edit at the half-point (`0.4`),
//! neither a success nor a heavy edit.
//!
//! ## Sessions and requests
//!
//! A session often has several signals: regenerations, then a final use. [`SessionOutcome::fold`]
//! folds them, in time order, into one outcome: **the last signal decides** the session's score
//! and success, and every regeneration and heavy edit along the way is counted. The last signal
//! is what the user finally did, so `regenerated, regenerated, accepted` is a success that cost
//! two regenerations, and `accepted, abandoned` is a failure. Counting regenerations separately
//! (rather than averaging them into the score) keeps "did the user get there" and "how many
//! tries it took" apart, which is what "regenerations per success" reports; the mean score is
//! kept too for those who want the blend. The same fold applies to the signals tied to one
//! request.

use nm_types::Action;
use serde::Serialize;

use super::stats::Proportion;

/// Score of `accepted`, `sent` and `published`: the output was used as is.
pub const SCORE_USED: f64 = 1.0;
/// Score of `thumbs_up`: explicit approval, weaker evidence than use.
pub const SCORE_THUMBS_UP: f64 = 0.6;
/// Score of an `edited` output changed by 0 characters; heavier edits score less (see
/// [`edited_score`]).
pub const SCORE_EDITED_MAX: f64 = 0.8;
/// Edit distance, in characters, at which an edit's score is half of [`SCORE_EDITED_MAX`].
pub const EDIT_HALF_CHARS: u64 = 200;
/// Edits of this many characters or more are heavy edits: not a success, counted in the
/// heavy-edit rate. Equal to the half-point of the edit curve.
pub const HEAVY_EDIT_CHARS: u64 = EDIT_HALF_CHARS;
/// Score of `regenerated`: this output was rejected, but the user stayed.
pub const SCORE_REGENERATED: f64 = -0.6;
/// Score of `thumbs_down`: explicit disapproval.
pub const SCORE_THUMBS_DOWN: f64 = -0.6;
/// Score of `abandoned`: the user gave up, the strongest failure.
pub const SCORE_ABANDONED: f64 = -1.0;

/// The score of one signal, in `[-1, 1]` (see the module table).
pub fn score(action: Action, edit_distance: Option<u64>) -> f64 {
    match action {
        Action::Accepted | Action::Sent | Action::Published => SCORE_USED,
        Action::ThumbsUp => SCORE_THUMBS_UP,
        Action::Edited => edited_score(edit_distance.unwrap_or(EDIT_HALF_CHARS)),
        Action::Regenerated => SCORE_REGENERATED,
        Action::ThumbsDown => SCORE_THUMBS_DOWN,
        Action::Abandoned => SCORE_ABANDONED,
    }
}

/// The score of an output edited by `chars` characters:
/// `SCORE_EDITED_MAX · EDIT_HALF_CHARS / (EDIT_HALF_CHARS + chars)`, in `(0, 0.8]`.
pub fn edited_score(chars: u64) -> f64 {
    let half = EDIT_HALF_CHARS as f64;
    SCORE_EDITED_MAX * half / (half + chars as f64)
}

/// Whether one signal counts as a success: the output was used (`accepted`, `sent`,
/// `published`, or `edited` by less than [`HEAVY_EDIT_CHARS`]) or approved (`thumbs_up`).
/// Equivalently, its [`score`] is above `0.4`.
pub fn is_success(action: Action, edit_distance: Option<u64>) -> bool {
    match action {
        Action::Accepted | Action::Sent | Action::Published | Action::ThumbsUp => true,
        Action::Edited => edit_distance.is_some_and(|d| d < HEAVY_EDIT_CHARS),
        Action::Regenerated | Action::ThumbsDown | Action::Abandoned => false,
    }
}

/// The class of one signal in SQL: 1 success, 2 abandoned, 0 other failure, from
/// [`is_success`] (the one definition of success) and the heavy-edit threshold.
pub(crate) fn class_case() -> String {
    let mut used = Vec::new();
    for a in Action::ALL {
        if a != Action::Edited && is_success(a, None) {
            used.push(format!("'{a}'"));
        }
    }
    format!(
        "CASE WHEN action IN ({}) THEN 1 \
         WHEN action = '{}' AND edit_distance < {HEAVY_EDIT_CHARS} THEN 1 \
         WHEN action = '{}' THEN 2 ELSE 0 END",
        used.join(", "),
        Action::Edited,
        Action::Abandoned,
    )
}

/// Whether an edit of `edit_distance` characters is heavy (at least [`HEAVY_EDIT_CHARS`]).
/// An unknown distance is not claimed heavy.
pub fn is_heavy_edit(edit_distance: Option<u64>) -> bool {
    edit_distance.is_some_and(|d| d >= HEAVY_EDIT_CHARS)
}

// === impl SessionOutcome ===

/// The outcome of one session (or one request): its signals folded, last signal deciding.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SessionOutcome {
    /// Signals folded.
    pub signals: u32,
    /// The last signal's action: what the user finally did.
    pub last_action: Action,
    /// The last signal's edit distance, if any.
    pub last_edit_distance: Option<u64>,
    /// The last signal's score: the session's score.
    pub score: f64,
    /// Whether the last signal is a success: the session's success.
    pub success: bool,
    /// Mean score of all the signals, for a view that blends the attempts.
    pub mean_score: f64,
    /// `regenerated` signals in the session.
    pub regenerations: u32,
    /// `edited` signals with a heavy edit distance.
    pub heavy_edits: u32,
}

impl SessionOutcome {
    /// Folds one session's signals, in time order, into its outcome; `None` when it has none.
    pub fn fold(signals: &[(Action, Option<u64>)]) -> Option<Self> {
        let &(last_action, last_edit_distance) = signals.last()?;
        let mut regenerations = 0u32;
        let mut heavy_edits = 0u32;
        let mut score_sum = 0.0;
        for &(action, edit_distance) in signals {
            score_sum += score(action, edit_distance);
            match action {
                Action::Regenerated => regenerations = regenerations.saturating_add(1),
                Action::Edited if is_heavy_edit(edit_distance) => {
                    heavy_edits = heavy_edits.saturating_add(1);
                }
                _ => {}
            }
        }
        Some(Self {
            signals: u32::try_from(signals.len()).unwrap_or(u32::MAX),
            last_action,
            last_edit_distance,
            score: score(last_action, last_edit_distance),
            success: is_success(last_action, last_edit_distance),
            mean_score: score_sum / signals.len() as f64,
            regenerations,
            heavy_edits,
        })
    }

    /// Whether the session ended abandoned.
    pub fn abandoned(&self) -> bool {
        self.last_action == Action::Abandoned
    }
}

// === impl Tally ===

/// Session outcomes summed over an arm (a model, a provider, an environment, a time window):
/// the counts behind the rates that recommendations compare.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Tally {
    pub sessions: u64,
    /// Sessions whose last signal is a success.
    pub successes: u64,
    /// Sessions whose last signal is `abandoned`.
    pub abandoned: u64,
    /// Sessions with at least one regeneration.
    pub regenerated: u64,
    /// Sessions with at least one heavy edit.
    pub heavily_edited: u64,
    /// Regenerations over all sessions.
    pub regenerations: u64,
}

impl Tally {
    /// Adds one session.
    pub fn add(&mut self, outcome: &SessionOutcome) {
        self.sessions += 1;
        self.successes += u64::from(outcome.success);
        self.abandoned += u64::from(outcome.abandoned());
        self.regenerated += u64::from(outcome.regenerations > 0);
        self.heavily_edited += u64::from(outcome.heavy_edits > 0);
        self.regenerations += u64::from(outcome.regenerations);
    }

    /// Sessions that ended in a success.
    pub fn success(&self) -> Proportion {
        Proportion::new(self.successes, self.sessions)
    }

    /// Sessions that ended abandoned.
    pub fn abandonment(&self) -> Proportion {
        Proportion::new(self.abandoned, self.sessions)
    }

    /// Sessions with at least one regeneration.
    pub fn regeneration(&self) -> Proportion {
        Proportion::new(self.regenerated, self.sessions)
    }

    /// Sessions with at least one heavy edit.
    pub fn heavy_edit(&self) -> Proportion {
        Proportion::new(self.heavily_edited, self.sessions)
    }

    /// Regenerations per successful session; `None` before the first success.
    pub fn regenerations_per_success(&self) -> Option<f64> {
        (self.successes > 0).then(|| self.regenerations as f64 / self.successes as f64)
    }
}

impl Extend<SessionOutcome> for Tally {
    fn extend<I: IntoIterator<Item = SessionOutcome>>(&mut self, outcomes: I) {
        for outcome in outcomes {
            self.add(&outcome);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn class_case_follows_the_outcome_model() {
        let case = class_case();
        assert!(case.contains("'accepted'") && case.contains("'thumbs_up'"));
        assert!(case.contains("'sent'") && case.contains("'published'"));
        assert!(!case.contains("'regenerated'") && !case.contains("'thumbs_down'"));
        assert!(case.contains("edit_distance < 200"));
    }

    const DISTANCES: [Option<u64>; 9] = [
        None,
        Some(0),
        Some(1),
        Some(119),
        Some(199),
        Some(200),
        Some(201),
        Some(10_000),
        Some(u64::MAX),
    ];

    #[test]
    fn mapping_matches_the_documented_table() {
        for action in [Action::Accepted, Action::Sent, Action::Published] {
            assert_eq!(score(action, None), 1.0);
            assert!(is_success(action, None));
        }
        assert_eq!(score(Action::ThumbsUp, None), 0.6);
        assert!(is_success(Action::ThumbsUp, None));
        assert_eq!(score(Action::Regenerated, None), -0.6);
        assert_eq!(score(Action::ThumbsDown, None), -0.6);
        assert_eq!(score(Action::Abandoned, None), -1.0);
        for action in [Action::Regenerated, Action::ThumbsDown, Action::Abandoned] {
            assert!(!is_success(action, None));
        }
    }

    #[test]
    fn edit_curve_is_smooth_partial_credit() {
        assert_eq!(edited_score(0), 0.8);
        assert!((edited_score(200) - 0.4).abs() < 1e-12);
        assert!((edited_score(800) - 0.16).abs() < 1e-12);
        let mut previous = f64::INFINITY;
        for chars in (0..5_000).step_by(7) {
            let s = edited_score(chars);
            assert!(s > 0.0 && s <= 0.8 && s < previous, "{chars}: {s}");
            previous = s;
        }
        assert!(edited_score(u64::MAX) > 0.0);
        assert!(edited_score(u64::MAX) < 1e-15);
        // A missing distance scores as the half-point.
        assert!((score(Action::Edited, None) - 0.4).abs() < 1e-12);
    }

    #[test]
    fn scores_are_bounded_and_ordered() {
        for action in Action::ALL {
            for d in DISTANCES {
                let s = score(action, d);
                assert!((-1.0..=1.0).contains(&s), "{action:?} {d:?}: {s}");
            }
        }
        // Strongest to weakest, as the issue orders them.
        let ordered = [
            score(Action::Accepted, None),
            score(Action::Edited, Some(0)),
            score(Action::ThumbsUp, None),
            score(Action::Edited, Some(1_000)),
            0.0,
            score(Action::Regenerated, None),
            score(Action::Abandoned, None),
        ];
        assert!(ordered.windows(2).all(|w| w[0] > w[1]), "{ordered:?}");
        assert_eq!(
            score(Action::ThumbsDown, None),
            score(Action::Regenerated, None)
        );
    }

    #[test]
    fn success_is_score_above_the_half_point() {
        for action in Action::ALL {
            for d in DISTANCES.into_iter().chain((0..400).map(Some)) {
                if action == Action::Edited && d == Some(HEAVY_EDIT_CHARS) {
                    // Exactly the half-point: 0.4 up to rounding, and not a success.
                    assert!(!is_success(action, d));
                    continue;
                }
                assert_eq!(
                    is_success(action, d),
                    score(action, d) > 0.4,
                    "{action:?} {d:?}"
                );
            }
        }
    }

    #[test]
    fn heavy_edit_threshold() {
        assert!(!is_heavy_edit(None));
        assert!(!is_heavy_edit(Some(0)));
        assert!(!is_heavy_edit(Some(199)));
        assert!(is_heavy_edit(Some(200)));
        assert!(is_heavy_edit(Some(u64::MAX)));
        assert!(is_success(Action::Edited, Some(199)));
        assert!(!is_success(Action::Edited, Some(200)));
        assert!(!is_success(Action::Edited, None));
    }

    #[test]
    fn empty_session_has_no_outcome() {
        assert_eq!(SessionOutcome::fold(&[]), None);
    }

    #[test]
    fn last_signal_decides_and_regenerations_are_counted() {
        let o = SessionOutcome::fold(&[
            (Action::Regenerated, None),
            (Action::Regenerated, None),
            (Action::Accepted, None),
        ])
        .unwrap();
        assert!(o.success);
        assert!(!o.abandoned());
        assert_eq!(o.signals, 3);
        assert_eq!(o.regenerations, 2);
        assert_eq!(o.last_action, Action::Accepted);
        assert_eq!(o.score, 1.0);
        assert!((o.mean_score - (-0.6 - 0.6 + 1.0) / 3.0).abs() < 1e-12);

        let o =
            SessionOutcome::fold(&[(Action::Accepted, None), (Action::Abandoned, None)]).unwrap();
        assert!(!o.success);
        assert!(o.abandoned());
        assert_eq!(o.score, -1.0);
        assert_eq!(o.regenerations, 0);
    }

    #[test]
    fn heavy_edits_are_counted_even_when_not_last() {
        let o = SessionOutcome::fold(&[
            (Action::Edited, Some(500)),
            (Action::Edited, Some(20)),
            (Action::ThumbsUp, None),
        ])
        .unwrap();
        assert!(o.success);
        assert_eq!(o.heavy_edits, 1);
        let o = SessionOutcome::fold(&[(Action::Edited, Some(450))]).unwrap();
        assert!(!o.success);
        assert_eq!(o.last_edit_distance, Some(450));
        assert_eq!(o.heavy_edits, 1);
    }

    #[test]
    fn tally_gives_rates_and_regenerations_per_success() {
        let sessions: [&[(Action, Option<u64>)]; 4] = [
            &[(Action::Regenerated, None), (Action::Sent, None)],
            &[
                (Action::Regenerated, None),
                (Action::Regenerated, None),
                (Action::Published, None),
            ],
            &[(Action::Edited, Some(300))],
            &[(Action::Regenerated, None), (Action::Abandoned, None)],
        ];
        let mut tally = Tally::default();
        assert_eq!(tally.regenerations_per_success(), None);
        tally.extend(sessions.iter().filter_map(|s| SessionOutcome::fold(s)));
        assert_eq!(tally.sessions, 4);
        assert_eq!(tally.success(), Proportion::new(2, 4));
        assert_eq!(tally.abandonment(), Proportion::new(1, 4));
        assert_eq!(tally.regeneration(), Proportion::new(3, 4));
        assert_eq!(tally.heavy_edit(), Proportion::new(1, 4));
        assert_eq!(tally.regenerations, 4);
        assert_eq!(tally.regenerations_per_success(), Some(2.0));
    }
}
