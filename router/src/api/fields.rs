//! Every request field of the OpenAI-compatible generation endpoints and what the router does
//! with it: applied, metadata that by its definition changes nothing, accepted only at its
//! default, or refused. A field in neither OpenAI's schema nor vLLM's documented extra
//! parameters gets OpenAI's own answer (400, unrecognized argument). Nothing is accepted and
//! ignored. `docs/api.md` lists the same tables; a test keeps the two equal.

use serde_json::{Map, Value};

use super::error::ApiError;

/// What the router does with a field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Use {
    /// Read and applied to the generation or the response.
    Honoured,
    /// Describes the caller or the request (e.g. `user`); it changes no output by its
    /// definition, so it is accepted.
    Metadata,
    /// Accepted only at the listed values (JSON), its default; any other value is refused.
    OnlyAt(&'static [&'static str], &'static str),
    /// Refused whenever given (null counts as not given).
    Refused(&'static str),
}

/// One request field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    pub name: &'static str,
    pub how: Use,
}

const fn f(name: &'static str, how: Use) -> Field {
    Field { name, how }
}

use Use::{Honoured, Metadata, OnlyAt, Refused};

const NO_BEAM: &str = "beam search is not implemented";
const NO_PROMPT_LOGPROBS: &str = "vLLM's form of prompt log-probabilities is not implemented; on /v1/completions, `echo` with \
     `logprobs` lists them";
const TOKEN_FILTERS: &str = "token allow/deny lists are not implemented";
const NOT_SERVED: &str = "this server does not offer it";
const TEMPLATE: &str = "prompts are encoded with DeepSeek-V4's official encoder only";
const TEXT_ONLY: &str = "this model reads and writes text only";

/// vLLM's extra parameters shared by both endpoints (sampling and output options).
const VLLM_SHARED: &[Field] = &[
    f("top_k", Honoured),
    f("min_p", Honoured),
    f("repetition_penalty", Honoured),
    f("ignore_eos", Honoured),
    f("min_tokens", Honoured),
    f("stop_token_ids", Honoured),
    f("best_of", Honoured),
    f("use_beam_search", OnlyAt(&["false"], NO_BEAM)),
    f("length_penalty", OnlyAt(&["1", "1.0"], NO_BEAM)),
    f(
        "include_stop_str_in_output",
        OnlyAt(&["false"], "stop strings are cut from the output"),
    ),
    f(
        "spaces_between_special_tokens",
        OnlyAt(&["true"], "the official decoder's spacing is used"),
    ),
    f(
        "truncate_prompt_tokens",
        Refused("prompts are never truncated; a long prompt is refused"),
    ),
    f("prompt_logprobs", Refused(NO_PROMPT_LOGPROBS)),
    f("allowed_token_ids", Refused(TOKEN_FILTERS)),
    f("bad_words", Refused(TOKEN_FILTERS)),
    f("guided_json", Honoured),
    f("guided_regex", Honoured),
    f("guided_choice", Honoured),
    f("guided_grammar", Honoured),
    f(
        "guided_decoding_backend",
        OnlyAt(
            &[r#""auto""#, r#""guidance""#, r#""llguidance""#],
            "the grammar engine is llguidance",
        ),
    ),
    f(
        "guided_whitespace_pattern",
        Refused("JSON is written compact; a whitespace pattern is not supported"),
    ),
    f(
        "structural_tag",
        Refused("structural tags are not supported; use a Lark grammar (`guided_grammar`)"),
    ),
    f("structured_outputs", Honoured),
    f("priority", OnlyAt(&["0"], "requests have no priorities")),
    // vLLM takes it as the request's id; here the id comes before the body is read (the
    // header names the request's log span and its response), so the body's would be ignored.
    f(
        "request_id",
        Refused(
            "send the request's id as the X-Request-Id header (carried to the workers, the logs and the response id)",
        ),
    ),
    f("logits_processors", Refused(NOT_SERVED)),
    f("return_tokens_as_token_ids", Refused(NOT_SERVED)),
    f("cache_salt", Refused(NOT_SERVED)),
    f("kv_transfer_params", Refused(NOT_SERVED)),
    f("vllm_xargs", Refused(NOT_SERVED)),
];

/// Fields both endpoints take, with the same meaning.
const OPENAI_SHARED: &[Field] = &[
    f("model", Honoured),
    f("max_tokens", Honoured),
    f("temperature", Honoured),
    f("top_p", Honoured),
    f("seed", Honoured),
    f("stop", Honoured),
    f("stream", Honoured),
    f("stream_options", Honoured),
    f("presence_penalty", Honoured),
    f("frequency_penalty", Honoured),
    f("logit_bias", Honoured),
    f("n", Honoured),
    f("user", Metadata),
    f("response_format", Honoured),
];

/// `POST /v1/chat/completions`: its own OpenAI fields, then the chat-only vLLM extras.
pub const CHAT: &[Field] = &[
    f("messages", Honoured),
    f(
        "echo",
        OnlyAt(&["false"], "echoing the last message is not implemented"),
    ),
    f("max_completion_tokens", Honoured),
    f("logprobs", Honoured),
    f("top_logprobs", Honoured),
    f("tools", Honoured),
    f("tool_choice", Honoured),
    f("parallel_tool_calls", Honoured),
    f("reasoning_effort", Honoured),
    f("thinking", Honoured),
    f("metadata", Metadata),
    f("safety_identifier", Metadata),
    f("prompt_cache_key", Metadata),
    f(
        "service_tier",
        OnlyAt(&[r#""auto""#, r#""default""#], "one service tier"),
    ),
    f(
        "store",
        OnlyAt(&["false"], "completions are not stored for later retrieval"),
    ),
    f("modalities", OnlyAt(&[r#"["text"]"#], TEXT_ONLY)),
    f("audio", Refused(TEXT_ONLY)),
    f(
        "prediction",
        Refused("predicted outputs are not implemented"),
    ),
    f("web_search_options", Refused(NOT_SERVED)),
    f("verbosity", Refused(NOT_SERVED)),
    f("functions", Refused("deprecated by OpenAI: use `tools`")),
    f(
        "function_call",
        Refused("deprecated by OpenAI: use `tool_choice`"),
    ),
    f("return_token_ids", Honoured),
    f("chat_template_kwargs", Honoured),
    f("chat_template", Refused(TEMPLATE)),
    f("add_generation_prompt", OnlyAt(&["true"], TEMPLATE)),
    f("continue_final_message", OnlyAt(&["false"], TEMPLATE)),
    f("add_special_tokens", OnlyAt(&["false"], TEMPLATE)),
    f("documents", Refused(TEMPLATE)),
    f("mm_processor_kwargs", Refused(TEXT_ONLY)),
    f(
        "skip_special_tokens",
        OnlyAt(
            &["true"],
            "the message is written by DeepSeek's official output parser, which reads special \
             tokens as its structure",
        ),
    ),
];

/// `POST /v1/completions`: its own OpenAI fields, then the completions-only vLLM extras.
pub const COMPLETIONS: &[Field] = &[
    f("prompt", Honoured),
    f("logprobs", Honoured),
    f("echo", Honoured),
    f("return_token_ids", Honoured),
    f(
        "suffix",
        Refused("insertion (`suffix`) is not supported by this model"),
    ),
    f("add_special_tokens", OnlyAt(&["true"], TEMPLATE)),
    f("prompt_embeds", Refused(NOT_SERVED)),
    f("skip_special_tokens", Honoured),
];

/// `POST /v1/messages` (Anthropic's Messages schema; vLLM's extras are not part of it).
pub const MESSAGES: &[Field] = &[
    f("model", Honoured),
    f("messages", Honoured),
    f("max_tokens", Honoured),
    f("system", Honoured),
    f("temperature", Honoured),
    f("top_p", Honoured),
    f("top_k", Honoured),
    f("stop_sequences", Honoured),
    f("stream", Honoured),
    f("tools", Honoured),
    f("tool_choice", Honoured),
    f("thinking", Honoured),
    f("output_config", Honoured),
    f("metadata", Metadata),
    f(
        "service_tier",
        OnlyAt(&[r#""auto""#, r#""standard_only""#], "one service tier"),
    ),
    f("container", Refused(NOT_SERVED)),
    f("mcp_servers", Refused(NOT_SERVED)),
    f(
        "context_management",
        Refused("server-side context editing is not implemented"),
    ),
];

/// `POST /v1/responses` (OpenAI's Responses schema).
pub const RESPONSES: &[Field] = &[
    f("model", Honoured),
    f("input", Honoured),
    f("instructions", Honoured),
    f("max_output_tokens", Honoured),
    f("temperature", Honoured),
    f("top_p", Honoured),
    f("top_logprobs", Honoured),
    f("stream", Honoured),
    f("text", Honoured),
    f("reasoning", Honoured),
    f("tools", Honoured),
    f("tool_choice", Honoured),
    f("parallel_tool_calls", Honoured),
    f("user", Metadata),
    f("metadata", Metadata),
    f("safety_identifier", Metadata),
    f("prompt_cache_key", Metadata),
    f(
        "service_tier",
        OnlyAt(&[r#""auto""#, r#""default""#], "one service tier"),
    ),
    f(
        "store",
        OnlyAt(&["false"], "responses are not stored for later retrieval"),
    ),
    f(
        "background",
        OnlyAt(&["false"], "background responses are not implemented"),
    ),
    f(
        "truncation",
        OnlyAt(
            &[r#""disabled""#],
            "an input longer than the context is refused, never truncated",
        ),
    ),
    f(
        "include",
        OnlyAt(&["[]"], "no extra output fields are available"),
    ),
    f(
        "previous_response_id",
        Refused("responses are not stored; send the whole conversation"),
    ),
    f(
        "conversation",
        Refused("conversations are not stored; send the whole conversation"),
    ),
    f("prompt", Refused("stored prompt templates are not offered")),
    f("max_tool_calls", Refused(NOT_SERVED)),
    f("stream_options", Refused(NOT_SERVED)),
];

/// The fields of an endpoint, table by table.
pub type Tables = &'static [&'static [Field]];

/// Chat completions: the shared OpenAI fields, its own, then vLLM's shared extras.
pub const CHAT_FIELDS: Tables = &[OPENAI_SHARED, CHAT, VLLM_SHARED];
/// Completions: the shared OpenAI fields, its own, then vLLM's shared extras.
pub const COMPLETIONS_FIELDS: Tables = &[OPENAI_SHARED, COMPLETIONS, VLLM_SHARED];
pub const MESSAGES_FIELDS: Tables = &[MESSAGES];
pub const RESPONSES_FIELDS: Tables = &[RESPONSES];

/// Every field of an endpoint.
pub fn all(tables: Tables) -> impl Iterator<Item = &'static Field> {
    tables.iter().flat_map(|t| t.iter())
}

/// Refuses what `obj` carries that the endpoint does not honour: an unknown field with
/// OpenAI's own message, a refused one, or one accepted only at its default with another value.
pub fn check(obj: &Map<String, Value>, own: Tables) -> Result<(), ApiError> {
    for (key, value) in obj {
        let Some(field) = all(own).find(|f| f.name == key) else {
            return Err(ApiError::param(
                key.clone(),
                format!("Unrecognized request argument supplied: {key}"),
            ));
        };
        if value.is_null() {
            continue;
        }
        match field.how {
            Honoured | Metadata => {}
            Refused(why) => {
                return Err(ApiError::param(
                    key.clone(),
                    format!("`{key}` is not supported: {why}"),
                ));
            }
            OnlyAt(accepted, why) => {
                let ok = accepted
                    .iter()
                    .any(|a| serde_json::from_str::<Value>(a).is_ok_and(|a| &a == value));
                if !ok {
                    return Err(ApiError::param(
                        key.clone(),
                        format!(
                            "`{key}` = {value} is not supported ({why}); accepted: {}",
                            accepted.join(", ")
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// The table of an endpoint as `docs/api.md` writes it: `| field | status | note |` rows.
pub fn doc_rows(own: Tables) -> Vec<String> {
    all(own)
        .map(|field| {
            let (status, note) = match field.how {
                Honoured => ("honoured", String::new()),
                Metadata => ("metadata", "accepted; changes no output".to_owned()),
                OnlyAt(values, why) => ("default only", format!("{}: {why}", values.join(", "))),
                Refused(why) => ("refused", why.to_owned()),
            };
            format!("| `{}` | {status} | {note} |", field.name)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => unreachable!("an object"),
        }
    }

    #[test]
    fn unknown_refused_and_default_only_fields_are_400_naming_the_field() {
        let ok = obj(
            json!({"model": "m", "messages": [], "n": 1, "user": "u", "store": false,
            "top_k": 5, "response_format": {"type": "text"}, "best_of": null}),
        );
        assert!(check(&ok, CHAT_FIELDS).is_ok());
        for (body, param, says) in [
            (
                json!({"frobnicate_level": 3}),
                "frobnicate_level",
                "Unrecognized request argument supplied: frobnicate_level",
            ),
            (
                json!({"guided_decoding_backend": "xgrammar"}),
                "guided_decoding_backend",
                "llguidance",
            ),
            (
                json!({"structural_tag": {}}),
                "structural_tag",
                "Lark grammar",
            ),
            (json!({"audio": {"voice": "x"}}), "audio", "text only"),
            (json!({"store": true}), "store", "not stored"),
        ] {
            let e = check(&obj(body.clone()), CHAT_FIELDS).unwrap_err();
            let (status, _, got_param, _) = e.parts();
            assert_eq!(status, axum::http::StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(got_param, Some(param), "{body}");
            assert!(e.to_string().contains(says), "{body}: {e}");
        }
        assert!(check(&obj(json!({"messages": []})), COMPLETIONS_FIELDS).is_err());
        assert!(
            check(
                &obj(json!({"prompt": "x", "ignore_eos": true})),
                COMPLETIONS_FIELDS
            )
            .is_ok()
        );
    }

    #[test]
    fn no_field_is_listed_twice_and_default_values_parse() {
        for own in [
            CHAT_FIELDS,
            COMPLETIONS_FIELDS,
            MESSAGES_FIELDS,
            RESPONSES_FIELDS,
        ] {
            let mut names: Vec<&str> = all(own).map(|f| f.name).collect();
            let n = names.len();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), n, "a field is listed twice");
            for field in all(own) {
                if let OnlyAt(values, _) = field.how {
                    for v in values {
                        assert!(
                            serde_json::from_str::<Value>(v).is_ok(),
                            "{}: {v}",
                            field.name
                        );
                    }
                }
            }
        }
    }

    /// docs/api.md holds exactly these tables, so the doc and the code cannot drift.
    #[test]
    fn the_api_doc_lists_every_field_as_the_code_does() {
        let doc = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/api.md"),
        )
        .unwrap_or_default();
        for (heading, own) in [
            ("### `POST /v1/chat/completions`", CHAT_FIELDS),
            ("### `POST /v1/completions`", COMPLETIONS_FIELDS),
            ("### `POST /v1/messages`", MESSAGES_FIELDS),
            ("### `POST /v1/responses`", RESPONSES_FIELDS),
        ] {
            let section = doc
                .split(heading)
                .nth(1)
                .and_then(|rest| rest.split("\n### ").next())
                .unwrap_or_default();
            let rows: Vec<&str> = section.lines().filter(|l| l.starts_with("| `")).collect();
            assert_eq!(rows, doc_rows(own), "docs/api.md section {heading}");
        }
    }
}
