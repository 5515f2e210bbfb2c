//! Tokenizers, chat templates and streaming detokenization for Ferry.
//!
//! - [`Tokenizer`]: Hugging Face `tokenizers` underneath, loaded from a `tokenizer.json`
//!   ([`Tokenizer::from_file`]) or rebuilt from GGUF metadata ([`Tokenizer::from_gguf`], byte-level
//!   BPE with the pre-tokenizer named by `tokenizer.ggml.pre`), plus BOS / end-of-sequence ids.
//! - [`ChatTemplate`]: the model's Jinja chat template rendered like `transformers` does, and
//!   [`ChatTemplate::encode`]: a chat's ids where what clients wrote cannot become special tokens.
//! - [`ModelText`]: a model path's tokenizer, chat template and special-token settings, without
//!   its weights (what the router needs to tokenize exactly as the engine does).
//! - [`served_name`]: the name a model path is served under by default.
//! - [`StreamDecoder`]: ids in, whole characters out, for streaming responses.
//! - [`Tokenizer::token_bytes`]: the bytes one token stands for (log-probability answers).

mod chat;
mod chat_encode;
mod error;
mod gguf;
mod model_text;
mod name;
mod stream;
mod token_bytes;
mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate, FunctionCall, Role, ToolCall};
pub use error::{BoxError, TokenizerError};
pub use gguf::PreTokenizerKind;
pub use model_text::ModelText;
pub use name::{served_name, without_quant};
pub use stream::{StreamDecoder, TextStream};
pub use tokenizer::Tokenizer;
