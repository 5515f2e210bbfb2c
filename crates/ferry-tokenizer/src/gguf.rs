//! Building a [`Tokenizer`] from GGUF metadata: llama.cpp's `tokenizer.ggml.*` keys rebuilt as a
//! `tokenizers` byte-level BPE (the same tokenizer HF `tokenizers` would load from the model's
//! `tokenizer.json`). Only `tokenizer.ggml.model = "gpt2"` is supported; the pre-tokenizer comes
//! from the `tokenizer.ggml.pre` tag (llama.cpp's `llama_vocab_pre_type`).

use ferry_gguf::GgufFile;
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::models::bpe::{BPE, Merges, Vocab};
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::{Tokenizer, TokenizerError};

// GPT-2's split regex needs no constant: `ByteLevel` with `use_regex = true` applies it.
/// Llama 3's split regex: case-insensitive contractions, numbers in groups of up to three.
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split regex: like Llama 3's but single digits.
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizers this crate rebuilds, by `tokenizer.ggml.pre` tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizerKind {
    /// `gpt2`, `default`: byte-level with the GPT-2 regex.
    Gpt2,
    /// `smollm`: every digit split off on its own, then byte-level with the GPT-2 regex.
    SmolLm,
    /// `llama-bpe`, `llama3`: Llama 3's regex, then byte-level without a regex.
    Llama3,
    /// `qwen2`: NFC, Qwen2's regex, then byte-level without a regex.
    Qwen2,
}

const PRE_TAGS: &[(&str, PreTokenizerKind)] = &[
    ("gpt2", PreTokenizerKind::Gpt2),
    ("default", PreTokenizerKind::Gpt2),
    ("smollm", PreTokenizerKind::SmolLm),
    ("llama-bpe", PreTokenizerKind::Llama3),
    ("llama3", PreTokenizerKind::Llama3),
    ("qwen2", PreTokenizerKind::Qwen2),
];

impl PreTokenizerKind {
    pub fn from_tag(tag: &str) -> Result<Self, TokenizerError> {
        PRE_TAGS
            .iter()
            .find(|(t, _)| *t == tag)
            .map(|(_, k)| *k)
            .ok_or_else(|| TokenizerError::UnsupportedPreTokenizer {
                tag: tag.into(),
                supported: PRE_TAGS
                    .iter()
                    .map(|(t, _)| *t)
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    fn pre_tokenizer(self) -> Result<PreTokenizerWrapper, TokenizerError> {
        let split = |regex: &str| -> Result<PreTokenizerWrapper, TokenizerError> {
            let s = Split::new(
                SplitPattern::Regex(regex.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|source| TokenizerError::Build { source })?;
            Ok(s.into())
        };
        let byte_level =
            |use_regex| PreTokenizerWrapper::from(ByteLevel::new(false, true, use_regex));
        Ok(match self {
            PreTokenizerKind::Gpt2 => byte_level(true),
            PreTokenizerKind::SmolLm => {
                Sequence::new(vec![Digits::new(true).into(), byte_level(true)]).into()
            }
            PreTokenizerKind::Llama3 => {
                Sequence::new(vec![split(LLAMA3_REGEX)?, byte_level(false)]).into()
            }
            PreTokenizerKind::Qwen2 => {
                Sequence::new(vec![split(QWEN2_REGEX)?, byte_level(false)]).into()
            }
        })
    }
}

/// llama.cpp's `llama_token_type` values in `tokenizer.ggml.token_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TokenType {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    fn from_i32(v: i32) -> Option<Self> {
        Some(match v {
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => return None,
        })
    }
}

/// Splits a merge rule `"a b"` at the first space after its first character (as llama.cpp does).
fn split_merge(rule: &str) -> Option<(String, String)> {
    let (at, _) = rule.char_indices().skip(1).find(|&(_, c)| c == ' ')?;
    Some((rule[..at].to_string(), rule[at + 1..].to_string()))
}

/// An optional id key; present ids must index the vocabulary.
fn optional_id(g: &GgufFile, key: &str, n_tokens: usize) -> Result<Option<u32>, TokenizerError> {
    if g.get(key).is_none() {
        return Ok(None);
    }
    let id = g.get_u32(key)?;
    if id as usize >= n_tokens {
        return Err(TokenizerError::InvalidVocab(format!(
            "{key} = {id}, but the vocabulary has {n_tokens} tokens"
        )));
    }
    Ok(Some(id))
}

fn optional_bool(g: &GgufFile, key: &str, default: bool) -> Result<bool, TokenizerError> {
    match g.get(key) {
        None => Ok(default),
        Some(_) => Ok(g.get_bool(key)?),
    }
}

impl Tokenizer {
    /// Rebuilds the tokenizer stored in a GGUF file's metadata.
    pub fn from_gguf(g: &GgufFile) -> Result<Tokenizer, TokenizerError> {
        let model = g.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel {
                model: model.into(),
            });
        }
        let pre = match g.get("tokenizer.ggml.pre") {
            Some(_) => g.get_str("tokenizer.ggml.pre")?,
            None => "default",
        };
        let kind = PreTokenizerKind::from_tag(pre)?;

        let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
        let n = tokens.len();
        let types = match g.get("tokenizer.ggml.token_type") {
            Some(_) => g.get_i32_array("tokenizer.ggml.token_type")?,
            None => vec![1; n],
        };
        if types.len() != n {
            return Err(TokenizerError::InvalidVocab(format!(
                "{} token types for {n} tokens",
                types.len()
            )));
        }
        if u32::try_from(n).is_err() {
            return Err(TokenizerError::InvalidVocab(format!(
                "{n} tokens do not fit u32 ids"
            )));
        }
        // Iterating in reverse makes the first of any duplicated token string win.
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .rev()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let merges = g
            .get_str_array("tokenizer.ggml.merges")?
            .into_iter()
            .enumerate()
            .map(|(i, rule)| {
                split_merge(rule).ok_or_else(|| {
                    TokenizerError::InvalidVocab(format!("merge {i} {rule:?} is not \"a b\""))
                })
            })
            .collect::<Result<Merges, _>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|source| TokenizerError::Build { source })?;

        let mut inner = tokenizers::Tokenizer::new(bpe);
        if kind == PreTokenizerKind::Qwen2 {
            inner
                .with_normalizer(Some(NFC))
                .map_err(|source| TokenizerError::Build { source })?;
        }
        inner.with_pre_tokenizer(Some(kind.pre_tokenizer()?));
        inner.with_decoder(Some(ByteLevel::default()));

        let mut special = Vec::new();
        let mut user = Vec::new();
        for (i, (&text, &ty)) in tokens.iter().zip(&types).enumerate() {
            match TokenType::from_i32(ty) {
                Some(TokenType::Control | TokenType::Unknown) => {
                    special.push(AddedToken::from(text, true))
                }
                Some(TokenType::UserDefined) => user.push(AddedToken::from(text, false)),
                Some(TokenType::Normal | TokenType::Unused | TokenType::Byte) => {}
                None => {
                    return Err(TokenizerError::InvalidVocab(format!(
                        "token {i} {text:?} has unknown type {ty}"
                    )));
                }
            }
        }
        inner
            .add_special_tokens(special)
            .map_err(|source| TokenizerError::Build { source })?;
        inner
            .add_tokens(user)
            .map_err(|source| TokenizerError::Build { source })?;

        let bos = optional_id(g, "tokenizer.ggml.bos_token_id", n)?;
        let mut eos = Vec::new();
        for key in [
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        ] {
            if let Some(id) = optional_id(g, key, n)?
                && !eos.contains(&id)
            {
                eos.push(id);
            }
        }
        // Byte-level BPE tokenizers add no BOS unless the file says so (SmolLM2 says false).
        let add_bos = optional_bool(g, "tokenizer.ggml.add_bos_token", false)? && bos.is_some();
        let add_eos = optional_bool(g, "tokenizer.ggml.add_eos_token", false)? && !eos.is_empty();
        Ok(Tokenizer {
            inner,
            bos,
            eos,
            add_bos,
            add_eos,
            literal: Default::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pre_tokenizer_tags() {
        let table = [
            ("smollm", Some(PreTokenizerKind::SmolLm)),
            ("gpt2", Some(PreTokenizerKind::Gpt2)),
            ("default", Some(PreTokenizerKind::Gpt2)),
            ("llama-bpe", Some(PreTokenizerKind::Llama3)),
            ("llama3", Some(PreTokenizerKind::Llama3)),
            ("qwen2", Some(PreTokenizerKind::Qwen2)),
            ("deepseek-llm", None),
            ("", None),
        ];
        for (tag, expected) in table {
            match (PreTokenizerKind::from_tag(tag), expected) {
                (Ok(k), Some(e)) => assert_eq!(k, e, "{tag}"),
                (Err(e), None) => {
                    let msg = e.to_string();
                    assert!(
                        msg.contains(&format!("{tag:?}")) && msg.contains("smollm, "),
                        "{msg}"
                    );
                }
                (got, want) => panic!("{tag}: got {got:?}, want {want:?}"),
            }
        }
        for (_, kind) in PRE_TAGS {
            kind.pre_tokenizer()
                .expect("every supported regex compiles");
        }
    }

    #[test]
    fn merge_rules() {
        assert_eq!(split_merge("Ġ t"), Some(("Ġ".into(), "t".into())));
        assert_eq!(split_merge("a b c"), Some(("a".into(), "b c".into())));
        assert_eq!(split_merge("  x"), Some((" ".into(), "x".into())));
        assert_eq!(split_merge("ab"), None);
        assert_eq!(split_merge(""), None);
    }
}
