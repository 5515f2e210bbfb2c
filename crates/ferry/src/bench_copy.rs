//! `ferry bench serve --workload copy`: chat requests whose answers mostly copy their prompt, the
//! traffic where speculative decoding from the prompt pays (n-gram prompt lookup, as in Saxena's
//! "Prompt Lookup Decoding", and suffix decoding, Oliaro et al. 2024). Three tasks, in turn:
//!
//! - code edit: a Rust or Python function of 250 to 350 tokens (`tests/fixtures/spec/*.{rs,py}`),
//!   "rewrite it with the function `X` renamed to `Y`";
//! - quote: three paragraphs (`tests/fixtures/spec/prose.txt`, ours and the GPL-2.0's), "copy the
//!   second paragraph exactly";
//! - JSON reformat: a generated document (nested objects and arrays, about 250 tokens) given
//!   minified, "reformat it with 2-space indentation".
//!
//! Each request also carries what a perfect copy would answer, so the bench can count exact copies
//! per task. Pure: randomness comes from the seed ([`crate::loadgen::uniforms`]).
//!
//! What repeats and what does not: the arrival times and max_tokens come from the seed alone (as
//! in the `random` workload: only the times scale with the rate). The content (which code block,
//! which identifiers, which paragraphs in which order, the JSON document) comes from the seed, the
//! rate's index in the sweep and the rate's bits, drawn afresh for every request: a later rate
//! does not replay an earlier one's prompts into the prefix cache. The fixtures are a small pool,
//! so two prompts may share a part: a code edit's prompt diverges from another's at the old
//! function name (624 names), a JSON one at its first key or value (the documents are random); a
//! quote begins with one of 24 paragraphs, so two quotes share their first paragraph (about 100
//! tokens a prefix cache may serve) once in 24, and a whole quote prompt (3 of 24 paragraphs in
//! order) comes back once in 12,144. The chat template's system turn and the task's instruction
//! words are common to all. The same seed and rates give the same requests.

use crate::loadgen::{poisson_arrivals, uniforms, LenDist};
use serde_json::{Map, Value};

/// The code blocks: (language, text with `{{NAME}}` where the function to rename is named).
const CODE: [(&str, &str); 6] = [
    ("rust", include_str!("../../../tests/fixtures/spec/window_mean.rs")),
    ("rust", include_str!("../../../tests/fixtures/spec/parse_config.rs")),
    ("rust", include_str!("../../../tests/fixtures/spec/token_bucket.rs")),
    ("python", include_str!("../../../tests/fixtures/spec/word_counts.py")),
    ("python", include_str!("../../../tests/fixtures/spec/intervals.py")),
    ("python", include_str!("../../../tests/fixtures/spec/retry.py")),
];
const PLACEHOLDER: &str = "{{NAME}}";
/// Paragraphs, one per line, separated by blank lines.
const PROSE: &str = include_str!("../../../tests/fixtures/spec/prose.txt");

/// Function names are `verb_noun` (26 x 24); none is a word of the code blocks.
const VERBS: [&str; 26] = [
    "compute", "gather", "resolve", "derive", "collect", "tally", "measure", "build", "load", "scan", "merge", "rank", "fold", "probe", "settle", "shape",
    "sort", "track", "weigh", "yield", "apply", "check", "draw", "pack", "read", "sift",
];
const NOUNS: [&str; 24] = [
    "span", "batch", "ledger", "totals", "entries", "bounds", "stats", "frame", "chunk", "record", "series", "bucket_state", "slots", "ranges", "figures",
    "tokens_left", "pairs", "grid", "queue", "marks", "rows", "layers", "notes", "points",
];
/// Words for the JSON documents' keys and string values.
const KEYS: [&str; 40] = [
    "id", "name", "status", "owner", "region", "created", "tags", "items", "price", "quantity", "address", "city", "zone", "enabled", "limits", "retries",
    "timeout_ms", "version", "labels", "notes", "metrics", "count", "latency_ms", "endpoints", "host", "port", "weight", "children", "title", "score",
    "rank", "color", "size", "unit", "source", "target", "path", "mode", "level", "threshold",
];
const WORDS: [&str; 32] = [
    "amber", "river", "north", "cobalt", "granite", "harbor", "maple", "orbit", "pilot", "quartz", "signal", "timber", "velvet", "willow", "active",
    "paused", "primary", "backup", "alpha", "delta", "sierra", "falcon", "meadow", "copper", "silver", "lantern", "summit", "canyon", "ember", "glacier",
    "prairie", "tundra",
];

/// The task a request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Task {
    CodeEdit,
    Quote,
    JsonReformat,
}

impl Task {
    pub const ALL: [Task; 3] = [Task::CodeEdit, Task::Quote, Task::JsonReformat];

    pub fn name(self) -> &'static str {
        match self {
            Task::CodeEdit => "code_edit",
            Task::Quote => "quote",
            Task::JsonReformat => "json_reformat",
        }
    }
}

/// One request of the `copy` workload.
#[derive(Clone, Debug, PartialEq)]
pub struct CopyRequest {
    /// Seconds after the start at which it is sent.
    pub at: f64,
    pub task: Task,
    /// The one user message of the chat (the model's template wraps it).
    pub message: String,
    /// What a perfect copy answers.
    pub expected: String,
    /// Most tokens to generate (the answer ends earlier at EOS).
    pub max_tokens: usize,
}

/// The `copy` workload at the `rate_index`-th rate of a sweep: `count` requests at Poisson
/// arrivals of `rate`, tasks in turn (code edit, quote, JSON reformat), max_tokens drawn from
/// `output`. See the module doc for what repeats across rates.
pub fn copy_requests(seed: u64, rate_index: usize, rate: f64, count: usize, output: LenDist) -> Vec<CopyRequest> {
    let mut u = uniforms(seed);
    let arrivals = poisson_arrivals(rate, count, &mut u);
    let content_seed = seed ^ rate.to_bits().rotate_left(29) ^ (rate_index as u64 + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93);
    let mut c = uniforms(content_seed);
    let paragraphs: Vec<&str> = PROSE.split("\n\n").map(str::trim).filter(|p| !p.is_empty()).collect();
    arrivals
        .into_iter()
        .enumerate()
        .map(|(i, at)| {
            let task = Task::ALL[i % Task::ALL.len()];
            let (message, expected) = match task {
                Task::CodeEdit => code_edit(&mut c),
                Task::Quote => quote(&paragraphs, &mut c),
                Task::JsonReformat => json_reformat(&mut c),
            };
            CopyRequest { at, task, message, expected, max_tokens: output.sample(&mut u) }
        })
        .collect()
}

/// An index below `n`.
fn pick(u: &mut dyn FnMut() -> f64, n: usize) -> usize {
    ((u() * n as f64) as usize).min(n - 1)
}

fn function_name(u: &mut dyn FnMut() -> f64) -> String {
    format!("{}_{}", VERBS[pick(u, VERBS.len())], NOUNS[pick(u, NOUNS.len())])
}

fn code_edit(u: &mut dyn FnMut() -> f64) -> (String, String) {
    let (lang, template) = CODE[pick(u, CODE.len())];
    let old = function_name(u);
    let new = loop {
        let n = function_name(u);
        if n != old {
            break n;
        }
    };
    let code = template.replace(PLACEHOLDER, &old);
    let message = format!("Rewrite this code with the function `{old}` renamed to `{new}`. Output only the code.\n\n```{lang}\n{code}```");
    (message, template.replace(PLACEHOLDER, &new))
}

fn quote(paragraphs: &[&str], u: &mut dyn FnMut() -> f64) -> (String, String) {
    let mut chosen: Vec<&str> = Vec::with_capacity(3);
    while chosen.len() < 3 {
        let p = paragraphs[pick(u, paragraphs.len())];
        if !chosen.contains(&p) {
            chosen.push(p);
        }
    }
    let message = format!("Here is a passage:\n\n{}\n\nCopy the passage's second paragraph exactly. Output only that paragraph.", chosen.join("\n\n"));
    (message, chosen[1].to_string())
}

fn json_reformat(u: &mut dyn FnMut() -> f64) -> (String, String) {
    let doc = json_document(u);
    let minified = doc.to_string();
    // serde_json's pretty printer indents by 2 spaces.
    let pretty = serde_json::to_string_pretty(&doc).unwrap_or_else(|_| minified.clone());
    (format!("Reformat this JSON with 2-space indentation. Output only the JSON.\n\n{minified}"), pretty)
}

/// A JSON object of 620 to about 900 characters minified (about 250 tokens): top-level fields
/// added until it is long enough, values nested at most two levels deeper.
pub fn json_document(u: &mut dyn FnMut() -> f64) -> Value {
    let mut top = Map::new();
    while Value::Object(top.clone()).to_string().len() < 620 {
        let key = KEYS[pick(u, KEYS.len())];
        if !top.contains_key(key) {
            let v = json_value(u, 0);
            top.insert(key.to_string(), v);
        } else if top.len() == KEYS.len() {
            break;
        }
    }
    Value::Object(top)
}

fn json_value(u: &mut dyn FnMut() -> f64, depth: usize) -> Value {
    let r = u();
    if depth >= 2 || r < 0.5 {
        return json_scalar(u);
    }
    if r < 0.75 {
        let mut m = Map::new();
        for _ in 0..2 + pick(u, 3) {
            m.insert(KEYS[pick(u, KEYS.len())].to_string(), json_value(u, depth + 1));
        }
        return Value::Object(m);
    }
    let objects = u() < 0.5;
    Value::Array((0..2 + pick(u, 3)).map(|_| if objects { json_value(u, depth + 1) } else { json_scalar(u) }).collect())
}

fn json_scalar(u: &mut dyn FnMut() -> f64) -> Value {
    match pick(u, 7) {
        0 => Value::from(pick(u, 10_000) as u64),
        // Quarters: exact in binary, printed as written.
        1 => Value::from(pick(u, 40_000) as f64 / 4.0),
        2 => Value::from(u() < 0.5),
        3 => Value::Null,
        4 => Value::from(format!("{}-{}", WORDS[pick(u, WORDS.len())], pick(u, 1000))),
        _ => Value::from(format!("{} {}", WORDS[pick(u, WORDS.len())], WORDS[pick(u, WORDS.len())])),
    }
}

/// Whether `answer` is `expected` copied exactly, up to surrounding blank space, a Markdown code
/// fence around it and trailing spaces on its lines.
pub fn copied(expected: &str, answer: &str) -> bool {
    normalize(expected) == normalize(answer)
}

fn normalize(text: &str) -> String {
    let mut lines: Vec<&str> = text.trim().lines().map(str::trim_end).collect();
    if lines.first().is_some_and(|l| l.starts_with("```")) && lines.len() >= 2 && lines.last() == Some(&"```") {
        lines = lines[1..lines.len() - 1].to_vec();
    }
    lines.join("\n").trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn sweep(seed: u64) -> Vec<Vec<CopyRequest>> {
        [0.5, 1.0, 2.0].iter().enumerate().map(|(i, &r)| copy_requests(seed, i, r, 30, LenDist::Fixed(400))).collect()
    }

    #[test]
    fn prompts_differ_across_rates_and_requests() {
        let runs = sweep(3);
        let all: Vec<&str> = runs.iter().flatten().map(|r| r.message.as_str()).collect();
        let distinct: std::collections::HashSet<&str> = all.iter().copied().collect();
        assert_eq!(distinct.len(), all.len(), "a prompt repeats within the sweep");
        // Times and lengths do not depend on the rate's content; only the times scale with it.
        for (slow, fast) in runs[0].iter().zip(&runs[2]) {
            assert!((slow.at - 4.0 * fast.at).abs() < 1e-9);
            assert_eq!((slow.task, slow.max_tokens), (fast.task, fast.max_tokens));
        }
        // The same rate at another place of the sweep gets other prompts too.
        let again = copy_requests(3, 3, 0.5, 30, LenDist::Fixed(400));
        assert!(again.iter().zip(&runs[0]).all(|(a, b)| a.message != b.message));
    }

    #[test]
    fn each_task_appears_in_turn_and_its_answer_is_in_the_prompt() {
        let reqs = copy_requests(0, 0, 1.0, 30, LenDist::Uniform(300, 500));
        for (i, r) in reqs.iter().enumerate() {
            assert_eq!(r.task, Task::ALL[i % 3]);
            assert!((300..=500).contains(&r.max_tokens));
            match r.task {
                // The quote and the code (but for the name) are in the prompt word for word.
                Task::Quote => assert!(r.message.contains(&r.expected)),
                Task::CodeEdit => {
                    let (old, new) = names(&r.message);
                    assert_eq!(r.message.matches(&old).count() - 1, r.expected.matches(&new).count(), "{old} is a word of the code");
                    assert!(r.message.contains(&r.expected.replace(&new, &old)));
                }
                Task::JsonReformat => {}
            }
        }
        for t in Task::ALL {
            assert!(reqs.iter().filter(|r| r.task == t).count() == 10, "{t:?}");
        }
    }

    /// The old and new function names of a code edit's instruction.
    fn names(message: &str) -> (String, String) {
        let ticks: Vec<&str> = message.split('`').collect();
        (ticks[1].to_string(), ticks[3].to_string())
    }

    #[test]
    fn json_documents_round_trip_and_have_the_intended_size() {
        for r in copy_requests(9, 1, 2.0, 60, LenDist::Fixed(400)).iter().filter(|r| r.task == Task::JsonReformat) {
            let minified = r.message.rsplit("\n\n").next().unwrap();
            let doc: Value = serde_json::from_str(minified).unwrap();
            assert_eq!(doc.to_string(), minified);
            assert_eq!(serde_json::from_str::<Value>(&r.expected).unwrap(), doc);
            assert!(r.expected.contains("\n  \""), "not indented by 2: {}", r.expected);
            assert!((620..1300).contains(&minified.len()), "{} characters", minified.len());
            assert!(doc.as_object().unwrap().values().any(|v| v.is_object() || v.is_array()), "flat: {minified}");
        }
    }

    #[test]
    fn a_seed_reproduces_its_workload() {
        assert_eq!(sweep(11), sweep(11));
        assert_ne!(sweep(11), sweep(12));
    }

    #[test]
    fn fixtures_have_their_placeholders_and_paragraphs() {
        for (lang, code) in CODE {
            assert!(code.matches(PLACEHOLDER).count() >= 2, "{lang}: {code}");
            for v in VERBS {
                for n in NOUNS {
                    assert!(!code.contains(&format!("{v}_{n}")), "{v}_{n} is in the code already");
                }
            }
        }
        assert_eq!(PROSE.split("\n\n").filter(|p| !p.trim().is_empty()).count(), 24);
    }

    #[test]
    fn copies_are_recognized_through_fences_and_spaces() {
        assert!(copied("fn a() {}\n", "```rust\nfn a() {}  \n```\n"));
        assert!(copied("one two", "  one two\n"));
        assert!(!copied("one two", "one  two"));
    }

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        a: crate::bench_serve::ServeBenchArgs,
    }

    #[test]
    fn options_of_other_workloads_are_refused() {
        let check = |args: &[&str]| {
            let cli = Cli::try_parse_from(["ferry", "--rates", "1", "--workload", "copy"].iter().chain(args)).unwrap();
            crate::bench_serve::check_options(&cli.a).map_err(|e| e.to_string())
        };
        let e = check(&["--prompt-len", "100"]).unwrap_err();
        assert!(e.contains("--prompt-len") && e.contains("--workload copy"), "{e}");
        assert!(check(&["--turns", "3"]).unwrap_err().contains("--turns"));
        assert!(check(&["--requests", "6", "--output-len", "400", "--save-outputs", "/tmp/x"]).is_ok());
    }
}
