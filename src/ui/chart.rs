//! Charts as server-rendered SVG: a line chart with confidence bands ([`lines`]) and a
//! horizontal bar chart ([`bars`]). Each has axes with units, a `<title>` and `<desc>` (named by
//! `aria-labelledby`), and a table of the same figures beside it (the text alternative, for
//! screen readers and for reading exact values). Colours are SVG presentation attributes: the
//! page's Content-Security-Policy admits no inline style.

use std::fmt::Write as _;

use super::html::escape;

/// Series colours, distinguishable for the common colour-vision deficiencies (Okabe–Ito).
const PALETTE: [&str; 8] = [
    "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442",
];

/// The colour of series `i`.
pub fn colour(i: usize) -> &'static str {
    PALETTE[i % PALETTE.len()]
}

/// One point of a series: a value and its band (lower, upper), or nothing for that x.
pub type Point = Option<(f64, Option<(f64, f64)>)>;

/// A named series over the chart's x labels.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub points: Vec<Point>,
}

const W: f64 = 720.0;
const H: f64 = 260.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 44.0;
const TOP: f64 = 16.0;
const BOTTOM: f64 = 48.0;

/// A line chart of `series` over `x` (in order), the y axis from 0 to `y_max` labelled with
/// `fmt`, bands drawn translucent under their lines; then the figures as a table.
#[expect(
    clippy::too_many_arguments,
    reason = "a chart's labels, axis and data, each named at the call"
)]
pub fn lines(
    id: &str,
    title: &str,
    desc: &str,
    x: &[String],
    y_unit: &str,
    y_max: f64,
    fmt: fn(f64) -> String,
    series: &[Series],
) -> String {
    let mut s = String::with_capacity(4096);
    let y_max = if y_max > 0.0 { y_max } else { 1.0 };
    let plot_w = W - LEFT - RIGHT;
    let plot_h = H - TOP - BOTTOM;
    let xs = |i: usize| {
        if x.len() <= 1 {
            LEFT + plot_w / 2.0
        } else {
            LEFT + plot_w * i as f64 / (x.len() - 1) as f64
        }
    };
    let ys = |v: f64| TOP + plot_h * (1.0 - (v / y_max).clamp(0.0, 1.0));
    open(&mut s, id, title, desc);
    axes(&mut s, y_unit, y_max, fmt, ys);
    // x labels: at most 8, evenly spread.
    let step = x.len().div_ceil(8).max(1);
    for (i, label) in x.iter().enumerate().step_by(step) {
        let _ = write!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"middle\" fill=\"#333\">{}</text>",
            xs(i),
            H - BOTTOM + 16.0,
            escape(label)
        );
    }
    for (k, series) in series.iter().enumerate() {
        let c = colour(k);
        // The band: upper edge forwards, lower edge backwards, per run of known points.
        for run in runs(&series.points) {
            let banded: Vec<(usize, (f64, f64))> = run
                .iter()
                .filter_map(|&i| series.points[i].and_then(|(_, b)| b).map(|b| (i, b)))
                .collect();
            if banded.len() >= 2 {
                let mut d = String::new();
                for (n, (i, (_, hi))) in banded.iter().enumerate() {
                    let _ = write!(
                        d,
                        "{}{:.1},{:.1} ",
                        if n == 0 { "M" } else { "L" },
                        xs(*i),
                        ys(*hi)
                    );
                }
                for (i, (lo, _)) in banded.iter().rev() {
                    let _ = write!(d, "L{:.1},{:.1} ", xs(*i), ys(*lo));
                }
                let _ = write!(
                    s,
                    "<path d=\"{}Z\" fill=\"{c}\" fill-opacity=\"0.15\" stroke=\"none\"/>",
                    d
                );
            } else if let Some((i, (lo, hi))) = banded.first() {
                let _ = write!(
                    s,
                    "<line x1=\"{x:.1}\" x2=\"{x:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"{c}\" stroke-opacity=\"0.4\" stroke-width=\"6\"/>",
                    ys(*lo),
                    ys(*hi),
                    x = xs(*i)
                );
            }
            let mut d = String::new();
            for (n, &i) in run.iter().enumerate() {
                if let Some((v, _)) = series.points[i] {
                    let _ = write!(
                        d,
                        "{}{:.1},{:.1} ",
                        if n == 0 { "M" } else { "L" },
                        xs(i),
                        ys(v)
                    );
                }
            }
            let _ = write!(
                s,
                "<path d=\"{d}\" fill=\"none\" stroke=\"{c}\" stroke-width=\"2\"/>"
            );
            for &i in &run {
                if let Some((v, _)) = series.points[i] {
                    let _ = write!(
                        s,
                        "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{c}\"/>",
                        xs(i),
                        ys(v)
                    );
                }
            }
        }
    }
    legend(&mut s, series.iter().map(|s| s.name.as_str()));
    s.push_str("</svg>");
    // The text alternative: every figure, in a table.
    let _ = write!(
        s,
        "<details><summary>{} as a table</summary><table><thead><tr><th scope=\"col\">Series</th>\
         <th scope=\"col\">Period</th><th scope=\"col\">{}</th><th scope=\"col\">Band</th></tr></thead><tbody>",
        escape(title),
        escape(y_unit)
    );
    for series in series {
        for (i, p) in series.points.iter().enumerate() {
            if let Some((v, band)) = p {
                let band = band.map_or_else(
                    || "–".to_owned(),
                    |(lo, hi)| format!("{} – {}", fmt(lo), fmt(hi)),
                );
                let _ = write!(
                    s,
                    "<tr><td>{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td></tr>",
                    escape(&series.name),
                    escape(x.get(i).map_or("", String::as_str)),
                    fmt(*v),
                    band
                );
            }
        }
    }
    s.push_str("</tbody></table></details></figure>");
    s
}

/// Horizontal bars, one per `(label, value)`, scaled to the largest; values shown with `fmt`.
pub fn bars(
    id: &str,
    title: &str,
    desc: &str,
    unit: &str,
    fmt: fn(f64) -> String,
    rows: &[(String, f64)],
) -> String {
    let mut s = String::with_capacity(2048);
    let row_h = 24.0;
    let label_w = 200.0;
    let h = TOP + row_h * rows.len().max(1) as f64 + 32.0;
    let max = rows.iter().map(|r| r.1).fold(0.0_f64, f64::max);
    let max = if max > 0.0 { max } else { 1.0 };
    let plot_w = W - label_w - 120.0;
    let _ = write!(
        s,
        "<figure class=\"chart\"><figcaption>{0}</figcaption><svg id=\"{id}\" role=\"img\" aria-labelledby=\"{id}-t {id}-d\" \
         viewBox=\"0 0 {W} {h}\" width=\"100%\" preserveAspectRatio=\"xMinYMin meet\">\
         <title id=\"{id}-t\">{0}</title><desc id=\"{id}-d\">{1}</desc>",
        escape(title),
        escape(desc)
    );
    for (i, (label, v)) in rows.iter().enumerate() {
        let y = TOP + row_h * i as f64;
        let w = plot_w * (v / max).clamp(0.0, 1.0);
        let shown: String = label.chars().take(30).collect();
        let _ = write!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\" text-anchor=\"end\" fill=\"#222\">{}</text>\
             <rect x=\"{label_w}\" y=\"{:.1}\" width=\"{w:.1}\" height=\"{:.1}\" fill=\"{}\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\" fill=\"#222\">{}</text>",
            label_w - 8.0,
            y + 16.0,
            escape(&shown),
            y + 4.0,
            row_h - 8.0,
            colour(0),
            label_w + w + 6.0,
            y + 16.0,
            escape(&fmt(*v))
        );
    }
    // The value axis: its unit under the bars.
    let _ = write!(
        s,
        "<line x1=\"{label_w}\" x2=\"{label_w}\" y1=\"{TOP}\" y2=\"{:.1}\" stroke=\"#555\"/>\
         <text x=\"{label_w}\" y=\"{:.1}\" font-size=\"11\" fill=\"#333\">0 → {} ({})</text></svg>",
        h - 28.0,
        h - 10.0,
        escape(&fmt(max)),
        escape(unit)
    );
    let _ = write!(
        s,
        "<details><summary>{} as a table</summary><table><tbody>",
        escape(title)
    );
    for (label, v) in rows {
        let _ = write!(
            s,
            "<tr><th scope=\"row\">{}</th><td class=\"num\">{}</td></tr>",
            escape(label),
            escape(&fmt(*v))
        );
    }
    s.push_str("</tbody></table></details></figure>");
    s
}

fn open(s: &mut String, id: &str, title: &str, desc: &str) {
    let _ = write!(
        s,
        "<figure class=\"chart\"><figcaption>{1}</figcaption><svg id=\"{id}\" role=\"img\" aria-labelledby=\"{id}-t {id}-d\" \
         viewBox=\"0 0 {W} {0}\" width=\"100%\" preserveAspectRatio=\"xMinYMin meet\">\
         <title id=\"{id}-t\">{1}</title><desc id=\"{id}-d\">{2}</desc>",
        H + 24.0,
        escape(title),
        escape(desc)
    );
}

fn axes(s: &mut String, unit: &str, y_max: f64, fmt: fn(f64) -> String, ys: impl Fn(f64) -> f64) {
    for k in 0..=4 {
        let v = y_max * f64::from(k) / 4.0;
        let y = ys(v);
        let _ = write!(
            s,
            "<line x1=\"{LEFT}\" x2=\"{:.1}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"end\" fill=\"#333\">{}</text>",
            W - RIGHT,
            LEFT - 6.0,
            y + 4.0,
            escape(&fmt(v))
        );
    }
    let _ = write!(
        s,
        "<line x1=\"{LEFT}\" x2=\"{LEFT}\" y1=\"{TOP}\" y2=\"{:.1}\" stroke=\"#555\"/>\
         <line x1=\"{LEFT}\" x2=\"{:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#555\"/>\
         <text x=\"12\" y=\"{:.1}\" font-size=\"11\" fill=\"#333\" transform=\"rotate(-90 12 {:.1})\" text-anchor=\"middle\">{}</text>",
        H - BOTTOM,
        W - RIGHT,
        H - BOTTOM,
        H - BOTTOM,
        TOP + (H - TOP - BOTTOM) / 2.0,
        TOP + (H - TOP - BOTTOM) / 2.0,
        escape(unit)
    );
}

fn legend<'a>(s: &mut String, names: impl Iterator<Item = &'a str>) {
    let mut x = LEFT;
    for (i, name) in names.enumerate() {
        let shown: String = name.chars().take(24).collect();
        let _ = write!(
            s,
            "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"12\" height=\"12\" fill=\"{}\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\" fill=\"#222\">{}</text>",
            H + 6.0,
            colour(i),
            x + 16.0,
            H + 16.0,
            escape(&shown)
        );
        x += 30.0 + 7.0 * shown.chars().count() as f64;
    }
}

/// Runs of consecutive indices with a point.
fn runs(points: &[Point]) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut current = Vec::new();
    for (i, p) in points.iter().enumerate() {
        if p.is_some() {
            current.push(i);
        } else if !current.is_empty() {
            out.push(std::mem::take(&mut current));
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_chart_has_its_title_band_and_table_and_escapes_names() {
        let svg = lines(
            "c1",
            "Success rate",
            "weekly",
            &["w1".into(), "w2".into(), "w3".into()],
            "success rate",
            1.0,
            super::super::html::pct,
            &[Series {
                name: "<b>gpt</b>".into(),
                points: vec![
                    Some((0.5, Some((0.4, 0.6)))),
                    None,
                    Some((0.7, Some((0.6, 0.8)))),
                ],
            }],
        );
        assert!(svg.contains("<title id=\"c1-t\">Success rate</title>"));
        assert!(svg.contains("&lt;b&gt;gpt&lt;/b&gt;"));
        assert!(!svg.contains("<b>"));
        assert!(svg.contains("50.0%") && svg.contains("40.0% – 60.0%"));
        assert_eq!(runs(&[Some((1.0, None)), None, Some((1.0, None))]).len(), 2);
    }

    #[test]
    fn bars_scale_to_the_largest_and_survive_no_rows() {
        let svg = bars("b", "Cost", "d", "USD", |v| format!("{v}"), &[]);
        assert!(svg.contains("</svg>"));
        let svg = bars(
            "b",
            "Cost",
            "d",
            "USD",
            |v| format!("{v}"),
            &[("a".into(), 2.0), ("b".into(), 1.0)],
        );
        assert!(svg.contains("width=\"400.0\"") && svg.contains("width=\"200.0\""));
    }
}
