//! A check of Prometheus text (format 0.0.4) against the rules `promtool check metrics` applies
//! (its linter, `promlint`, and its parser), plus Ferry's own: one prefix per component. The
//! tests run it on each component's real `/metrics`, and [`promtool`] runs the reference checker
//! on the same text where it is installed.
//!
//! - [`lint_text`]: every family has `# HELP` and `# TYPE`, valid snake_case names without `:`,
//!   `_total` on counters only, no `_bucket`/`_count`/`_sum` on what is not a histogram or
//!   summary, no type or abbreviated / non-base unit in the name, histograms well formed
//!   (`le` buckets up to `+Inf`, cumulative, `_count` equal to the `+Inf` bucket), no sample
//!   outside a declared family, no series twice, every family under the prefix.
//! - [`lint_catalogue`]: the same name rules on a component's catalogue, and a histogram's name
//!   ending in its buckets' unit (`_seconds`, `_bytes`, `_tokens`, `_size`).

use std::collections::{BTreeMap, BTreeSet};

use ferry_proto::metrics::{Family, Kind};

/// Abbreviations promlint refuses as name parts (`use the full unit name`).
const ABBREVIATED_UNITS: &[&str] = &["s", "ms", "us", "ns", "sec", "b", "kb", "mb", "gb", "tb", "pb", "m", "h", "d"];
/// Units that are not Prometheus' base units, with the base unit to use.
const NON_BASE_UNITS: &[(&str, &str)] = &[
    ("milliseconds", "seconds"),
    ("microseconds", "seconds"),
    ("nanoseconds", "seconds"),
    ("minutes", "seconds"),
    ("hours", "seconds"),
    ("days", "seconds"),
    ("weeks", "seconds"),
    ("kilobytes", "bytes"),
    ("megabytes", "bytes"),
    ("gigabytes", "bytes"),
    ("kibibytes", "bytes"),
    ("mebibytes", "bytes"),
    ("gibibytes", "bytes"),
    ("bits", "bytes"),
    ("percent", "ratio"),
];
const TYPE_WORDS: &[&str] = &["counter", "gauge", "histogram", "summary"];

/// One problem found, naming the family (or the line).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Problem {
    pub family: String,
    pub what: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.family, self.what)
    }
}

fn problem(family: &str, what: impl Into<String>) -> Problem {
    Problem { family: family.to_string(), what: what.into() }
}

#[derive(Default)]
struct Declared {
    help: Option<String>,
    kind: Option<String>,
    /// (sample name, labels without `le`/`quantile`, `le` or `quantile`, value)
    samples: Vec<(String, Vec<(String, String)>, Option<String>, f64)>,
}

/// The problems of a `/metrics` text, each family expected to start with `prefix`.
pub fn lint_text(text: &str, prefix: &str) -> Vec<Problem> {
    let mut out = Vec::new();
    let mut families: BTreeMap<String, Declared> = BTreeMap::new();
    let mut series: BTreeSet<String> = BTreeSet::new();
    for (n, line) in text.lines().enumerate() {
        let at = format!("line {}", n + 1);
        if line.trim().is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            let d = families.entry(name.to_string()).or_default();
            if d.help.replace(help.to_string()).is_some() {
                out.push(problem(name, "a second # HELP"));
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, ""));
            if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind) {
                out.push(problem(name, format!("unknown type {kind:?}")));
            }
            let d = families.entry(name.to_string()).or_default();
            if !d.samples.is_empty() {
                out.push(problem(name, "# TYPE after its samples"));
            }
            if d.kind.replace(kind.to_string()).is_some() {
                out.push(problem(name, "a second # TYPE"));
            }
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let (name, labels, value) = match parse_sample(line) {
            Ok(s) => s,
            Err(e) => {
                out.push(problem(&at, format!("{e}: {line:?}")));
                continue;
            }
        };
        if !series.insert(format!("{name}{labels:?}")) {
            out.push(problem(&name, format!("the series {line:?} twice")));
        }
        let family = family_of(&name, &families);
        let Some(family) = family else {
            out.push(problem(&name, "a sample of no declared family (no # TYPE)"));
            continue;
        };
        let mut rest = Vec::new();
        let mut special = None;
        for (k, v) in labels {
            if !valid_label(&k) {
                out.push(problem(&family, format!("invalid label name {k:?}")));
            }
            if k.chars().any(|c| c.is_ascii_uppercase()) {
                out.push(problem(&family, format!("label names should be written in 'snake_case' not 'camelCase' ({k:?})")));
            }
            if k == "le" || k == "quantile" {
                special = Some((k, v));
            } else {
                rest.push((k, v));
            }
        }
        let d = families.entry(family.clone()).or_default();
        let kind = d.kind.clone().unwrap_or_default();
        match (&special, kind.as_str()) {
            (Some((k, _)), "histogram") if k == "le" => {}
            (Some((k, _)), "summary") if k == "quantile" => {}
            (Some((k, _)), _) => out.push(problem(&family, format!("the label {k:?} is reserved for histograms (le) and summaries (quantile)"))),
            (None, _) => {}
        }
        d.samples.push((name, rest, special.map(|(_, v)| v), value));
    }
    for (name, d) in &families {
        out.extend(lint_family(name, d, prefix));
    }
    out
}

/// The family a sample belongs to: its own name, or a histogram's / summary's.
fn family_of(sample: &str, families: &BTreeMap<String, Declared>) -> Option<String> {
    if families.get(sample).is_some_and(|d| d.kind.is_some()) {
        return Some(sample.to_string());
    }
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(stem) = sample.strip_suffix(suffix)
            && let Some(d) = families.get(stem)
            && matches!(d.kind.as_deref(), Some("histogram" | "summary"))
        {
            return Some(stem.to_string());
        }
    }
    None
}

fn lint_family(name: &str, d: &Declared, prefix: &str) -> Vec<Problem> {
    let mut out = Vec::new();
    match &d.help {
        None => out.push(problem(name, "no help text")),
        Some(h) if h.trim().is_empty() => out.push(problem(name, "empty help text")),
        Some(_) => {}
    }
    let Some(kind) = d.kind.as_deref() else {
        out.push(problem(name, "no # TYPE"));
        return out;
    };
    out.extend(lint_name(name, kind, prefix));
    if kind == "histogram" {
        out.extend(lint_histogram(name, d));
    } else if kind != "summary" && d.samples.iter().any(|s| s.0 != name) {
        out.push(problem(name, "samples named other than their family"));
    }
    out
}

/// promlint's name rules, and the prefix.
fn lint_name(name: &str, kind: &str, prefix: &str) -> Vec<Problem> {
    let mut out = Vec::new();
    if !valid_metric_name(name) {
        out.push(problem(name, "not a valid metric name"));
    }
    if name.contains(':') {
        out.push(problem(name, "metric names should not contain ':' (reserved for recording rules)"));
    }
    if name.chars().any(|c| c.is_ascii_uppercase()) {
        out.push(problem(name, "metric names should be written in 'snake_case' not 'camelCase'"));
    }
    if !name.starts_with(prefix) {
        out.push(problem(name, format!("not under this component's prefix {prefix:?}")));
    }
    let counter = kind == "counter";
    if counter && !name.ends_with("_total") {
        out.push(problem(name, "counter metrics should have \"_total\" suffix"));
    }
    if !counter && name.ends_with("_total") {
        out.push(problem(name, "non-counter metrics should not have \"_total\" suffix"));
    }
    if kind != "histogram" && kind != "summary" {
        for suffix in ["_bucket", "_count", "_sum"] {
            if name.ends_with(suffix) {
                out.push(problem(name, format!("non-histogram and non-summary metrics should not have {suffix:?} suffix")));
            }
        }
    }
    for part in name.split('_') {
        if TYPE_WORDS.contains(&part) {
            out.push(problem(name, format!("metric name should not include type '{part}'")));
        }
        if ABBREVIATED_UNITS.contains(&part) {
            out.push(problem(name, format!("metric names should not contain abbreviated units ({part:?})")));
        }
        if let Some((_, base)) = NON_BASE_UNITS.iter().find(|(u, _)| *u == part) {
            out.push(problem(name, format!("use base unit {base:?} instead of {part:?}")));
        }
    }
    out
}

fn lint_histogram(name: &str, d: &Declared) -> Vec<Problem> {
    let mut out = Vec::new();
    // Per label set: (buckets (le, cumulative count), sum, count).
    let mut sets: BTreeMap<String, (Vec<(f64, f64)>, Option<f64>, Option<f64>)> = BTreeMap::new();
    for (sample, labels, le, value) in &d.samples {
        let set = sets.entry(format!("{labels:?}")).or_default();
        let suffix = sample.strip_prefix(name).unwrap_or_default();
        match (suffix, le) {
            ("_bucket", Some(le)) => match parse_value(le) {
                Some(b) => set.0.push((b, *value)),
                None => out.push(problem(name, format!("le={le:?} is not a number"))),
            },
            ("_bucket", None) => out.push(problem(name, "a bucket without le")),
            ("_sum", None) => set.1 = Some(*value),
            ("_count", None) => set.2 = Some(*value),
            _ => out.push(problem(name, format!("the sample {sample} does not belong to a histogram"))),
        }
    }
    for (labels, (buckets, sum, count)) in sets {
        let at = |what: &str| problem(name, format!("{labels}: {what}"));
        if sum.is_none() {
            out.push(at("no _sum"));
        }
        let Some(inf) = buckets.iter().find(|(le, _)| le.is_infinite()).map(|b| b.1) else {
            out.push(at("no le=\"+Inf\" bucket"));
            continue;
        };
        if count != Some(inf) {
            out.push(at("_count differs from the +Inf bucket"));
        }
        if buckets.windows(2).any(|w| w[1].0 <= w[0].0 || w[1].1 < w[0].1) {
            out.push(at("buckets not in rising order of le with cumulative counts"));
        }
    }
    out
}

/// The name rules on a component's catalogue: promlint's, the prefix, each histogram's unit
/// suffix from its buckets, help text, no name twice and no name that another family's
/// `_bucket`/`_sum`/`_count` series would take.
pub fn lint_catalogue(families: &[Family], prefix: &str) -> Vec<Problem> {
    let mut out = Vec::new();
    let mut taken: BTreeMap<String, &str> = BTreeMap::new();
    for f in families {
        let kind = match f.kind {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram(_) => "histogram",
        };
        out.extend(lint_name(f.name, kind, prefix));
        if f.help.trim().is_empty() {
            out.push(problem(f.name, "no help text"));
        }
        if let Kind::Histogram(b) = f.kind
            && !f.name.ends_with(b.unit_suffix())
        {
            out.push(problem(f.name, format!("a histogram of {b:?} should end in {:?}", b.unit_suffix())));
        }
        let mut series = vec![f.name.to_string()];
        if matches!(f.kind, Kind::Histogram(_)) {
            series.extend(["_bucket", "_sum", "_count"].map(|s| format!("{}{s}", f.name)));
        }
        for s in series {
            if let Some(other) = taken.insert(s.clone(), f.name) {
                out.push(problem(f.name, format!("the series name {s} is taken by {other} too")));
            }
        }
    }
    out
}

fn valid_metric_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':') && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn valid_label(name: &str) -> bool {
    let mut chars = name.chars();
    !name.starts_with("__") && chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_') && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn parse_value(v: &str) -> Option<f64> {
    match v {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        v => v.parse().ok(),
    }
}

/// `name{k="v",…} value [timestamp]`.
fn parse_sample(line: &str) -> Result<(String, Vec<(String, String)>, f64), String> {
    let end = line.find(['{', ' ']).ok_or("no value")?;
    let name = &line[..end];
    let mut labels = Vec::new();
    let mut rest = &line[end..];
    if let Some(inner) = rest.strip_prefix('{') {
        let mut s = inner;
        loop {
            s = s.trim_start_matches([',', ' ']);
            if let Some(after) = s.strip_prefix('}') {
                rest = after;
                break;
            }
            let (k, after) = s.split_once("=\"").ok_or("a label without =\"")?;
            let mut value = String::new();
            let mut chars = after.char_indices();
            let close = loop {
                match chars.next() {
                    Some((_, '\\')) => match chars.next() {
                        Some((_, 'n')) => value.push('\n'),
                        Some((_, c)) => value.push(c),
                        None => return Err("an unfinished escape".into()),
                    },
                    Some((i, '"')) => break i,
                    Some((_, c)) => value.push(c),
                    None => return Err("an unterminated label value".into()),
                }
            };
            labels.push((k.trim().to_string(), value));
            s = &after[close + 1..];
        }
    }
    let mut fields = rest.split_whitespace();
    let value = fields.next().ok_or("no value")?;
    let value = parse_value(value).ok_or_else(|| format!("the value {value:?} is not a number"))?;
    if let Some(ts) = fields.next()
        && ts.parse::<i64>().is_err()
    {
        return Err(format!("the timestamp {ts:?} is not an integer"));
    }
    labels.sort();
    Ok((name.to_string(), labels, value))
}

/// What `promtool check metrics` said of a text.
#[derive(Debug)]
pub enum Promtool {
    /// Not on `PATH`.
    Missing,
    /// Exit 0: clean. The output (empty when clean).
    Clean(String),
    /// Problems found (or promtool failed): its exit status and output.
    Problems(String),
}

/// Runs `promtool check metrics` (Prometheus' reference linter) on `text`.
pub fn promtool(text: &str) -> Promtool {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let child = Command::new("promtool").args(["check", "metrics"]).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Promtool::Missing,
        Err(e) => return Promtool::Problems(format!("starting promtool: {e}")),
    };
    if let Some(mut stdin) = child.stdin.take()
        && let Err(e) = stdin.write_all(text.as_bytes())
    {
        return Promtool::Problems(format!("writing to promtool: {e}"));
    }
    match child.wait_with_output() {
        Ok(o) => {
            let said = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
            if o.status.success() { Promtool::Clean(said) } else { Promtool::Problems(format!("{}: {said}", o.status)) }
        }
        Err(e) => Promtool::Problems(format!("waiting for promtool: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_proto::metrics::Buckets;

    const GOOD: &str = "# HELP x_requests_total Requests.\n# TYPE x_requests_total counter\nx_requests_total{outcome=\"ok\"} 3\n\n\
# HELP x_latency_seconds Latency.\n# TYPE x_latency_seconds histogram\n\
x_latency_seconds_bucket{le=\"0.1\"} 1\nx_latency_seconds_bucket{le=\"+Inf\"} 2\nx_latency_seconds_sum 0.3\nx_latency_seconds_count 2\n\
# HELP x_open Open now.\n# TYPE x_open gauge\nx_open{server=\"a b\\\"c\"} 2\n";

    fn whats(text: &str, prefix: &str) -> Vec<String> {
        lint_text(text, prefix).into_iter().map(|p| p.to_string()).collect()
    }

    #[test]
    fn a_clean_text_passes() {
        assert_eq!(whats(GOOD, "x_"), Vec::<String>::new());
    }

    #[test]
    fn each_rule_is_caught() {
        let cases: &[(&str, &str)] = &[
            ("# TYPE x_a_total counter\nx_a_total 1\n", "no help text"),
            ("# HELP x_a A.\n# TYPE x_a counter\nx_a 1\n", "counter metrics should have \"_total\" suffix"),
            ("# HELP x_a_total A.\n# TYPE x_a_total gauge\nx_a_total 1\n", "non-counter metrics should not have \"_total\" suffix"),
            ("# HELP x_a_count A.\n# TYPE x_a_count gauge\nx_a_count 1\n", "should not have \"_count\" suffix"),
            ("# HELP x_a_ms A.\n# TYPE x_a_ms gauge\nx_a_ms 1\n", "abbreviated units"),
            ("# HELP x_a_milliseconds A.\n# TYPE x_a_milliseconds gauge\nx_a_milliseconds 1\n", "use base unit \"seconds\""),
            ("# HELP x_gauge_a A.\n# TYPE x_gauge_a gauge\nx_gauge_a 1\n", "should not include type 'gauge'"),
            ("# HELP x_aB A.\n# TYPE x_aB gauge\nx_aB 1\n", "snake_case"),
            ("# HELP y_a A.\n# TYPE y_a gauge\ny_a 1\n", "prefix"),
            ("x_a 1\n", "no declared family"),
            ("# HELP x_a A.\n# TYPE x_a gauge\nx_a{le=\"1\"} 1\n", "reserved for histograms"),
            ("# HELP x_a A.\n# TYPE x_a gauge\nx_a 1\nx_a 2\n", "twice"),
            ("# HELP x_h_seconds H.\n# TYPE x_h_seconds histogram\nx_h_seconds_bucket{le=\"1\"} 1\nx_h_seconds_sum 1\nx_h_seconds_count 1\n", "+Inf"),
            (
                "# HELP x_h_seconds H.\n# TYPE x_h_seconds histogram\nx_h_seconds_bucket{le=\"1\"} 2\nx_h_seconds_bucket{le=\"+Inf\"} 1\nx_h_seconds_sum 1\nx_h_seconds_count 1\n",
                "cumulative",
            ),
        ];
        for (text, want) in cases {
            let got = whats(text, "x_");
            assert!(got.iter().any(|p| p.contains(want)), "{text:?}: want {want:?}, got {got:?}");
        }
    }

    #[test]
    fn catalogue_rules() {
        let bad = [
            Family::histogram("x_wait", Buckets::RequestSeconds, "Wait."),
            Family::counter("x_c_total", ""),
            Family::gauge("x_h_seconds_count", "Collides."),
            Family::histogram("x_h_seconds", Buckets::TokenSeconds, "H."),
        ];
        let got: Vec<String> = lint_catalogue(&bad, "x_").into_iter().map(|p| p.to_string()).collect();
        for want in ["x_wait: a histogram of RequestSeconds should end in \"_seconds\"", "x_c_total: no help text", "is taken by"] {
            assert!(got.iter().any(|p| p.contains(want)), "want {want:?}, got {got:?}");
        }
        let good = [Family::counter("x_a_total", "A."), Family::histogram("x_moved_bytes", Buckets::Bytes, "Moved.")];
        assert_eq!(lint_catalogue(&good, "x_"), vec![]);
    }
}
