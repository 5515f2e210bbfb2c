//! A Hugging Face `tokenizer.json` (the tiny golden models' byte-level BPE) reproduces the
//! reference prompt ids in `tests/fixtures/golden/llama-gqa/golden.json`.

mod common;

use ferry_tokenizer::{ChatTemplate, Tokenizer, TokenizerError};

#[test]
fn golden_prompt_ids() {
    let tok = common::golden_tokenizer();
    let golden = common::read_json("golden/llama-gqa/golden.json");
    let prompt = golden["prompt"].as_str().unwrap();
    let expected = common::ids(&golden["input_ids"]);
    assert_eq!(tok.encode(prompt, true).unwrap(), expected);
    assert_eq!(tok.decode(&expected, false).unwrap(), prompt);
    assert_eq!(tok.vocab_size(), 512);
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
}

#[test]
fn special_ids_are_set_by_caller() {
    let mut tok = common::golden_tokenizer().clone();
    assert_eq!((tok.bos_id(), tok.eos_ids()), (None, &[][..]));
    tok.set_special(None, vec![0, 2]);
    assert_eq!(tok.eos_ids(), &[0, 2]);
    assert_eq!(
        tok.encode("x", true).unwrap(),
        tok.encode("x", false).unwrap()
    );
}

#[test]
fn config_without_template_is_none() {
    let t = ChatTemplate::from_tokenizer_config(&common::fixture(
        "golden/llama-gqa/tokenizer_config.json",
    ))
    .unwrap();
    assert!(t.is_none());
}

#[test]
fn load_errors_name_the_path() {
    let err =
        Tokenizer::from_file(std::path::Path::new("/nonexistent/tokenizer.json")).unwrap_err();
    assert!(matches!(err, TokenizerError::Load { .. }));
    assert!(
        err.to_string().contains("/nonexistent/tokenizer.json"),
        "{err}"
    );
}
