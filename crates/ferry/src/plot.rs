//! A small SVG plot for `ferry bench serve`: TTFT p99 and TPOT p99 against the offered rate, one
//! line per configuration (each a `bench serve` JSON result).

use serde_json::Value;
use std::fmt::Write;

const COLORS: [&str; 6] = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"];

fn points(result: &Value, metric: &str) -> Vec<(f64, f64)> {
    result["runs"]
        .as_array()
        .map(|runs| runs.iter().filter_map(|r| Some((r["rate"].as_f64()?, r[metric]["p99"].as_f64()?))).filter(|(_, y)| y.is_finite()).collect())
        .unwrap_or_default()
}

fn panel(svg: &mut String, results: &[Value], metric: &str, title: &str, x0: f64, slo: Option<f64>) {
    let (w, h, pad) = (420.0, 300.0, 50.0);
    let all: Vec<(f64, f64)> = results.iter().flat_map(|r| points(r, metric)).collect();
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
    let _ = write!(svg, r#"<text x="{}" y="{}" font-size="11" text-anchor="middle">offered rate (requests/s)</text>"#, x0 + w / 2.0, h + 5.0);
    if let Some(s) = slo {
        let _ = write!(svg, r#"<line x1="{}" y1="{2}" x2="{}" y2="{2}" stroke="gray" stroke-dasharray="4 3"/>"#, sx(0.0), sx(xmax), sy(s));
        let _ = write!(svg, r#"<text x="{}" y="{}" font-size="10" fill="gray" text-anchor="end">SLO</text>"#, sx(xmax), sy(s) - 3.0);
    }
    for (i, r) in results.iter().enumerate() {
        let pts = points(r, metric);
        let c = COLORS[i % COLORS.len()];
        let path: Vec<String> = pts.iter().map(|(x, y)| format!("{:.1},{:.1}", sx(*x), sy(*y))).collect();
        let _ = write!(svg, r#"<polyline fill="none" stroke="{c}" stroke-width="2" points="{}"/>"#, path.join(" "));
        for (x, y) in pts {
            let _ = write!(svg, r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{c}"/>"#, sx(x), sy(y));
        }
    }
}

/// The SVG document.
pub fn latency_vs_rate(results: &[Value]) -> String {
    let mut svg = String::new();
    let legend_h = 20.0 * results.len() as f64;
    let _ = write!(svg, r#"<svg xmlns="http://www.w3.org/2000/svg" width="860" height="{}" font-family="sans-serif">"#, 330.0 + legend_h);
    let _ = write!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let slo = |k: &str| results.first().and_then(|r| r["slo"][k].as_f64());
    panel(&mut svg, results, "ttft_ms", "TTFT p99 (ms)", 0.0, slo("ttft_ms"));
    panel(&mut svg, results, "tpot_ms", "TPOT p99 (ms)", 430.0, slo("tpot_ms"));
    for (i, r) in results.iter().enumerate() {
        let y = 330.0 + 20.0 * i as f64;
        let c = COLORS[i % COLORS.len()];
        let label = r["label"].as_str().unwrap_or("?").replace('&', "&amp;").replace('<', "&lt;");
        let good = r["goodput_rps"].as_f64().map(|g| format!("goodput {g} req/s")).unwrap_or_else(|| "goodput: none".into());
        let _ = write!(svg, r#"<rect x="60" y="{}" width="14" height="4" fill="{c}"/><text x="80" y="{}" font-size="12">{label} ({good})</text>"#, y - 4.0, y);
    }
    svg.push_str("</svg>\n");
    svg
}
