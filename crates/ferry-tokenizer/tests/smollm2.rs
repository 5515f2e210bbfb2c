//! The tokenizer and chat template rebuilt from the SmolLM2 GGUF reproduce the reference ids in
//! `tests/fixtures/smollm2/golden.json` (llama.cpp's tokenizer, equal to HF `tokenizers`).

mod common;

use ferry_tokenizer::{ChatMessage, ChatTemplate, Role};

#[test]
fn special_ids_and_vocab() {
    let tok = common::smollm2_tokenizer();
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_ids(), &[2]);
    assert_eq!(tok.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(tok.id_to_token(2).as_deref(), Some("<|im_end|>"));
    assert_eq!(tok.id_to_token(0).as_deref(), Some("<|endoftext|>"));
    assert!(tok.is_special(1) && !tok.is_special(19556));
    assert_eq!(tok.id_to_token(49152), None);
    assert!(matches!(
        tok.decode(&[5, 49152], false),
        Err(ferry_tokenizer::TokenizerError::UnknownId { id: 49152, .. })
    ));
}

#[test]
fn golden_tokenization() {
    let tok = common::smollm2_tokenizer();
    let golden = common::read_json("smollm2/golden.json");
    let entries = golden["tokenization"]
        .as_array()
        .expect("tokenization list");
    assert!(!entries.is_empty());
    for e in entries {
        let text = e["text"].as_str().expect("text");
        let expected = common::ids(&e["ids"]);
        assert_eq!(
            tok.encode(text, true).unwrap(),
            expected,
            "encode {text:?} (with special tokens)"
        );
        assert_eq!(
            tok.encode(text, false).unwrap(),
            expected,
            "encode {text:?}"
        );
        assert_eq!(common::ids(&e["hf_ids"]), expected);
        assert_eq!(
            tok.decode(&expected, false).unwrap(),
            text,
            "decode {expected:?}"
        );
    }
}

/// SmolLM2's GGUF says `add_bos_token = false`: no BOS is prepended, even with special tokens.
#[test]
fn no_bos_prepended() {
    let tok = common::smollm2_tokenizer();
    assert!(
        !common::smollm2()
            .get_bool("tokenizer.ggml.add_bos_token")
            .unwrap()
    );
    assert_eq!(
        tok.encode("Hello", true).unwrap(),
        tok.encode("Hello", false).unwrap()
    );
    assert_eq!(tok.encode("Hello", true).unwrap(), vec![19556]);
}

#[test]
fn golden_cases() {
    let tok = common::smollm2_tokenizer();
    let template = ChatTemplate::from_gguf(common::smollm2(), tok)
        .unwrap()
        .expect("GGUF has a chat template");
    let golden = common::read_json("smollm2/golden.json");

    let capital = &golden["cases"]["capital"];
    let messages = [
        ChatMessage::new(
            Role::System,
            "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
        ),
        ChatMessage::new(Role::User, "What is the capital of France?"),
    ];
    let prompt = template.render(&messages, true).unwrap();
    assert_eq!(prompt, capital["text"].as_str().unwrap());
    assert_eq!(
        tok.encode(&prompt, true).unwrap(),
        common::ids(&capital["input_ids"])
    );

    let story = &golden["cases"]["story"];
    let text = story["text"].as_str().unwrap();
    assert_eq!(
        tok.encode(text, true).unwrap(),
        common::ids(&story["input_ids"])
    );
    // The reference continuation decodes to the reference text.
    assert_eq!(
        tok.decode(&common::ids(&story["hf_greedy_ids"]), false)
            .unwrap(),
        story["hf_greedy_text"].as_str().unwrap()
    );
}

#[test]
fn skip_special_tokens() {
    let tok = common::smollm2_tokenizer();
    let ids = tok.encode("<|im_start|>user\nhi<|im_end|>", false).unwrap();
    assert_eq!(tok.decode(&ids, true).unwrap(), "user\nhi");
}
