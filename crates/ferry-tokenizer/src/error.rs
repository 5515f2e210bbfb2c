//! The crate's one error type. All variants are final for the request or file in question
//! (retrying elsewhere does not help): bad files, unsupported tokenizers, bad ids, bad templates.

use std::path::PathBuf;

/// What `tokenizers` reports: a boxed error.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot load tokenizer from {path}: {source}")]
    Load {
        path: PathBuf,
        #[source]
        source: BoxError,
    },
    #[error("invalid {path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error("reading tokenizer metadata from GGUF: {0}")]
    Gguf(#[from] ferry_gguf::GgufError),
    #[error("GGUF tokenizer model {model:?} is not supported (supported: gpt2, byte-level BPE)")]
    UnsupportedModel { model: String },
    #[error("GGUF pre-tokenizer {tag:?} is not supported (supported: {supported})")]
    UnsupportedPreTokenizer { tag: String, supported: String },
    #[error("invalid GGUF vocabulary: {0}")]
    InvalidVocab(String),
    #[error("cannot build the tokenizer: {source}")]
    Build {
        #[source]
        source: BoxError,
    },
    #[error("cannot encode a {len}-byte text: {source}")]
    Encode {
        len: usize,
        #[source]
        source: BoxError,
    },
    #[error("cannot decode {n} ids: {source}")]
    Decode {
        n: usize,
        #[source]
        source: BoxError,
    },
    #[error("token id {id} is not in the vocabulary (size {vocab_size})")]
    UnknownId { id: u32, vocab_size: usize },
    #[error("chat template does not compile: {0}")]
    TemplateSyntax(#[source] minijinja::Error),
    #[error("chat template failed to render: {0}")]
    TemplateRender(#[source] minijinja::Error),
}
