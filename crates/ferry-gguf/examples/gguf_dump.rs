//! Prints a GGUF file's metadata (long arrays summarized) and tensor index.
//! Usage: `cargo run -p ferry-gguf --example gguf_dump -- FILE.gguf`

use std::collections::BTreeMap;
use std::path::PathBuf;

use ferry_gguf::{GgufFile, MetaValue};

fn show(v: &MetaValue) -> String {
    match v {
        MetaValue::Array(items) if items.len() > 8 => {
            let head: Vec<String> = items.iter().take(4).map(show).collect();
            format!(
                "[{}, … ({} items, {})]",
                head.join(", "),
                items.len(),
                v.type_name()
            )
        }
        MetaValue::Array(items) => format!(
            "[{}]",
            items.iter().map(show).collect::<Vec<_>>().join(", ")
        ),
        MetaValue::String(s) if s.len() > 120 => {
            format!(
                "{:?}… ({} bytes)",
                s.chars().take(120).collect::<String>(),
                s.len()
            )
        }
        MetaValue::String(s) => format!("{s:?}"),
        other => format!("{other:?}"),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path: PathBuf = std::env::args_os()
        .nth(1)
        .ok_or("usage: gguf_dump FILE.gguf")?
        .into();
    let f = GgufFile::open(&path)?;
    println!(
        "version {} alignment {} data_offset {} len {}",
        f.version(),
        f.alignment(),
        f.data_offset(),
        f.file_len()
    );
    for (k, v) in f.metadata() {
        println!("{k} = {}", show(v));
    }
    let mut by_type: BTreeMap<String, usize> = BTreeMap::new();
    for t in f.tensors() {
        println!(
            "{:<40} {:<6} {:?} @{} {}B",
            t.name, t.ggml_type, t.dims, t.offset, t.n_bytes
        );
        *by_type.entry(t.ggml_type.name()).or_default() += 1;
    }
    println!("{} tensors: {by_type:?}", f.tensors().len());
    Ok(())
}
