//! Whether a JSON schema admits any finite JSON value at all. A schema whose definition requires
//! an instance of itself (`{"$defs": {"a": {"type": "object", "properties": {"a": {"$ref":
//! "#/$defs/a"}}, "required": ["a"]}}, "$ref": "#/$defs/a"}`) compiles, and its grammar then
//! never lets the value end: the model writes `{"a": {"a": {"a": …` until `max_tokens` (issue
//! 32). Such a schema is refused before it compiles.
//!
//! This is the "productive nonterminal" computation of context-free grammars (a least fixpoint:
//! a definition is productive once some alternative of it needs only productive definitions),
//! over the keywords that force a sub-value to exist: `required` properties, `minItems` items
//! and `prefixItems`, `allOf` / `anyOf` / `oneOf`, `$ref`, and the boolean schemas. Every other
//! keyword is taken to allow a finite value, so the check only refuses what certainly has none;
//! and it gives up (allows) past a work budget, leaving the rest to the compile's own limits.

use std::collections::HashSet;

use serde_json::{Map, Value};

/// Schema nodes visited at most, over all rounds (a 64 KiB schema is far below it).
const WORK_BUDGET: u64 = 2_000_000;

/// `Some(why)` when `root` certainly admits no finite value; `why` names the definition at fault.
pub fn no_finite_instance(root: &Value) -> Option<String> {
    let mut refs = Vec::new();
    collect_refs(root, &mut refs);
    let mut seen = HashSet::new();
    refs.retain(|r| seen.insert(r.clone()));
    let mut eval = Eval { root, productive: HashSet::new(), work: 0 };
    // Least fixpoint: every round adds the definitions that have become productive.
    loop {
        let mut grew = false;
        for r in &refs {
            if eval.productive.contains(r) {
                continue;
            }
            let found = match resolve(root, r) {
                Some(target) => eval.node(target)?,
                // Not a local definition: not ours to judge.
                None => true,
            };
            if found {
                eval.productive.insert(r.clone());
                grew = true;
            }
        }
        if !grew {
            break;
        }
    }
    if eval.node(root)? {
        return None;
    }
    let culprit = refs.iter().find(|r| !eval.productive.contains(*r));
    Some(match culprit {
        Some(r) => format!("it admits no finite JSON value: `{r}` requires a value of itself, with no way to end"),
        None => "it admits no JSON value at all".to_string(),
    })
}

struct Eval<'a> {
    root: &'a Value,
    /// The `$ref`s known to admit a finite value.
    productive: HashSet<String>,
    work: u64,
}

impl Eval<'_> {
    /// Whether `v` admits a finite value, given the definitions known productive so far; None when
    /// the work budget is spent (the caller then allows the schema).
    fn node(&mut self, v: &Value) -> Option<bool> {
        self.work += 1;
        if self.work > WORK_BUDGET {
            return None;
        }
        let o = match v {
            Value::Bool(b) => return Some(*b),
            Value::Object(o) => o,
            _ => return Some(true),
        };
        if o.contains_key("const") || o.contains_key("enum") {
            return Some(true);
        }
        if let Some(Value::String(r)) = o.get("$ref")
            && resolve(self.root, r).is_some()
            && !self.productive.contains(r)
        {
            return Some(false);
        }
        if let Some(Value::Array(all)) = o.get("allOf") {
            for s in all {
                if !self.node(s)? {
                    return Some(false);
                }
            }
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(Value::Array(alts)) = o.get(key)
                && !alts.is_empty()
                && !self.any(alts)?
            {
                return Some(false);
            }
        }
        match o.get("type") {
            None => self.object(o).and_then(|ok| if ok { self.array(o) } else { Some(false) }),
            Some(Value::String(t)) => self.typed(o, t),
            Some(Value::Array(ts)) => {
                for t in ts {
                    match t {
                        Value::String(t) if self.typed(o, t)? => return Some(true),
                        Value::String(_) => {}
                        _ => return Some(true),
                    }
                }
                Some(ts.is_empty())
            }
            Some(_) => Some(true),
        }
    }

    fn any(&mut self, alts: &[Value]) -> Option<bool> {
        for s in alts {
            if self.node(s)? {
                return Some(true);
            }
        }
        Some(false)
    }

    fn typed(&mut self, o: &Map<String, Value>, t: &str) -> Option<bool> {
        match t {
            "object" => self.object(o),
            "array" => self.array(o),
            _ => Some(true),
        }
    }

    /// Every required property's schema admits a finite value.
    fn object(&mut self, o: &Map<String, Value>) -> Option<bool> {
        let Some(Value::Array(required)) = o.get("required") else { return Some(true) };
        let props = o.get("properties").and_then(Value::as_object);
        for name in required.iter().filter_map(Value::as_str) {
            let schema = props.and_then(|p| p.get(name)).or_else(|| o.get("additionalProperties"));
            if let Some(s) = schema
                && !self.node(s)?
            {
                return Some(false);
            }
        }
        Some(true)
    }

    /// The items an array must hold admit finite values.
    fn array(&mut self, o: &Map<String, Value>) -> Option<bool> {
        let min = o.get("minItems").and_then(Value::as_u64).unwrap_or(0);
        if min == 0 {
            return Some(true);
        }
        let prefix = o.get("prefixItems").and_then(Value::as_array).map(Vec::as_slice).unwrap_or(&[]);
        for s in prefix.iter().take(min as usize) {
            if !self.node(s)? {
                return Some(false);
            }
        }
        if min as usize > prefix.len()
            && let Some(items) = o.get("items")
            && items.is_object()
        {
            return self.node(items);
        }
        Some(true)
    }
}

/// Every `$ref` string in `v`.
fn collect_refs(v: &Value, out: &mut Vec<String>) {
    crate::limits::for_each_member(v, |k, x| {
        if let ("$ref", Value::String(r)) = (k, x) {
            out.push(r.clone());
        }
    });
}

/// The schema a local `$ref` (`#`, `#/json/pointer`) names in `root`.
fn resolve<'a>(root: &'a Value, r: &str) -> Option<&'a Value> {
    let pointer = r.strip_prefix('#')?;
    if pointer.is_empty() {
        return Some(root);
    }
    root.pointer(pointer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn schemas_without_a_finite_value_are_named() {
        let refused = [
            // The attack: a required property of its own type.
            json!({"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}}}),
            // The root itself, through `#`.
            json!({"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}),
            // Two definitions requiring each other.
            json!({"$ref": "#/definitions/a", "definitions": {
                "a": {"type": "object", "properties": {"b": {"$ref": "#/definitions/b"}}, "required": ["b"]},
                "b": {"type": "array", "items": {"$ref": "#/definitions/a"}, "minItems": 1}}}),
            // Every alternative needs itself.
            json!({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "array", "prefixItems": [{"$ref": "#/$defs/a"}], "minItems": 1}]}}, "$ref": "#/$defs/a"}),
            json!({"type": "object", "properties": {"x": false}, "required": ["x"]}),
        ];
        for s in &refused {
            let why = no_finite_instance(s).unwrap_or_else(|| panic!("not refused: {s}"));
            assert!(why.contains("finite") || why.contains("no JSON value"), "{why}");
        }
        let why = no_finite_instance(&refused[0]).unwrap();
        assert!(why.contains("`#/$defs/a`"), "{why}");
    }

    #[test]
    fn recursive_schemas_with_a_way_out_are_allowed() {
        let allowed = [
            // A linked list: `next` is optional.
            json!({"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#"}}, "required": ["v"]}),
            // A tree: children may be empty.
            json!({"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["children"]}}}),
            // Required, but one alternative ends.
            json!({"$defs": {"e": {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {"l": {"$ref": "#/$defs/e"}}, "required": ["l"]}]}}, "$ref": "#/$defs/e"}),
            // A type list with a scalar in it.
            json!({"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
            // Definitions resolved only in later rounds (declared in the opposite order).
            json!({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/c"}, "c": {"type": "string"}}}),
            // References we cannot resolve are not ours to judge.
            json!({"$ref": "https://example.com/schema.json"}),
            json!({"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}, "required": ["x"]}),
            json!(true),
            json!({}),
        ];
        for s in &allowed {
            assert_eq!(no_finite_instance(s), None, "{s}");
        }
    }

    #[test]
    fn a_long_chain_of_definitions_is_decided_within_the_budget() {
        // d0 -> d1 -> ... -> d2999 -> string: every round resolves at least one more.
        let mut defs = Map::new();
        for i in 0..3000 {
            let next = if i == 2999 { json!({"type": "string"}) } else { json!({"$ref": format!("#/$defs/d{}", i + 1)}) };
            defs.insert(format!("d{i}"), next);
        }
        let s = json!({"$ref": "#/$defs/d0", "$defs": defs});
        let t0 = std::time::Instant::now();
        assert_eq!(no_finite_instance(&s), None);
        assert!(t0.elapsed() < std::time::Duration::from_secs(2), "{:?}", t0.elapsed());
    }
}
