use serde_json::json;

use super::*;
use crate::tools::calls::IdCall;
use crate::tools::scan::Call;

fn head() -> Head {
    let mut echo = Map::new();
    echo.insert("store".into(), json!(false));
    Head { id: "resp_ab12".into(), created_at: 99, model: "m".into(), echo }
}

fn fin(reason: v1::FinishReason) -> v1::GenerateFinal {
    v1::GenerateFinal { finish_reason: reason as i32, prompt_tokens: 7, completion_tokens: 3, cached_tokens: 4, ..Default::default() }
}

/// What the scanner says of call `index` (id `call_<id>`) whose arguments arrive in `pieces`.
fn call(index: usize, id: &str, pieces: &[&str]) -> Vec<Said> {
    let id = format!("call_{id}");
    let mut said = vec![Said::Open { index, id: id.clone(), name: "get_weather".into() }];
    said.extend(pieces.iter().map(|p| Said::Args { index, text: (*p).into() }));
    let call = IdCall { id, call: Call { name: "get_weather".into(), arguments: pieces.concat() } };
    said.push(Said::Close { index, call });
    said
}

fn say(ev: &mut Events, said: Vec<Said>) -> Vec<Value> {
    said.into_iter().flat_map(|s| ev.said(s)).collect()
}

fn types(events: &[Value]) -> Vec<&str> {
    events.iter().map(|e| e["type"].as_str().unwrap_or("?")).collect()
}

/// Replays `events` as the `openai` client's stream accumulator does: the items added, their
/// text and argument deltas.
fn replay(events: &[Value]) -> Vec<Value> {
    let mut output: Vec<Value> = Vec::new();
    for e in events {
        let i = e["output_index"].as_u64().unwrap_or(0) as usize;
        match e["type"].as_str().unwrap_or("") {
            "response.output_item.added" => output.push(e["item"].clone()),
            "response.content_part.added" => {
                if let Some(Value::Array(c)) = output[i].get_mut("content") {
                    c.push(e["part"].clone());
                }
            }
            "response.output_text.delta" => {
                let t = output[i]["content"][0]["text"].as_str().unwrap_or("").to_owned();
                output[i]["content"][0]["text"] = json!(t + e["delta"].as_str().unwrap_or(""));
            }
            "response.function_call_arguments.delta" => {
                let a = output[i]["arguments"].as_str().unwrap_or("").to_owned();
                output[i]["arguments"] = json!(a + e["delta"].as_str().unwrap_or(""));
            }
            "response.output_item.done" => output[i] = e["item"].clone(),
            _ => {}
        }
    }
    output
}

#[test]
fn a_text_answer_streams_in_openais_order_and_adds_up() {
    let mut ev = Events::new(head());
    let mut all = ev.start();
    assert_eq!(all[0]["response"]["status"], "in_progress");
    assert_eq!(all[0]["response"]["output"], json!([]));
    all.extend(ev.said(Said::Text("Hel".into())));
    all.extend(ev.said(Said::Text(String::new())));
    all.extend(ev.said(Said::Text("lo".into())));
    all.extend(ev.finish(&fin(v1::FinishReason::StopToken)));
    assert_eq!(
        types(&all),
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    for (n, e) in all.iter().enumerate() {
        assert_eq!(e["sequence_number"], n as u64, "{e}");
    }
    let done = &all[6];
    assert_eq!((done["text"].as_str(), done["item_id"].as_str(), done["content_index"].as_u64()), (Some("Hello"), Some("msg_ab12_0"), Some(0)));
    let r = ev.response();
    assert_eq!(r, all[9]["response"]);
    assert_eq!((r["id"].as_str(), r["object"].as_str(), r["status"].as_str(), r["created_at"].as_u64()), (Some("resp_ab12"), Some("response"), Some("completed"), Some(99)));
    assert_eq!(
        r["output"],
        json!([{"type": "message", "id": "msg_ab12_0", "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}]}])
    );
    assert_eq!(
        r["usage"],
        json!({"input_tokens": 7, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 10})
    );
    assert_eq!((r["store"].as_bool(), r["incomplete_details"].clone(), r["error"].clone()), (Some(false), Value::Null, Value::Null));
    assert_eq!(replay(&all), r["output"].as_array().cloned().unwrap_or_default());
}

#[test]
fn calls_follow_the_message_and_add_up() {
    let mut ev = Events::new(head());
    let mut all = ev.start();
    all.extend(ev.said(Said::Text("Let me check.".into())));
    all.extend(say(&mut ev, call(0, "x1", &["{\"city\":", "\"Paris\"}"])));
    all.extend(say(&mut ev, call(1, "x2", &["{}"])));
    all.extend(ev.finish(&fin(v1::FinishReason::StopToken)));
    assert_eq!(
        types(&all)[2..],
        [
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    let added = &all[8];
    assert_eq!(added["item"], json!({"type": "function_call", "id": "fc_x1", "call_id": "call_x1", "name": "get_weather", "arguments": "", "status": "in_progress"}));
    assert_eq!((all[9]["item_id"].as_str(), all[9]["output_index"].as_u64(), all[9]["delta"].as_str()), (Some("fc_x1"), Some(1), Some("{\"city\":")));
    assert_eq!(all[10]["delta"], "\"Paris\"}");
    assert_eq!((all[11]["arguments"].as_str(), all[11]["name"].as_str()), (Some("{\"city\":\"Paris\"}"), Some("get_weather")));
    let r = ev.response();
    assert_eq!(r["output"][1], json!({"type": "function_call", "id": "fc_x1", "call_id": "call_x1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}", "status": "completed"}));
    assert_eq!(r["output"][2]["call_id"], "call_x2");
    assert_eq!(replay(&all), r["output"].as_array().cloned().unwrap_or_default());
}

#[test]
fn cut_short_empty_and_failed_answers() {
    // A length limit: incomplete, the message too.
    let mut ev = Events::new(head());
    ev.said(Said::Text("Hm".into()));
    let end = ev.finish(&fin(v1::FinishReason::Length));
    assert_eq!(types(&end).last().copied(), Some("response.incomplete"));
    let r = ev.response();
    assert_eq!((r["status"].as_str(), r["incomplete_details"].clone()), (Some("incomplete"), json!({"reason": "max_output_tokens"})));
    assert_eq!(r["output"][0]["status"], "incomplete");
    // Only calls: no message item.
    let mut ev = Events::new(head());
    say(&mut ev, call(0, "y", &["{}"]));
    ev.finish(&fin(v1::FinishReason::StopToken));
    assert_eq!(ev.response()["output"].as_array().map(Vec::len), Some(1));
    // Nothing said: one empty message.
    let mut ev = Events::new(head());
    let end = ev.finish(&fin(v1::FinishReason::StopToken));
    assert_eq!(types(&end)[0], "response.output_item.added");
    assert_eq!(ev.response()["output"][0]["content"][0]["text"], "");
    // An error: `error`, then `response.failed` with it.
    let mut ev = Events::new(head());
    ev.start();
    ev.said(Said::Text("a".into()));
    let end = ev.fail(&ApiError::server("worker lost"));
    assert_eq!(types(&end), ["error", "response.failed"]);
    assert_eq!((end[0]["code"].as_str(), end[0]["message"].as_str(), end[0]["sequence_number"].as_u64()), (Some("server_error"), Some("worker lost"), Some(5)));
    assert_eq!(end[1]["response"]["error"], json!({"code": "server_error", "message": "worker lost"}));
    assert_eq!(end[1]["response"]["status"], "failed");
}

#[test]
fn the_wire_names_each_event() {
    assert_eq!(sse(&json!({"type": "response.created", "sequence_number": 0})), "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0}\n\n");
}

#[test]
fn text_after_a_call_is_a_new_message_and_stray_pieces_are_no_panic() {
    let mut ev = Events::new(head());
    let mut all = say(&mut ev, call(0, "z", &["{}"]));
    all.extend(ev.said(Said::Text("Done.".into())));
    all.extend(ev.finish(&fin(v1::FinishReason::StopToken)));
    let r = ev.response();
    let kinds: Vec<&str> = r["output"].as_array().into_iter().flatten().map(|o| o["type"].as_str().unwrap_or("?")).collect();
    assert_eq!(kinds, ["function_call", "message"]);
    assert_eq!((r["output"][1]["id"].as_str(), r["output"][1]["content"][0]["text"].as_str()), (Some("msg_ab12_1"), Some("Done.")));
    assert_eq!(replay(&all), r["output"].as_array().cloned().unwrap_or_default());
    // Arguments or a close with no call open (a scanner that changed under us): no events.
    let mut ev = Events::new(head());
    assert!(ev.said(Said::Args { index: 0, text: "{}".into() }).is_empty());
    ev.said(Said::Text("a".into()));
    assert!(ev.said(Said::Args { index: 0, text: "{}".into() }).is_empty());
    let close = Said::Close { index: 0, call: IdCall { id: "call_q".into(), call: Call { name: "f".into(), arguments: "{}".into() } } };
    assert!(ev.said(close).is_empty());
}
