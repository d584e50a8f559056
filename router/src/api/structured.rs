//! Structured outputs: where a request's output constraint comes from and how it reaches the
//! workers. Sources, at most one per request:
//! - `response_format` (`json_object`, `json_schema`, and the converter's `regex`), read by
//!   DeepSeek's official converter on the conversation endpoints and here on /v1/completions;
//! - `tool_choice: "required"` or a named function: V4's own tool-call block (DSML), see
//!   [`super::tool_grammar`];
//! - vLLM's extras: `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (Lark) and
//!   `structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`).
//!
//! The workers compile the grammar (a grammar llguidance cannot compile is a 400 from the
//! prefill worker, naming the construct) and mask every token it does not allow. In thinking
//! mode the constraint starts after the reasoning section ends (`</think>`).

use deepseek_recipe::request::OutputConstraint as Requested;
use engine::sampling::{Grammar, OutputConstraint};
use serde_json::{Map, Value};

use super::error::ApiError;

/// vLLM's extra constraint parameters, each read and removed from `obj`.
const GUIDED: &[&str] = &[
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
];

/// The grammar given by vLLM's extras, if any; more than one is refused. (The field table,
/// checked first, has already refused a `guided_decoding_backend` other than llguidance.)
pub fn guided(obj: &mut Map<String, Value>) -> Result<Option<(Grammar, &'static str)>, ApiError> {
    obj.remove("guided_decoding_backend");
    let mut found: Option<(Grammar, &'static str)> = None;
    for &key in GUIDED {
        let Some(value) = obj.remove(key).filter(|v| !v.is_null()) else {
            continue;
        };
        let grammar = if key == "structured_outputs" {
            structured_outputs(&value)?
        } else {
            one_guided(key, &value)?
        };
        if let Some((_, first)) = &found {
            return Err(ApiError::param(
                key,
                format!("`{first}` and `{key}` both constrain the output; give one of them"),
            ));
        }
        found = Some((grammar, key));
    }
    Ok(found)
}

fn one_guided(key: &'static str, value: &Value) -> Result<Grammar, ApiError> {
    let text = |what: &str| {
        value
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| ApiError::param(key, format!("`{key}` must be {what}")))
    };
    Ok(match key {
        "guided_json" | "json" => match value {
            Value::Object(_) | Value::Bool(_) => Grammar::JsonSchema(value.to_string()),
            // vLLM also takes the schema as JSON text.
            Value::String(s) => {
                let schema: Value = serde_json::from_str(s).map_err(|e| {
                    ApiError::param(key, format!("`{key}` is not a JSON schema: {e}"))
                })?;
                Grammar::JsonSchema(schema.to_string())
            }
            _ => {
                return Err(ApiError::param(
                    key,
                    format!("`{key}` must be a JSON schema (an object)"),
                ));
            }
        },
        "guided_regex" | "regex" => Grammar::Regex(text("a regular expression")?),
        "guided_grammar" | "grammar" => Grammar::Lark(text("a Lark grammar")?),
        "guided_choice" | "choice" => choice(key, value)?,
        _ => return Err(ApiError::param(key, format!("`{key}` is not a constraint"))),
    })
}

/// vLLM's `structured_outputs` object: exactly one of its constraint keys.
fn structured_outputs(value: &Value) -> Result<Grammar, ApiError> {
    const KEY: &str = "structured_outputs";
    let Value::Object(map) = value else {
        return Err(ApiError::param(
            KEY,
            "`structured_outputs` must be an object",
        ));
    };
    let mut grammar = None;
    for (key, v) in map {
        if v.is_null() {
            continue;
        }
        let g = match key.as_str() {
            "json" => one_guided("json", v)?,
            "regex" => one_guided("regex", v)?,
            "choice" => one_guided("choice", v)?,
            "grammar" => one_guided("grammar", v)?,
            "json_object" if v == &Value::Bool(true) => Grammar::JsonObject,
            "json_object" if v == &Value::Bool(false) => continue,
            "disable_any_whitespace" if v == &Value::Bool(true) => continue,
            other => {
                return Err(ApiError::param(
                    format!("{KEY}.{other}"),
                    format!(
                        "`{KEY}.{other}` is not supported: give one of json, regex, choice, \
                         grammar or json_object (whitespace is always compact)"
                    ),
                ));
            }
        };
        if grammar.replace(g).is_some() {
            return Err(ApiError::param(
                KEY,
                "`structured_outputs` holds more than one constraint; give one",
            ));
        }
    }
    grammar.ok_or_else(|| ApiError::param(KEY, "`structured_outputs` holds no constraint"))
}

/// `guided_choice`: one of the listed strings, exactly.
fn choice(key: &'static str, value: &Value) -> Result<Grammar, ApiError> {
    let items = value
        .as_array()
        .filter(|a| !a.is_empty())
        .ok_or_else(|| ApiError::param(key, format!("`{key}` must be a non-empty list")))?;
    let mut alternatives = Vec::with_capacity(items.len());
    for item in items {
        let s = item
            .as_str()
            .ok_or_else(|| ApiError::param(key, format!("`{key}` must list strings")))?;
        alternatives.push(regex_literal(s));
    }
    Ok(Grammar::Regex(format!("({})", alternatives.join("|"))))
}

/// `s` as a regular expression matching exactly `s`.
fn regex_literal(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c.is_ascii_punctuation() || c == ' ' {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// `response_format` on /v1/completions (the conversation endpoints leave it to the converter).
pub fn completions_response_format(obj: &Map<String, Value>) -> Result<Option<Grammar>, ApiError> {
    const KEY: &str = "response_format";
    let format = match obj.get(KEY) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(f)) => f,
        Some(_) => return Err(ApiError::param(KEY, "`response_format` must be an object")),
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Grammar::JsonObject)),
        Some("json_schema") => {
            let schema = format
                .get("json_schema")
                .and_then(|s| s.get("schema"))
                .filter(|s| s.is_object() || s.is_boolean())
                .ok_or_else(|| {
                    ApiError::param(
                        "response_format.json_schema.schema",
                        "`response_format.json_schema.schema` must be a JSON schema",
                    )
                })?;
            // `strict: true` as chat and Responses apply it (every property required, no
            // other): the same `response_format` gives the same grammar on every endpoint.
            let mut schema = schema.clone();
            match format.get("json_schema").and_then(|s| s.get("strict")) {
                None | Some(Value::Null | Value::Bool(false)) => {}
                Some(Value::Bool(true)) => strict_objects(&mut schema),
                Some(_) => {
                    return Err(ApiError::param(
                        "response_format.json_schema.strict",
                        "`response_format.json_schema.strict` must be a boolean",
                    ));
                }
            }
            Ok(Some(Grammar::JsonSchema(schema.to_string())))
        }
        Some("regex") => match format.get("regex").and_then(Value::as_str) {
            Some(r) => Ok(Some(Grammar::Regex(r.to_owned()))),
            None => Err(ApiError::param(
                "response_format.regex",
                "`response_format.regex` must be a regular expression",
            )),
        },
        _ => Err(ApiError::param(
            "response_format.type",
            "`response_format.type` must be text, json_object, json_schema or regex",
        )),
    }
}

/// The JSON schema of a request's response format as the client wrote it (chat's
/// `response_format.json_schema`, Responses' `text.format`), with OpenAI's strict rules
/// applied when `strict` is true. The converter's own normalised copy keeps only the keywords
/// it models (it drops `maxLength`, `maxItems`, `$defs`, ...), so the grammar is built from
/// this one instead: nothing the client asked for is lost.
pub fn written_schema(obj: &Map<String, Value>) -> Option<Value> {
    let (schema, strict) = if let Some(f) = obj.get("response_format") {
        let s = f.get("json_schema")?;
        (s.get("schema")?, s.get("strict"))
    } else {
        let f = obj.get("text")?.get("format")?;
        (f.get("schema")?, f.get("strict"))
    };
    let mut schema = schema.clone();
    if strict == Some(&Value::Bool(true)) {
        strict_objects(&mut schema);
    }
    Some(schema)
}

/// OpenAI's strict mode: every object requires all of its properties and allows no others.
fn strict_objects(schema: &mut Value) {
    match schema {
        Value::Object(map) => {
            if let Some(Value::Object(props)) = map.get("properties") {
                let keys: Vec<Value> = props.keys().map(|k| Value::String(k.clone())).collect();
                map.insert("required".to_owned(), Value::Array(keys));
                map.insert("additionalProperties".to_owned(), Value::Bool(false));
            }
            for (_, v) in map.iter_mut() {
                strict_objects(v);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(strict_objects),
        _ => {}
    }
}

/// The grammar of the converter's constraint (`response_format` or a required tool call);
/// `written` is the schema as the client wrote it ([`written_schema`]);
/// `parallel_tool_calls: false` allows one call in a tool-call block; `dsml` is the id of the
/// tokenizer's `｜DSML｜` token.
pub fn requested(
    requested: Option<&Requested>,
    written: Option<Value>,
    parallel_tool_calls: bool,
    dsml: Option<u32>,
) -> Result<Option<Grammar>, ApiError> {
    let dsml = || {
        dsml.ok_or_else(|| {
            ApiError::Internal("the tokenizer has no ｜DSML｜ token for tool calls".to_owned())
        })
    };
    Ok(match requested {
        None => None,
        // `auto`: the model decides between text and a call. Strict tools (all of them, as
        // the converter checks) make every call follow its schema; otherwise nothing is
        // constrained.
        Some(Requested::ToolCalls {
            tools,
            required: false,
        }) => {
            if tools.iter().all(|t| t.strict != Some(true)) {
                None
            } else {
                super::tool_grammar::auto_calls(tools, parallel_tool_calls, dsml()?)?
                    .map(Grammar::Lark)
            }
        }
        Some(Requested::Json { schema: None }) => Some(Grammar::JsonObject),
        Some(Requested::Json {
            schema: Some(schema),
        }) => Some(Grammar::JsonSchema(
            written.unwrap_or_else(|| schema.clone()).to_string(),
        )),
        Some(Requested::Regex(regex)) => Some(Grammar::Regex(regex.clone())),
        Some(Requested::ToolCalls {
            tools,
            required: true,
        }) => Some(Grammar::Lark(super::tool_grammar::required_calls(
            tools,
            parallel_tool_calls,
            dsml()?,
        )?)),
    })
}

/// The constraint the workers enforce: the request's own grammar or vLLM's extras, never
/// both. `start_after_token` is `</think>` in thinking mode.
pub fn resolve(
    from_request: Option<Grammar>,
    guided: Option<(Grammar, &'static str)>,
    start_after_token: Option<u32>,
) -> Result<Option<OutputConstraint>, ApiError> {
    let grammar = match (from_request, guided) {
        (Some(_), Some((_, key))) => {
            return Err(ApiError::param(
                key,
                format!(
                    "`{key}` and the request's response_format or tool_choice both constrain \
                     the output; give one of them"
                ),
            ));
        }
        (Some(g), None) | (None, Some((g, _))) => g,
        (None, None) => return Ok(None),
    };
    Ok(Some(OutputConstraint {
        grammar,
        start_after_token,
        whitespace_flexible: false,
    }))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => Map::new(),
        }
    }

    #[test]
    fn each_guided_form_gives_its_grammar_and_leaves_the_request() {
        let cases = [
            (
                json!({"guided_json": {"type": "integer"}}),
                Grammar::JsonSchema(r#"{"type":"integer"}"#.to_owned()),
            ),
            (
                json!({"guided_json": "{\"type\": \"integer\"}"}),
                Grammar::JsonSchema(r#"{"type":"integer"}"#.to_owned()),
            ),
            (
                json!({"guided_regex": "[0-9]+"}),
                Grammar::Regex("[0-9]+".to_owned()),
            ),
            (
                json!({"guided_choice": ["yes", "no (maybe)"]}),
                Grammar::Regex(r"(yes|no\ \(maybe\))".to_owned()),
            ),
            (
                json!({"guided_grammar": "start: \"x\""}),
                Grammar::Lark("start: \"x\"".to_owned()),
            ),
            (
                json!({"structured_outputs": {"json_object": true}}),
                Grammar::JsonObject,
            ),
            (
                json!({"structured_outputs": {"choice": ["a"], "regex": null}}),
                Grammar::Regex("(a)".to_owned()),
            ),
        ];
        for (body, expected) in cases {
            let mut o = obj(body.clone());
            let (grammar, _) = guided(&mut o).expect("accepted").expect("a grammar");
            assert_eq!(grammar, expected, "{body}");
            assert!(o.is_empty(), "{body}: left {o:?}");
        }
        assert_eq!(guided(&mut obj(json!({"top_k": 3}))).expect("ok"), None);
    }

    #[test]
    fn conflicting_or_malformed_constraints_are_refused_naming_the_param() {
        let cases = [
            (
                json!({"guided_json": {}, "guided_regex": "a"}),
                "guided_regex",
            ),
            (json!({"guided_regex": 3}), "guided_regex"),
            (json!({"guided_choice": []}), "guided_choice"),
            (json!({"guided_json": "{nope"}), "guided_json"),
            (
                json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}),
                "structured_outputs",
            ),
            (
                json!({"structured_outputs": {"structural_tag": "x"}}),
                "structured_outputs.structural_tag",
            ),
        ];
        for (body, param) in cases {
            let err = guided(&mut obj(body.clone())).expect_err("refused");
            assert_eq!(err.parts().2, Some(param), "{body}");
        }
        let both = resolve(
            Some(Grammar::JsonObject),
            Some((Grammar::Regex("a".to_owned()), "guided_regex")),
            None,
        );
        assert!(both.is_err());
    }

    #[test]
    fn the_requests_constraint_becomes_the_workers() {
        let schema = json!({"type": "object"});
        let grammar = requested(
            Some(&Requested::Json {
                schema: Some(schema.clone()),
            }),
            None,
            true,
            None,
        )
        .expect("ok");
        let c = resolve(grammar, None, Some(128_822))
            .expect("ok")
            .expect("constraint");
        assert_eq!(c.grammar, Grammar::JsonSchema(schema.to_string()));
        assert_eq!(c.start_after_token, Some(128_822));
        assert!(!c.whitespace_flexible);
        let auto = Requested::ToolCalls {
            tools: Vec::new(),
            required: false,
        };
        assert_eq!(requested(Some(&auto), None, true, None).expect("ok"), None);
        assert_eq!(resolve(None, None, None).expect("ok"), None);
        // `auto` over strict tools: text, or calls that follow the schemas.
        let tool = |strict| deepseek_recipe_core::tools::ToolDefinition {
            name: "f".to_owned(),
            description: None,
            parameters: json!({"type": "object", "properties": {}}),
            strict,
            defer_loading: false,
        };
        let loose = Requested::ToolCalls {
            tools: vec![tool(None), tool(Some(false))],
            required: false,
        };
        assert_eq!(
            requested(Some(&loose), None, true, Some(9)).expect("ok"),
            None
        );
        let strict = Requested::ToolCalls {
            tools: vec![tool(Some(true))],
            required: false,
        };
        match requested(Some(&strict), None, true, Some(9)).expect("ok") {
            Some(Grammar::Lark(g)) => assert!(g.starts_with("start: text | text_then_open"), "{g}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_schema_as_written_keeps_its_keywords_and_gains_strict_rules() {
        let body = obj(
            json!({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "strict": true, "schema": {
                "type": "object",
                "properties": {"a": {"type": "string", "maxLength": 3},
                               "b": {"type": "object", "properties": {"c": {"type": "integer"}}}}
            }}}}),
        );
        let s = written_schema(&body).expect("schema");
        assert_eq!(s["properties"]["a"]["maxLength"], 3);
        assert_eq!(s["required"], json!(["a", "b"]));
        assert_eq!(s["additionalProperties"], false);
        assert_eq!(s["properties"]["b"]["required"], json!(["c"]));
        let loose = obj(
            json!({"text": {"format": {"type": "json_schema", "name": "x",
            "schema": {"type": "object", "properties": {"a": {}}}}}}),
        );
        let s = written_schema(&loose).expect("schema");
        assert!(s.get("required").is_none());
    }

    #[test]
    fn completions_response_formats() {
        let read = |v: Value| completions_response_format(&obj(json!({"response_format": v})));
        assert_eq!(read(json!({"type": "text"})).expect("ok"), None);
        assert_eq!(
            read(json!({"type": "json_object"})).expect("ok"),
            Some(Grammar::JsonObject)
        );
        assert_eq!(
            read(json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}))
                .expect("ok"),
            Some(Grammar::JsonSchema(r#"{"type":"object"}"#.to_owned()))
        );
        assert!(read(json!({"type": "json_schema", "json_schema": {"name": "x"}})).is_err());
        assert!(read(json!({"type": "xml"})).is_err());
        // `strict: true` as on chat: every property required, no other.
        let strict = read(json!({"type": "json_schema", "json_schema": {"name": "x",
            "strict": true, "schema": {"type": "object", "properties": {"a": {}}}}}));
        let Ok(Some(Grammar::JsonSchema(s))) = strict else {
            panic!("{strict:?}");
        };
        let s: Value = serde_json::from_str(&s).expect("json");
        assert_eq!(s["required"], json!(["a"]));
        assert_eq!(s["additionalProperties"], false);
        assert!(
            read(json!({"type": "json_schema", "json_schema": {"strict": "yes", "schema": {}}}))
                .is_err()
        );
    }
}
