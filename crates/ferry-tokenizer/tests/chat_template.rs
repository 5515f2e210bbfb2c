//! Chat templates render like `transformers`' `apply_chat_template`.

mod common;

use std::path::PathBuf;

use ferry_tokenizer::{ChatMessage, ChatTemplate, Role, TokenizerError};

fn conversation() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new(Role::System, "You are terse."),
        ChatMessage::new(Role::User, "Hi there"),
    ]
}

#[test]
fn smollm2_chatml() {
    let tok = common::smollm2_tokenizer();
    let t = ChatTemplate::from_gguf(common::smollm2(), tok)
        .unwrap()
        .unwrap();
    let expected =
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n";
    assert_eq!(t.render(&conversation(), false).unwrap(), expected);
    assert_eq!(
        t.render(&conversation(), true).unwrap(),
        format!("{expected}<|im_start|>assistant\n")
    );
    // Without a system message the template supplies SmolLM's default one.
    let no_system = t.render(&[ChatMessage::new(Role::User, "Hi")], true).unwrap();
    assert_eq!(
        no_system,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn python_methods_tokens_and_block_trimming() {
    let source = "{{ bos_token }}\n{% for m in messages %}\n  {% if m.role.startswith('sys') %}\n[{{ m.content.strip().upper() }}]\n  {% else %}\n{{ m['content'] }}{{ eos_token }}\n  {% endif %}\n{% endfor %}\n";
    let t = ChatTemplate::new(source, "<s>", "</s>").unwrap();
    let messages = [
        ChatMessage::new(Role::System, "  be brief "),
        ChatMessage::new(Role::User, "hello"),
    ];
    assert_eq!(
        t.render(&messages, false).unwrap(),
        "<s>\n[BE BRIEF]\nhello</s>\n"
    );
}

#[test]
fn raise_exception_is_a_render_error() {
    let t = ChatTemplate::new(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok",
        "",
        "",
    )
    .unwrap();
    assert_eq!(
        t.render(&[ChatMessage::new(Role::User, "x")], false).unwrap(),
        "ok"
    );
    let err = t.render(&conversation(), false).unwrap_err();
    assert!(matches!(err, TokenizerError::TemplateRender(_)));
    assert!(
        err.to_string()
            .contains("Conversation must start with user"),
        "{err}"
    );
}

#[test]
fn syntax_errors_are_reported() {
    assert!(matches!(
        ChatTemplate::new("{% for %}", "", ""),
        Err(TokenizerError::TemplateSyntax(_))
    ));
}

/// A scratch directory unique to this test binary and test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferry-tok-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn tokenizer_config_forms() {
    let dir = scratch("config");
    let path = dir.join("tokenizer_config.json");
    let chatml = "{% for m in messages %}{{ bos_token }}{{ m.role }}:{{ m.content }}{{ eos_token }}{% endfor %}";
    let one = [ChatMessage::new(Role::User, "hi")];

    let plain = serde_json::json!({ "chat_template": chatml, "bos_token": "<s>", "eos_token": { "content": "</s>", "lstrip": false } });
    std::fs::write(&path, plain.to_string()).unwrap();
    let t = ChatTemplate::from_tokenizer_config(&path).unwrap().unwrap();
    assert_eq!(t.render(&one, false).unwrap(), "<s>user:hi</s>");

    let named = serde_json::json!({
        "chat_template": [ { "name": "tool_use", "template": "tools" }, { "name": "default", "template": chatml } ],
        "bos_token": null, "eos_token": "E",
    });
    std::fs::write(&path, named.to_string()).unwrap();
    let t = ChatTemplate::from_tokenizer_config(&path).unwrap().unwrap();
    assert_eq!(t.render(&one, false).unwrap(), "user:hiE");

    let no_default =
        serde_json::json!({ "chat_template": [ { "name": "tool_use", "template": "tools" } ] });
    std::fs::write(&path, no_default.to_string()).unwrap();
    assert!(matches!(
        ChatTemplate::from_tokenizer_config(&path),
        Err(TokenizerError::Config { .. })
    ));

    // No key: a sibling chat_template.jinja is used when present.
    std::fs::write(&path, "{}").unwrap();
    assert!(
        ChatTemplate::from_tokenizer_config(&path)
            .unwrap()
            .is_none()
    );
    std::fs::write(dir.join("chat_template.jinja"), "J{{ messages|length }}").unwrap();
    let t = ChatTemplate::from_tokenizer_config(&path).unwrap().unwrap();
    assert_eq!(t.render(&one, false).unwrap(), "J1");

    std::fs::write(&path, "not json").unwrap();
    assert!(matches!(
        ChatTemplate::from_tokenizer_config(&path),
        Err(TokenizerError::Config { .. })
    ));
    assert!(matches!(
        ChatTemplate::from_tokenizer_config(&dir.join("missing.json")),
        Err(TokenizerError::Io { .. })
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}
