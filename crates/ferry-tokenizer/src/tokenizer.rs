//! [`Tokenizer`]: a `tokenizers` tokenizer plus the special ids the engine needs (BOS, the set of
//! end-of-sequence ids) and whether encoding prepends BOS / appends EOS.

use std::path::Path;

use crate::TokenizerError;

/// Text ↔ token ids. Built from a Hugging Face `tokenizer.json` ([`Tokenizer::from_file`]) or
/// from GGUF metadata ([`Tokenizer::from_gguf`]).
#[derive(Clone)]
pub struct Tokenizer {
    pub(crate) inner: tokenizers::Tokenizer,
    pub(crate) bos: Option<u32>,
    pub(crate) eos: Vec<u32>,
    /// Prepend `bos` / append the first `eos` when encoding with special tokens. GGUF files
    /// say so in metadata; `tokenizer.json` files do it in their own post-processor instead.
    pub(crate) add_bos: bool,
    pub(crate) add_eos: bool,
    /// `inner` with special tokens read as plain text ([`Tokenizer::encode_literal`]), made on
    /// first use.
    pub(crate) literal: std::sync::OnceLock<Box<tokenizers::Tokenizer>>,
}

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json`. BOS/EOS are unknown until [`Tokenizer::set_special`].
    pub fn from_file(path: &Path) -> Result<Tokenizer, TokenizerError> {
        let inner =
            tokenizers::Tokenizer::from_file(path).map_err(|source| TokenizerError::Load {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(Tokenizer {
            inner,
            bos: None,
            eos: vec![],
            add_bos: false,
            add_eos: false,
            literal: Default::default(),
        })
    }

    /// A tokenizer from the text of a `tokenizer.json` (`what` names it in errors).
    pub fn from_json(json: &str, what: &str) -> Result<Tokenizer, TokenizerError> {
        let inner = json.parse::<tokenizers::Tokenizer>().map_err(|source| TokenizerError::Load { path: what.into(), source })?;
        Ok(Tokenizer { inner, bos: None, eos: vec![], add_bos: false, add_eos: false, literal: Default::default() })
    }

    /// The id sequences that `bad_words` ban (vLLM's rule): each word without leading spaces,
    /// and with one leading space when that is a different first token and as many tokens
    /// (how a word reads at the start of a text and in the middle of one).
    pub fn bad_word_ids(&self, words: &[String]) -> Result<Vec<Vec<u32>>, TokenizerError> {
        let mut out: Vec<Vec<u32>> = Vec::with_capacity(words.len() * 2);
        for w in words {
            let bare = self.encode(w.trim_start(), false)?;
            let spaced = self.encode(&format!(" {}", w.trim_start()), false)?;
            let distinct = spaced.len() == bare.len() && spaced.first() != bare.first();
            if !bare.is_empty() {
                out.push(bare);
            }
            if distinct && !spaced.is_empty() {
                out.push(spaced);
            }
        }
        Ok(out)
    }

    /// Text to ids. With `add_special_tokens`, the tokenizer's own post-processing applies
    /// (and, for GGUF tokenizers, BOS/EOS per `tokenizer.ggml.add_bos_token` / `add_eos_token`).
    /// Special tokens written in the text (`<|im_start|>`) are always recognized.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|source| TokenizerError::Encode {
                len: text.len(),
                source,
            })?;
        let body = enc.get_ids();
        let mut ids = Vec::with_capacity(body.len() + 2);
        if add_special_tokens && self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(body);
        if add_special_tokens && self.add_eos {
            ids.extend(self.eos.first());
        }
        Ok(ids)
    }

    /// Text to ids with every special token's text read as plain text (`<|im_end|>` becomes
    /// `<`, `|`, `im`, …, never the special id), no special tokens added: what a client wrote
    /// inside a chat message (see [`crate::ChatTemplate::encode`]).
    pub fn encode_literal(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let literal = self.literal.get_or_init(|| {
            let mut t = self.inner.clone();
            t.set_encode_special_tokens(true);
            Box::new(t)
        });
        let enc = literal
            .encode_fast(text, false)
            .map_err(|source| TokenizerError::Encode { len: text.len(), source })?;
        Ok(enc.get_ids().to_vec())
    }

    /// The texts of the special (control) tokens, longest first.
    pub fn special_texts(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .inner
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| t.special && !t.content.is_empty())
            .map(|t| t.content)
            .collect();
        v.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        v.dedup();
        v
    }

    /// Ids to text. Unknown ids are an error (the underlying library would drop them silently).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        if let Some(&id) = ids.iter().find(|&&id| self.inner.id_to_token(id).is_none()) {
            return Err(TokenizerError::UnknownId {
                id,
                vocab_size: self.vocab_size(),
            });
        }
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|source| TokenizerError::Decode {
                n: ids.len(),
                source,
            })
    }

    /// Number of ids, added tokens included.
    /// The tokenizer as `tokenizer.json` text (GGUF tokenizers included: they are rebuilt as one).
    pub fn to_json(&self) -> Result<String, TokenizerError> {
        self.inner.to_string(false).map_err(|source| TokenizerError::Build { source })
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Whether `id` is a special (control) token, skipped by `decode(.., true)`.
    pub fn is_special(&self, id: u32) -> bool {
        self.inner
            .id_to_token(id)
            .is_some_and(|t| self.inner.get_added_vocabulary().is_special_token(&t))
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// Ids that end generation (EOS, and EOT/EOM where the model defines them).
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos
    }

    /// Sets BOS and the end-of-sequence ids (for tokenizers loaded from `tokenizer.json`).
    pub fn set_special(&mut self, bos: Option<u32>, eos: Vec<u32>) {
        self.bos = bos;
        self.eos = eos;
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .finish()
    }
}
