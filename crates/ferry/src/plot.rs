//! Small SVG plots for `ferry bench serve`, one line per configuration (each a `bench serve` JSON
//! result): TTFT p99 and TPOT p99 against the offered rate, or, for a multi-turn run, TTFT by
//! turn.

use serde_json::Value;
use std::fmt::Write;

const COLORS: [&str; 6] = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"];

/// (rate, p99 of `metric`) of each run of a `bench serve` result.
fn by_rate(result: &Value, metric: &str) -> Vec<(f64, f64)> {
    result["runs"]
        .as_array()
        .map(|runs| runs.iter().filter_map(|r| Some((r["rate"].as_f64()?, r[metric]["p99"].as_f64()?))).filter(|(_, y)| y.is_finite()).collect())
        .unwrap_or_default()
}

/// (turn, TTFT `q`) of the first run of a multi-turn `bench serve` result.
fn by_turn(result: &Value, q: &str) -> Vec<(f64, f64)> {
    result["runs"][0]["turns"]
        .as_array()
        .map(|turns| turns.iter().filter_map(|t| Some((t["turn"].as_f64()?, t["ttft_ms"][q].as_f64()?))).filter(|(_, y)| y.is_finite()).collect())
        .unwrap_or_default()
}

struct Panel<'a> {
    title: &'a str,
    x_label: &'a str,
    points: &'a dyn Fn(&Value) -> Vec<(f64, f64)>,
    slo: Option<f64>,
}

fn panel(svg: &mut String, results: &[Value], p: &Panel, x0: f64) {
    let (title, slo, points) = (p.title, p.slo, p.points);
    let (w, h, pad) = (420.0, 300.0, 50.0);
    let all: Vec<(f64, f64)> = results.iter().flat_map(points).collect();
    let xmax = all.iter().map(|p| p.0).fold(0.0, f64::max).max(1e-9) * 1.05;
    let ymax = all.iter().map(|p| p.1).chain(slo).fold(0.0, f64::max).max(1e-9) * 1.1;
    let sx = |x: f64| x0 + pad + x / xmax * (w - 2.0 * pad);
    let sy = |y: f64| h - pad + 20.0 - y / ymax * (h - 2.0 * pad);
    let _ = write!(svg, r#"<text x="{}" y="25" font-size="14" text-anchor="middle">{title}</text>"#, x0 + w / 2.0);
    let _ = write!(svg, r#"<line x1="{0}" y1="{1}" x2="{2}" y2="{1}" stroke="black"/>"#, sx(0.0), sy(0.0), sx(xmax));
    let _ = write!(svg, r#"<line x1="{0}" y1="{1}" x2="{0}" y2="{2}" stroke="black"/>"#, sx(0.0), sy(0.0), sy(ymax));
    for k in 0..=4 {
        let (xv, yv) = (xmax * k as f64 / 4.0, ymax * k as f64 / 4.0);
        let _ = write!(svg, r#"<text x="{}" y="{}" font-size="10" text-anchor="middle">{xv:.2}</text>"#, sx(xv), sy(0.0) + 14.0);
        let _ = write!(svg, r#"<text x="{}" y="{}" font-size="10" text-anchor="end">{yv:.0}</text>"#, sx(0.0) - 4.0, sy(yv) + 3.0);
    }
    let _ = write!(svg, r#"<text x="{}" y="{}" font-size="11" text-anchor="middle">{}</text>"#, x0 + w / 2.0, h + 5.0, p.x_label);
    if let Some(s) = slo {
        let _ = write!(svg, r#"<line x1="{}" y1="{2}" x2="{}" y2="{2}" stroke="gray" stroke-dasharray="4 3"/>"#, sx(0.0), sx(xmax), sy(s));
        let _ = write!(svg, r#"<text x="{}" y="{}" font-size="10" fill="gray" text-anchor="end">SLO</text>"#, sx(xmax), sy(s) - 3.0);
    }
    for (i, r) in results.iter().enumerate() {
        let pts = points(r);
        let c = COLORS[i % COLORS.len()];
        let path: Vec<String> = pts.iter().map(|(x, y)| format!("{:.1},{:.1}", sx(*x), sy(*y))).collect();
        let _ = write!(svg, r#"<polyline fill="none" stroke="{c}" stroke-width="2" points="{}"/>"#, path.join(" "));
        for (x, y) in pts {
            let _ = write!(svg, r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{c}"/>"#, sx(x), sy(y));
        }
    }
}

/// TTFT p99 and TPOT p99 against the offered rate.
pub fn latency_vs_rate(results: &[Value]) -> String {
    let slo = |k: &str| results.first().and_then(|r| r["slo"][k].as_f64());
    let rate = "offered rate (requests/s)";
    let panels = [
        Panel { title: "TTFT p99 (ms)", x_label: rate, points: &|r| by_rate(r, "ttft_ms"), slo: slo("ttft_ms") },
        Panel { title: "TPOT p99 (ms)", x_label: rate, points: &|r| by_rate(r, "tpot_ms"), slo: slo("tpot_ms") },
    ];
    document(results, &panels)
}

/// A multi-turn run: TTFT p50 and p99 against the turn index (the first rate of each result).
pub fn ttft_by_turn(results: &[Value]) -> String {
    let panels = [
        Panel { title: "TTFT p50 (ms) by turn", x_label: "turn", points: &|r| by_turn(r, "p50"), slo: None },
        Panel { title: "TTFT p99 (ms) by turn", x_label: "turn", points: &|r| by_turn(r, "p99"), slo: None },
    ];
    document(results, &panels)
}

fn document(results: &[Value], panels: &[Panel; 2]) -> String {
    let mut svg = String::new();
    let legend_h = 20.0 * results.len() as f64;
    let _ = write!(svg, r#"<svg xmlns="http://www.w3.org/2000/svg" width="860" height="{}" font-family="sans-serif">"#, 330.0 + legend_h);
    let _ = write!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    panel(&mut svg, results, &panels[0], 0.0);
    panel(&mut svg, results, &panels[1], 430.0);
    for (i, r) in results.iter().enumerate() {
        let y = 330.0 + 20.0 * i as f64;
        let c = COLORS[i % COLORS.len()];
        let label = r["label"].as_str().unwrap_or("?").replace('&', "&amp;").replace('<', "&lt;");
        // Multi-turn results have no goodput.
        let good = match r.get("goodput_rps") {
            None => String::new(),
            Some(g) => g.as_f64().map_or_else(|| " (goodput: none)".into(), |g| format!(" (goodput {g} req/s)")),
        };
        let _ = write!(svg, r#"<rect x="60" y="{}" width="14" height="4" fill="{c}"/><text x="80" y="{}" font-size="12">{label}{good}</text>"#, y - 4.0, y);
    }
    svg.push_str("</svg>\n");
    svg
}
