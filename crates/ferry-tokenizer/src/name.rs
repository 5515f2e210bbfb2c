//! The name a model is served under by default (`/v1/models`, gRPC `ModelInfo.model`): what a
//! user recognises from the model they passed, not the GGUF's `general.name` (which for the
//! default model is "Smollm2 135M 8k Lc100K Mix1 Ep2"). A GGUF file gives its stem without the
//! quantisation (`SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct`, as the HF repo it
//! came from is named); an HF folder its name, or `org/name` for a snapshot in the HF hub cache
//! (`…/models--org--name/snapshots/REV`).

use std::path::Path;

/// The default served name of the model at `path` (a `.gguf` file or an HF folder). A folder is
/// named from its canonical path (`ferry router --model .` names the folder, not "."); a file
/// from the path as given (a file in the HF hub cache is a link to a blob named by its hash).
pub fn served_name(path: &Path) -> String {
    let canonical;
    let path = match path.is_dir().then(|| path.canonicalize()) {
        Some(Ok(p)) => {
            canonical = p;
            canonical.as_path()
        }
        _ => path,
    };
    if let Some(repo) = hub_repo(path) {
        return repo;
    }
    let stem = match path.extension().and_then(|e| e.to_str()) {
        Some(e) if e.eq_ignore_ascii_case("gguf") => path.file_stem(),
        _ => path.file_name(),
    };
    match stem.map(|s| s.to_string_lossy()) {
        Some(s) if !s.is_empty() => without_quant(&s).to_owned(),
        _ => path.display().to_string(),
    }
}

/// `org/name` for a snapshot folder of the HF hub cache.
fn hub_repo(path: &Path) -> Option<String> {
    let parent = path.parent()?;
    if parent.file_name()? != "snapshots" {
        return None;
    }
    let repo = parent.parent()?.file_name()?.to_str()?.strip_prefix("models--")?;
    Some(repo.replacen("--", "/", 1))
}

/// A file stem without its quantisation and shard suffixes (`-Q4_K_M`, `.Q8_0`, `.f16`, `-bf16`,
/// A file stem without its quantisation and shard suffixes (`-Q4_K_M`, `.Q8_0`, `.f16`, `-bf16`,
/// `-00001-of-00003`, …). A stem that is nothing but a suffix stays as it is.
pub fn without_quant(stem: &str) -> &str {
    let mut s = shard_free(stem);
    let mut stripped = false;
    loop {
        // The tag after the last `.` or `-`, else after a later `_` (`model_f16`; a `_` inside
        // `Q4_K_M` leaves `M`, which is no tag).
        let dash = s.rfind(['.', '-']).filter(|&i| i > 0);
        let under = s.rfind('_').filter(|&i| i > 0 && dash.is_none_or(|d| i > d));
        let cut = [dash, under].into_iter().flatten().find(|&i| {
            let tag = &s[i + 1..];
            // Unsloth's dynamic quants: `-UD-Q4_K_XL`.
            is_quant(tag) || (stripped && tag.eq_ignore_ascii_case("ud"))
        });
        match cut {
            Some(i) => {
                s = &s[..i];
                stripped = true;
            }
            None => break,
        }
    }
    if s.is_empty() { stem } else { s }
}

/// `-00001-of-00003` (llama.cpp's split files) removed.
fn shard_free(stem: &str) -> &str {
    let parts: Vec<&str> = stem.rsplitn(4, '-').collect();
    match parts.as_slice() {
        [total, "of", part, rest] if is_digits(total) && is_digits(part) => rest,
        _ => stem,
    }
}

fn is_digits(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

/// A quantisation or dtype tag: `Q4_0`, `Q4_K_M`, `IQ2_XXS`, `TQ1_0`, `F16`, `BF16`, … (any case).
fn is_quant(tag: &str) -> bool {
    const DTYPES: &[&str] = &["F16", "F32", "F64", "BF16", "FP16", "FP32", "FP8", "FP4", "MXFP4", "NVFP4", "INT8", "INT4"];
    let t = tag.to_ascii_uppercase();
    if DTYPES.contains(&t.as_str()) {
        return true;
    }
    let Some(rest) = ["IQ", "TQ", "Q"].iter().find_map(|p| t.strip_prefix(p)) else {
        return false;
    };
    let mut parts = rest.split('_');
    parts.next().is_some_and(is_digits) && parts.all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_alphanumeric()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantisation_suffixes_come_off() {
        for (stem, want) in [
            ("SmolLM2-135M-Instruct.Q4_1", "SmolLM2-135M-Instruct"),
            ("Meta-Llama-3.1-8B-Instruct-Q4_K_M", "Meta-Llama-3.1-8B-Instruct"),
            ("mistral-7b-instruct-v0.2.Q8_0", "mistral-7b-instruct-v0.2"),
            ("qwen2.5-0.5b-instruct-q4_0", "qwen2.5-0.5b-instruct"),
            ("gemma-2-2b-it.f16", "gemma-2-2b-it"),
            ("gemma-2-2b-it-bf16", "gemma-2-2b-it"),
            ("Phi-3-mini-4k-instruct-fp16", "Phi-3-mini-4k-instruct"),
            ("Llama-3.2-1B-Instruct-IQ2_XXS", "Llama-3.2-1B-Instruct"),
            ("Qwen3-8B-UD-Q4_K_XL", "Qwen3-8B"),
            ("model-TQ1_0", "model"),
            ("ggml-model-f16", "ggml-model"),
            ("ggml-model_f16", "ggml-model"),
            ("tinyllama_Q4_K_M", "tinyllama_Q4_K_M"),
            ("Qwen2.5-72B-Instruct-Q4_K_M-00001-of-00012", "Qwen2.5-72B-Instruct"),
            ("model.Q4_0_4_4", "model"),
            // Nothing to take off, or nothing would be left.
            ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"),
            ("Llama-3.2-1B", "Llama-3.2-1B"),
            ("ud-model", "ud-model"),
            ("my-Quant", "my-Quant"),
            ("Q4_K_M", "Q4_K_M"),
            ("f16", "f16"),
            ("", ""),
        ] {
            assert_eq!(without_quant(stem), want, "{stem}");
        }
    }

    #[test]
    fn served_names_of_paths() {
        for (path, want) in [
            ("/root/.cache/ferry/models/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
            ("models/Llama-3.2-1B-Instruct-Q4_K_M.GGUF", "Llama-3.2-1B-Instruct"),
            ("/models/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"),
            ("/models/Qwen2.5-0.5B-Instruct-bf16", "Qwen2.5-0.5B-Instruct"),
            ("/hf/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/12fd25f7", "HuggingFaceTB/SmolLM2-135M-Instruct"),
            ("/hf/hub/models--bartowski--Llama-3.2-1B-GGUF/snapshots/ab12/Llama-3.2-1B-Q8_0.gguf", "Llama-3.2-1B"),
        ] {
            assert_eq!(served_name(Path::new(path)), want, "{path}");
        }
    }
}
