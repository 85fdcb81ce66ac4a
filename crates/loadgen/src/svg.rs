//! Small SVG plots drawn here, so the report is one self-contained file with no scripts: line and
//! scatter charts on linear axes with rounded ticks, and grouped horizontal bars.

use std::fmt::Write;

pub const PALETTE: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

const W: f64 = 760.0;
const H: f64 = 340.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 160.0;
const TOP: f64 = 34.0;
const BOTTOM: f64 = 46.0;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    Line,
    Dots,
    LineAndDots,
}

#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub color: &'static str,
    pub style: Style,
    pub points: Vec<(f64, f64)>,
}

/// A shaded x-interval with a label (e.g. the warm-up phase).
#[derive(Debug, Clone)]
pub struct Band {
    pub from: f64,
    pub to: f64,
    pub label: String,
}

#[derive(Debug, Clone, Default)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
    pub bands: Vec<Band>,
    /// Horizontal reference lines (e.g. a threshold).
    pub hlines: Vec<(f64, String)>,
    /// Force the y axis to start at zero.
    pub y_from_zero: bool,
}

pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Tick positions covering `[lo, hi]` at a step of 1, 2 or 5 times a power of ten.
pub fn ticks(lo: f64, hi: f64, target: usize) -> Vec<f64> {
    if !(lo.is_finite() && hi.is_finite()) || hi <= lo {
        return vec![lo];
    }
    let raw = (hi - lo) / target.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let first = (lo / step).ceil() * step;
    let mut out = Vec::new();
    let mut t = first;
    while t <= hi + step * 1e-9 {
        out.push(if t.abs() < step * 1e-9 { 0.0 } else { t });
        t += step;
    }
    out
}

/// A tick label with as many decimals as the tick spacing needs (0.05 apart: two).
fn fmt_tick(v: f64, step: f64) -> String {
    let decimals = if step > 0.0 && step < 1.0 {
        (-step.log10().floor()) as usize
    } else {
        0
    };
    if v == 0.0 {
        "0".into()
    } else {
        format!("{v:.decimals$}")
    }
}

/// The spacing of a tick list (0 for fewer than two ticks).
fn spacing(ticks: &[f64]) -> f64 {
    if ticks.len() > 1 {
        ticks[1] - ticks[0]
    } else {
        0.0
    }
}

/// Pads a range so a single value or a flat line still gets an axis.
fn range(values: impl Iterator<Item = f64>, from_zero: bool) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.filter(|v| v.is_finite()) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    if from_zero {
        lo = lo.min(0.0);
    }
    if hi - lo < 1e-9 {
        let pad = if hi.abs() > 0.0 { hi.abs() * 0.1 } else { 1.0 };
        return (
            lo - pad * if from_zero && lo >= 0.0 { 0.0 } else { 1.0 },
            hi + pad,
        );
    }
    (lo, hi + (hi - lo) * 0.04)
}

pub fn line_chart(c: &Chart) -> String {
    let pw = W - LEFT - RIGHT;
    let ph = H - TOP - BOTTOM;
    let xs = c
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .chain(c.bands.iter().flat_map(|b| [b.from, b.to]));
    let (x0, x1) = range(xs, false);
    let ys = c
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .chain(c.hlines.iter().map(|h| h.0));
    let (y0, y1) = range(ys, c.y_from_zero);
    let sx = |x: f64| LEFT + (x - x0) / (x1 - x0) * pw;
    let sy = |y: f64| TOP + ph - (y - y0) / (y1 - y0) * ph;
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" width="{W}" height="{H}" font-family="sans-serif" font-size="11">"#
    );
    let _ = write!(
        s,
        r#"<text x="{}" y="18" font-size="14" font-weight="bold">{}</text>"#,
        LEFT,
        escape(&c.title)
    );
    for (i, b) in c.bands.iter().enumerate() {
        let fill = if i % 2 == 0 { "#f0f0f0" } else { "#e4ecf7" };
        let (a, z) = (sx(b.from.max(x0)), sx(b.to.min(x1)));
        if z > a {
            let _ = write!(
                s,
                r##"<rect x="{a:.1}" y="{TOP}" width="{:.1}" height="{ph}" fill="{fill}"/><text x="{:.1}" y="{}" fill="#666">{}</text>"##,
                z - a,
                a + 3.0,
                TOP + 12.0,
                escape(&b.label)
            );
        }
    }
    let yt = ticks(y0, y1, 6);
    for &t in &yt {
        let y = sy(t);
        let _ = write!(
            s,
            r##"<line x1="{LEFT}" x2="{:.1}" y1="{y:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT + pw,
            LEFT - 6.0,
            y + 4.0,
            fmt_tick(t, spacing(&yt))
        );
    }
    let xt = ticks(x0, x1, 8);
    for &t in &xt {
        let x = sx(t);
        let _ = write!(
            s,
            r##"<line x1="{x:.1}" x2="{x:.1}" y1="{:.1}" y2="{:.1}" stroke="#999"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            TOP + ph,
            TOP + ph + 5.0,
            TOP + ph + 17.0,
            fmt_tick(t, spacing(&xt))
        );
    }
    let _ = write!(
        s,
        r##"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#999"/><text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text><text transform="translate(16 {:.1}) rotate(-90)" text-anchor="middle">{}</text>"##,
        LEFT + pw / 2.0,
        H - 8.0,
        escape(&c.x_label),
        TOP + ph / 2.0,
        escape(&c.y_label)
    );
    for (y, label) in &c.hlines {
        let yy = sy(*y);
        let _ = write!(
            s,
            r##"<line x1="{LEFT}" x2="{:.1}" y1="{yy:.1}" y2="{yy:.1}" stroke="#000" stroke-dasharray="5 4"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT + pw,
            LEFT + pw - 4.0,
            yy - 4.0,
            escape(label)
        );
    }
    for (i, series) in c.series.iter().enumerate() {
        let pts: Vec<(f64, f64)> = series
            .points
            .iter()
            .filter(|p| p.0.is_finite() && p.1.is_finite())
            .map(|&(x, y)| (sx(x), sy(y)))
            .collect();
        if matches!(series.style, Style::Line | Style::LineAndDots) && pts.len() > 1 {
            let d: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
            let _ = write!(
                s,
                r#"<polyline fill="none" stroke="{}" stroke-width="1.8" points="{}"/>"#,
                series.color,
                d.join(" ")
            );
        }
        if matches!(series.style, Style::Dots | Style::LineAndDots) {
            let r = if series.style == Style::Dots {
                2.2
            } else {
                3.2
            };
            for (x, y) in &pts {
                let _ = write!(
                    s,
                    r#"<circle cx="{x:.1}" cy="{y:.1}" r="{r}" fill="{}" fill-opacity="0.7"/>"#,
                    series.color
                );
            }
        }
        let ly = TOP + 10.0 + i as f64 * 16.0;
        let lx = LEFT + pw + 12.0;
        let _ = write!(
            s,
            r#"<rect x="{lx}" y="{:.1}" width="12" height="8" fill="{}"/><text x="{:.1}" y="{ly:.1}">{}</text>"#,
            ly - 8.0,
            series.color,
            lx + 16.0,
            escape(&series.name)
        );
    }
    s.push_str("</svg>");
    s
}

/// One group of bars: a name, a colour and one value per category.
#[derive(Debug, Clone)]
pub struct BarGroup {
    pub name: String,
    pub color: &'static str,
    pub values: Vec<f64>,
}

/// Horizontal grouped bars, one row per category.
pub fn bar_chart(title: &str, unit: &str, categories: &[String], groups: &[BarGroup]) -> String {
    let row_h = 10.0 * groups.len().max(1) as f64 + 10.0;
    let left = 150.0;
    let pw = W - left - RIGHT;
    let h = TOP + BOTTOM + row_h * categories.len().max(1) as f64;
    let max = groups
        .iter()
        .flat_map(|g| g.values.iter().copied())
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max);
    let (_, x1) = range([0.0, max].into_iter(), true);
    let sx = |v: f64| left + v / x1 * pw;
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {h}" width="{W}" height="{h}" font-family="sans-serif" font-size="11"><text x="{left}" y="18" font-size="14" font-weight="bold">{}</text>"#,
        escape(title)
    );
    let bt = ticks(0.0, x1, 6);
    for &t in &bt {
        let x = sx(t);
        let _ = write!(
            s,
            r##"<line x1="{x:.1}" x2="{x:.1}" y1="{TOP}" y2="{:.1}" stroke="#ddd"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            h - BOTTOM,
            h - BOTTOM + 14.0,
            fmt_tick(t, spacing(&bt))
        );
    }
    let _ = write!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
        left + pw / 2.0,
        h - 12.0,
        escape(unit)
    );
    for (ci, cat) in categories.iter().enumerate() {
        let y = TOP + ci as f64 * row_h;
        let _ = write!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            left - 6.0,
            y + row_h / 2.0 + 3.0,
            escape(cat)
        );
        for (gi, g) in groups.iter().enumerate() {
            let v = g.values.get(ci).copied().unwrap_or(0.0);
            if !v.is_finite() {
                continue;
            }
            let _ = write!(
                s,
                r#"<rect x="{left}" y="{:.1}" width="{:.1}" height="9" fill="{}"><title>{} {}: {v:.2}</title></rect>"#,
                y + 5.0 + gi as f64 * 10.0,
                (sx(v) - left).max(0.5),
                g.color,
                escape(cat),
                escape(&g.name)
            );
        }
    }
    for (gi, g) in groups.iter().enumerate() {
        let ly = TOP + 10.0 + gi as f64 * 16.0;
        let lx = left + pw + 12.0;
        let _ = write!(
            s,
            r#"<rect x="{lx}" y="{:.1}" width="12" height="8" fill="{}"/><text x="{:.1}" y="{ly:.1}">{}</text>"#,
            ly - 8.0,
            g.color,
            lx + 16.0,
            escape(&g.name)
        );
    }
    s.push_str("</svg>");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(0.0, 10.0, 5), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        let t = ticks(13.0, 987.0, 6);
        assert!(
            t.iter().all(|v| v % 100.0 == 0.0 || v % 200.0 == 0.0),
            "{t:?}"
        );
        assert!(t[0] >= 13.0 && *t.last().unwrap() <= 987.0);
        assert_eq!(ticks(5.0, 5.0, 4), vec![5.0]);
        // Labels never repeat for close ticks.
        let t = ticks(0.09, 0.11, 8);
        let labels: Vec<String> = t.iter().map(|&v| fmt_tick(v, spacing(&t))).collect();
        let mut unique = labels.clone();
        unique.dedup();
        assert_eq!(labels, unique, "{labels:?}");
        assert_eq!(fmt_tick(2000.0, 500.0), "2000");
        assert_eq!(fmt_tick(0.25, 0.05), "0.25");
    }

    #[test]
    fn charts_are_well_formed_and_escape_text() {
        let c = Chart {
            title: "a <b> & c".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            series: vec![Series {
                name: "s".into(),
                color: PALETTE[0],
                style: Style::LineAndDots,
                points: vec![(0.0, 1.0), (1.0, 3.0), (2.0, f64::NAN)],
            }],
            bands: vec![Band {
                from: 0.0,
                to: 0.5,
                label: "warm-up".into(),
            }],
            hlines: vec![(2.0, "limit".into())],
            y_from_zero: true,
        };
        let svg = line_chart(&c);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>"));
        assert!(svg.contains("a &lt;b&gt; &amp; c"));
        assert_eq!(svg.matches("<circle").count(), 2);
        assert!(svg.contains("<polyline"));
        assert!(!svg.contains("NaN"));
        let bars = bar_chart(
            "stages",
            "ms",
            &["embed".into(), "decode".into()],
            &[BarGroup {
                name: "p50".into(),
                color: PALETTE[1],
                values: vec![1.0, 10.0],
            }],
        );
        assert_eq!(bars.matches("<title>").count(), 2);
        assert!(!bars.contains("NaN"));
    }
}
