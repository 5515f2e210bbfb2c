//! `ModelText::open` on the default model tokenizes exactly as the engine does.

mod common;

use ferry_tokenizer::{ChatMessage, ModelText, Role};

#[test]
fn model_text_matches_engine() {
    let path = common::smollm2_gguf();
    let text = ModelText::open(&path).expect("open model text");
    let engine = ferry_engine::Engine::load(&path, &Default::default()).expect("load engine");
    assert_eq!(text.add_special_tokens, engine.add_special_tokens);
    assert_eq!(text.eos_ids, vec![2]);
    assert!(!text.name.is_empty());
    for s in ["Hello, world!", "The capital of France is", "  héllo 世界\n\nok"] {
        assert_eq!(text.encode_prompt(s).unwrap(), engine.encode(s).unwrap(), "{s:?}");
    }
    let msgs = [ChatMessage::new(Role::User, "What is 2+2?")];
    let a = text.chat_template.as_ref().unwrap().render(&msgs, true).unwrap();
    let b = engine.chat_template.as_ref().unwrap().render(&msgs, true).unwrap();
    assert_eq!(a, b);
}
