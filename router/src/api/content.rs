//! What the served model cannot read is refused: DeepSeek's converter writes an image, a file
//! or a document as a placeholder text (`[Unsupported Image]`) for V4, so the model would
//! answer about a picture it never saw. And OpenAI's Responses tools and input items that the
//! converter would skip without a word.

use serde_json::{Map, Value};

use super::error::ApiError;

/// Content block types that carry something other than text: chat's `image_url`, `file` and
/// `input_audio`, Messages' `image` and `document`, Responses' `input_image`, `input_file`
/// and `input_audio`, vLLM's `video_url` and `audio_url`.
const NOT_TEXT: &[&str] = &[
    "image_url",
    "file",
    "input_audio",
    "image",
    "document",
    "input_image",
    "input_file",
    "video_url",
    "audio_url",
];

/// Refuses a block of a type other than text (`NOT_TEXT`) anywhere in the request's `input`
/// (`messages`, or Responses' `input`): in a message's content, in a tool result's content,
/// in a Responses item's content or output. 400 naming the block's place.
pub fn refuse_unreadable(obj: &Map<String, Value>, input: &str) -> Result<(), ApiError> {
    match obj.get(input) {
        Some(value) => walk(value, input),
        None => Ok(()),
    }
}

/// Looks at the blocks of `value` (at `path`), through arrays and the `content` and `output`
/// of objects only: a tool call's arguments are the caller's data, not content.
fn walk(value: &Value, path: &str) -> Result<(), ApiError> {
    match value {
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                walk(item, &format!("{path}[{i}]"))?;
            }
            Ok(())
        }
        Value::Object(block) => {
            if let Some(kind) = block.get("type").and_then(Value::as_str)
                && NOT_TEXT.contains(&kind)
            {
                return Err(ApiError::param(
                    path,
                    format!(
                        "`{path}` is a `{kind}` block: the served model reads text only (it \
                         would otherwise answer without having seen it)"
                    ),
                ));
            }
            for key in ["content", "output"] {
                if let Some(inner) = block.get(key) {
                    walk(inner, &format!("{path}.{key}"))?;
                }
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Responses tool types the converter reads (`web_search` it refuses itself: the router
/// sets it so); any other it would skip.
const RESPONSES_TOOLS: &[&str] = &[
    "function",
    "custom",
    "namespace",
    "tool_search",
    "web_search",
    "web_search_2025_08_26",
];

/// Responses input item types the converter reads; any other it would skip.
const RESPONSES_ITEMS: &[&str] = &[
    "message",
    "function_call",
    "function_call_output",
    "reasoning",
    "custom_tool_call",
    "custom_tool_call_output",
    "tool_search_call",
    "tool_search_output",
    "web_search_call",
];

/// Refuses Responses `tools` and `input` items of types the converter would skip, naming
/// the place and the type.
pub fn refuse_skipped_responses_parts(obj: &Map<String, Value>) -> Result<(), ApiError> {
    let typed = |field: &str, known: &[&str], what: &str| -> Result<(), ApiError> {
        let Some(Value::Array(items)) = obj.get(field) else {
            return Ok(());
        };
        for (i, item) in items.iter().enumerate() {
            if let Some(kind) = item.get("type").and_then(Value::as_str)
                && !known.contains(&kind)
            {
                let path = format!("{field}[{i}]");
                return Err(ApiError::param(
                    path.clone(),
                    format!(
                        "`{path}` is a `{kind}` {what}, which is not supported (supported: {})",
                        known.join(", ")
                    ),
                ));
            }
        }
        Ok(())
    };
    typed("tools", RESPONSES_TOOLS, "tool")?;
    typed("input", RESPONSES_ITEMS, "input item")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test code")]

    use serde_json::json;

    use super::*;

    fn object(v: &Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    fn param(e: &ApiError) -> String {
        match e {
            ApiError::InvalidParam { param, .. } => param.clone(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn images_files_and_documents_are_refused_where_they_stand() {
        let chat = json!({"messages": [
            {"role": "user", "content": "hi"},
            {"role": "user", "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "https://x/y.png"}}
            ]}
        ]});
        let e = refuse_unreadable(&object(&chat), "messages").unwrap_err();
        assert_eq!(param(&e), "messages[1].content[1]");
        assert!(e.to_string().contains("`image_url`"), "{e}");
        // A tool result's image (Messages).
        let messages = json!({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [
                {"type": "text", "text": "ok"},
                {"type": "image", "source": {"type": "url", "url": "https://x"}}
            ]}
        ]}]});
        let e = refuse_unreadable(&object(&messages), "messages").unwrap_err();
        assert_eq!(param(&e), "messages[0].content[0].content[1]");
        // A Responses file, and an output's image.
        let responses = json!({"input": [
            {"type": "function_call_output", "call_id": "c", "output": [
                {"type": "input_image", "image_url": "https://x"}
            ]}
        ]});
        let e = refuse_unreadable(&object(&responses), "input").unwrap_err();
        assert_eq!(param(&e), "input[0].output[0]");
        // Text, strings, and a tool call's arguments that happen to say `image` pass.
        let fine = json!({"messages": [
            {"role": "user", "content": [{"type": "text", "text": "image_url"}]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "t", "name": "f", "input": {"type": "image"}}
            ]}
        ]});
        refuse_unreadable(&object(&fine), "messages").unwrap();
        refuse_unreadable(&object(&json!({"input": "a string"})), "input").unwrap();
    }

    #[test]
    fn responses_tools_and_items_the_converter_skips_are_refused() {
        let tools = json!({"input": "hi", "tools": [
            {"type": "function", "name": "f", "parameters": {}},
            {"type": "file_search", "vector_store_ids": []}
        ]});
        let e = refuse_skipped_responses_parts(&object(&tools)).unwrap_err();
        assert_eq!(param(&e), "tools[1]");
        assert!(e.to_string().contains("`file_search`"), "{e}");
        let items = json!({"input": [
            {"role": "user", "content": "hi"},
            {"type": "item_reference", "id": "x"}
        ]});
        let e = refuse_skipped_responses_parts(&object(&items)).unwrap_err();
        assert_eq!(param(&e), "input[1]");
        let fine = json!({"input": [{"type": "message", "role": "user", "content": "hi"}],
                          "tools": [{"type": "function", "name": "f"}]});
        refuse_skipped_responses_parts(&object(&fine)).unwrap();
    }
}
