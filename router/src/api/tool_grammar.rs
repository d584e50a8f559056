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
//! at the first call. A call names one of the offered tools; its parameters come in the schema's property order,
//! required ones always, optional ones when the model writes them. A string parameter is raw
//! text up to the closing tag (one of its values when it has an `enum`); any other is JSON
//! valid under the property's schema.

use deepseek_recipe_core::tools::ToolDefinition;
use serde_json::{Value, json};

use super::error::ApiError;

/// A Lark string literal for `s`.
fn literal(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_owned())
}

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
        format!("start: call {more} {}", tag(dsml, "\n</", "tool_calls>")),
        format!("call: {}", alternatives.join(" | ")),
    ];
    grammar.extend(rules);
    Ok(grammar.join("\n"))
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
            // Raw text up to the closing tag: a lazy lexeme ending at the first `</`, which
            // the tag's token must follow (so the text may hold `<` but not `</`).
            rules.push(format!(
                "{rule}: {open} v_{t}_{p} <[{dsml}]> {}",
                literal("parameter>")
            ));
            rules.push(format!("v_{t}_{p}[lazy]: /(?s:.*)<\\//"));
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
        assert!(!g.contains("｜DSML｜"), "the tag token by id only: {g}");
        assert!(calls(std::iter::empty(), true, 9).is_err());
    }
}
