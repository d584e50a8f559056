//! The grammar of a V4 tool-call block, for `tool_choice: "required"` and a named function:
//! the DSML form the model was trained to write (DeepSeek's `encoding_dsv4` templates), not a
//! JSON array it never saw.
//!
//! ```text
//! \n\n<｜DSML｜tool_calls>                      (the prompt ends with this line)
//! <｜DSML｜invoke name="NAME">
//! <｜DSML｜parameter name="KEY" string="true">raw text</｜DSML｜parameter>
//! <｜DSML｜parameter name="KEY" string="false">JSON value</｜DSML｜parameter>
//! </｜DSML｜invoke>
//! </｜DSML｜tool_calls>
//! ```
//!
//! The official encoder ends a required-call prompt inside the block, so the grammar starts
//! at the first call. A call names one of the offered tools; its parameters come in the
//! schema's property order, required ones always, optional ones when the model writes them. A
//! string parameter is raw text (`</` included) up to the closing tag (one of its values when
//! it has an `enum`); any other is JSON valid under the property's schema.

use deepseek_recipe_core::tools::ToolDefinition;
use serde_json::{Value, json};

use super::error::ApiError;

/// A Lark string literal for `s`.
fn literal(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_owned())
}

/// Text that never holds `｜DSML｜` (as a regex to intersect with): the tag token is not
/// marked special in V4's tokenizer, so its bytes are text to a regex, while the output parser
/// reads that token as a tag wherever it appears.
const NO_TAG: &str = "~/(?s:.*)｜DSML｜(?s:.*)/";

/// A DSML tag: `before`, the `｜DSML｜` token itself, `after`. The output parser recognises a
/// tag only by that token's id, so the grammar names the id: the same bytes written with
/// other tokens would be read as text.
fn tag(dsml: u32, before: &str, after: &str) -> String {
    format!("{} <[{dsml}]> {}", literal(before), literal(after))
}

/// The grammar of one or more calls of `tools` (name, parameters schema); `parallel: false`
/// allows exactly one. `dsml` is the id of the `｜DSML｜` token.
pub fn calls<'a>(
    tools: impl IntoIterator<Item = (&'a str, &'a Value)>,
    parallel: bool,
    dsml: u32,
) -> Result<String, ApiError> {
    let mut grammar = vec!["start: calls".to_owned()];
    grammar.extend(block(tools, parallel, dsml)?);
    Ok(grammar.join("\n"))
}

/// The grammar of `tool_choice: "auto"` over strict tools: any text, then optionally one
/// tool-call block (opened as the encoder opens it, after a blank line) whose calls are valid.
/// Text cannot hold a DSML tag: the tag's special token is only allowed where the block opens.
pub fn text_or_calls<'a>(
    tools: impl IntoIterator<Item = (&'a str, &'a Value)>,
    parallel: bool,
    dsml: u32,
) -> Result<String, ApiError> {
    let mut grammar = vec![
        format!(
            "start: text | text_then_open <[{dsml}]> {} calls",
            literal("tool_calls>\n")
        ),
        // Two greedy lexemes without a tag: plain text, or text ending where the block's tag
        // opens (the tag token that follows can continue neither, so both end there).
        "text: TEXT".to_owned(),
        "text_then_open: TEXT_THEN_OPEN".to_owned(),
        format!("TEXT: /(?s:.*)/ & {NO_TAG}"),
        format!("TEXT_THEN_OPEN: /(?s:.*)\\n\\n</ & {NO_TAG}"),
    ];
    grammar.extend(block(tools, parallel, dsml)?);
    Ok(grammar.join("\n"))
}

/// The rules of a tool-call block after its opening line: `calls` and what it uses.
fn block<'a>(
    tools: impl IntoIterator<Item = (&'a str, &'a Value)>,
    parallel: bool,
    dsml: u32,
) -> Result<Vec<String>, ApiError> {
    let mut rules = Vec::new();
    let mut alternatives = Vec::new();
    for (t, (name, parameters)) in tools.into_iter().enumerate() {
        let (args, arg_rules) = arguments(t, parameters, dsml);
        rules.extend(arg_rules);
        rules.push(format!(
            "call_{t}: {} {args} {}",
            tag(dsml, "<", &format!("invoke name=\"{name}\">\n")),
            tag(dsml, "</", "invoke>")
        ));
        alternatives.push(format!("call_{t}"));
    }
    if alternatives.is_empty() {
        return Err(ApiError::param(
            "tools",
            "a tool call is required but no tool is offered",
        ));
    }
    let more = if parallel {
        format!("({} call)*", literal("\n"))
    } else {
        String::new()
    };
    let mut grammar = vec![
        format!("calls: call {more} {}", tag(dsml, "\n</", "tool_calls>")),
        format!("call: {}", alternatives.join(" | ")),
    ];
    grammar.extend(rules);
    Ok(grammar)
}

/// The converter's required-call constraint (its tools already narrowed to a named one).
pub fn required_calls(
    tools: &[ToolDefinition],
    parallel: bool,
    dsml: u32,
) -> Result<String, ApiError> {
    calls(
        tools.iter().map(|t| (t.name.as_str(), &t.parameters)),
        parallel,
        dsml,
    )
}

/// The converter's `auto` constraint: `None` unless every tool is strict (OpenAI's rule: a
/// strict tool's calls always follow its schema); then text or valid calls.
pub fn auto_calls(
    tools: &[ToolDefinition],
    parallel: bool,
    dsml: u32,
) -> Result<Option<String>, ApiError> {
    if tools.is_empty() || tools.iter().any(|t| t.strict != Some(true)) {
        return Ok(None);
    }
    text_or_calls(
        tools.iter().map(|t| (t.name.as_str(), &t.parameters)),
        parallel,
        dsml,
    )
    .map(Some)
}

/// The argument list of tool `t`: the expansion and the rules it uses.
fn arguments(t: usize, parameters: &Value, dsml: u32) -> (String, Vec<String>) {
    let empty = serde_json::Map::new();
    let properties = parameters
        .get("properties")
        .and_then(Value::as_object)
        .unwrap_or(&empty);
    let required: Vec<&str> = parameters
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if properties.is_empty() {
        // The encoder writes an empty argument list as an empty line.
        return (literal("\n"), Vec::new());
    }
    // Each parameter on its own line: `open \n P1 \n P2 \n close` as the encoder joins them.
    let mut parts = Vec::new();
    let mut rules = Vec::new();
    for (p, (key, schema)) in properties.iter().enumerate() {
        let is_string = schema.get("type").and_then(Value::as_str) == Some("string");
        let open = tag(
            dsml,
            "<",
            &format!(
                "parameter name=\"{key}\" string=\"{}\">",
                if is_string { "true" } else { "false" }
            ),
        );
        let close = tag(dsml, "</", "parameter>");
        let rule = format!("p_{t}_{p}");
        let choices: Option<Vec<String>> = schema
            .get("enum")
            .and_then(Value::as_array)
            .map(|e| e.iter().filter_map(Value::as_str).map(literal).collect());
        if is_string && let Some(choices) = choices.filter(|c| !c.is_empty()) {
            // An enumerated string is one of its values, as raw text.
            rules.push(format!("{rule}: {open} ({}) {close}", choices.join(" | ")));
        } else if is_string {
            // Raw text up to the closing tag: a greedy lexeme of text without a tag, ending
            // in `</`. It ends where the tag token follows (which it cannot hold), so the
            // text itself may hold `</` anywhere.
            rules.push(format!(
                "{rule}: {open} V_{t}_{p} <[{dsml}]> {}",
                literal("parameter>")
            ));
            rules.push(format!("V_{t}_{p}: /(?s:.*)<\\// & {NO_TAG}"));
        } else {
            let mut schema = schema.clone();
            if let Value::Object(map) = &mut schema {
                map.entry("x-guidance")
                    .or_insert_with(|| json!({"whitespace_flexible": false}));
            }
            rules.push(format!("{rule}: {open} %json {schema} {close}"));
        }
        let item = format!("{rule} {}", literal("\n"));
        parts.push(if required.contains(&key.as_str()) {
            item
        } else {
            format!("({item})?")
        });
    }
    (parts.join(" "), rules)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grammar_lists_each_tool_and_parameter_in_dsml() {
        let weather = json!({
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"]
        });
        let none = json!({"type": "object", "properties": {}});
        let g = calls([("get_weather", &weather), ("ping", &none)], false, 9).expect("grammar");
        assert!(g.contains("call: call_0 | call_1"), "{g}");
        assert!(
            g.contains(r#""<" <[9]> "invoke name=\"get_weather\">\n""#),
            "{g}"
        );
        assert!(
            g.contains(r#"<[9]> "parameter name=\"city\" string=\"true\">""#),
            "{g}"
        );
        assert!(
            g.contains(r#"<[9]> "parameter name=\"days\" string=\"false\">""#),
            "{g}"
        );
        assert!(g.contains("(p_0_1 \"\\n\")?"), "{g}");
        assert!(!g.contains("call)*"), "one call only: {g}");
        // The tag token by id only; its text appears only where text is kept free of it.
        assert!(
            !g.replace(NO_TAG, "").contains("｜DSML｜"),
            "the tag token by id only: {g}"
        );
        assert!(calls(std::iter::empty(), true, 9).is_err());
    }

    /// V4's tokenizer and token table, built once for every test of this module.
    fn v4() -> &'static (tokenizers::Tokenizer, engine::grammar::TokenTable) {
        static V4: std::sync::OnceLock<(tokenizers::Tokenizer, engine::grammar::TokenTable)> =
            std::sync::OnceLock::new();
        V4.get_or_init(|| {
            let path = common::assets::deepseek_v4_tokenizer().expect("run scripts/setup");
            let json = std::fs::read(&path).expect("tokenizer.json");
            let table = engine::grammar::TokenTable::from_tokenizer_json(&json, 129_280, &[1])
                .expect("table");
            let tokenizer = tokenizers::Tokenizer::from_file(&path).expect("tokenizer");
            (tokenizer, table)
        })
    }

    /// The id of V4's `｜DSML｜` token.
    fn dsml() -> u32 {
        v4().0.token_to_id("｜DSML｜").expect("the DSML token")
    }

    /// Whether V4's tokenizer's encoding of `text` is a complete output of `grammar`.
    fn accepts(grammar: &str, text: &str) -> Result<bool, String> {
        use proto::request::{Grammar, OutputConstraint};
        let (tokenizer, table) = v4();
        let ids = tokenizer
            .encode(text, false)
            .expect("encode")
            .get_ids()
            .to_vec();
        let mut c = table
            .compile(&OutputConstraint {
                grammar: Grammar::Lark(grammar.to_owned()),
                start_after_token: None,
                whitespace_flexible: false,
            })
            .map_err(|e| e.to_string())?;
        for id in ids {
            c.consume(id).map_err(|e| e.to_string())?;
        }
        Ok(c.is_complete() || c.consume(1).is_ok())
    }

    #[test]
    fn a_string_parameter_may_hold_any_text_up_to_its_closing_tag() {
        let dsml = dsml();
        let schema = json!({
            "type": "object",
            "properties": {"html": {"type": "string"}, "n": {"type": "integer"}},
            "required": ["html", "n"]
        });
        let g = calls([("render", &schema)], false, dsml).expect("grammar");
        let call = |value: &str| {
            format!(
                "<｜DSML｜invoke name=\"render\">\n\
                 <｜DSML｜parameter name=\"html\" string=\"true\">{value}</｜DSML｜parameter>\n\
                 <｜DSML｜parameter name=\"n\" string=\"false\">3</｜DSML｜parameter>\n\
                 </｜DSML｜invoke>\n</｜DSML｜tool_calls>"
            )
        };
        for value in [
            "plain",
            "",
            "a < b",
            "<b>bold</b> and </p>",
            "ends with </",
            "<</</x",
        ] {
            assert_eq!(accepts(&g, &call(value)), Ok(true), "{value:?}");
        }
        // The tag token ends a value wherever the output parser meets it: never inside one.
        for value in ["<｜DSML｜invoke", "a｜DSML｜b"] {
            assert_ne!(accepts(&g, &call(value)), Ok(true), "{value:?}");
        }
        // The integer parameter is still JSON, and the block still ends where it must.
        assert_ne!(accepts(&g, &call("x").replace(">3<", ">three<")), Ok(true));
        assert_ne!(accepts(&g, &format!("{} extra", call("x"))), Ok(true));
    }

    #[test]
    fn auto_over_strict_tools_allows_text_then_only_valid_calls() {
        let dsml = dsml();
        let schema = json!({
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": false
        });
        let g = text_or_calls([("weather", &schema)], true, dsml).expect("grammar");
        let block = |days: &str| {
            format!(
                "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"weather\">\n\
                 <｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n\
                 <｜DSML｜parameter name=\"days\" string=\"false\">{days}</｜DSML｜parameter>\n\
                 </｜DSML｜invoke>\n</｜DSML｜tool_calls>"
            )
        };
        for text in ["", "Just text.", "a < b\n\n<not a tag>", "x\n\n<"] {
            assert_eq!(accepts(&g, text), Ok(true), "{text:?}");
        }
        assert_eq!(accepts(&g, &block("3")), Ok(true));
        assert_eq!(
            accepts(&g, &format!("Let me look.{}", block("3"))),
            Ok(true)
        );
        // A call's arguments follow the schema; a tag appears only where the block opens.
        assert_ne!(accepts(&g, &block("\"three\"")), Ok(true));
        assert_ne!(
            accepts(&g, &block("3").replace("weather", "forecast")),
            Ok(true)
        );
        assert_ne!(
            accepts(&g, "text <｜DSML｜invoke name=\"weather\">"),
            Ok(true)
        );
        assert_ne!(accepts(&g, &format!("{} and more", block("3"))), Ok(true));
    }
}
