//! The integer constants of the kernel sources (`#define NAME value` and `constexpr int NAME =
//! value;` at file level, a value of literals, earlier constants and `+ - * / %`), which the
//! build writes as `kernels::cuda_constants::FILE::NAME`. The launch shapes and the CPU
//! emulations of the kernels' index math take their tile sizes, thread counts and layouts from
//! there, so they follow a kernel whose constant changes instead of checking stale math.

use std::fmt::Write as _;

/// A file's constants in order, `(name, value)`; a name defined twice with two values is left
/// out (a Rust use of it then does not compile).
pub fn constants(source: &str) -> Vec<(String, u64)> {
    let text = super::signatures::strip_comments(source).replace("\\\n", " ");
    let mut found: Vec<(String, Option<u64>)> = Vec::new();
    for line in text.lines() {
        // File level only: a constant inside a function or a block is indented.
        let Some((name, expr)) = definition(line) else {
            continue;
        };
        let known: Vec<(String, u64)> = found
            .iter()
            .filter_map(|(n, v)| v.map(|v| (n.clone(), v)))
            .collect();
        let Some(value) = evaluate(expr, &known) else {
            continue;
        };
        match found.iter_mut().find(|(n, _)| *n == name) {
            Some((_, v)) if *v != Some(value) => *v = None,
            Some(_) => {}
            None => found.push((name.to_owned(), Some(value))),
        }
    }
    found
        .into_iter()
        .filter_map(|(n, v)| v.map(|v| (n, v)))
        .collect()
}

/// `(name, value text)` of a `#define NAME value` or `[static] constexpr TYPE NAME = value;`.
fn definition(line: &str) -> Option<(&str, &str)> {
    if let Some(rest) = line.strip_prefix("#define ") {
        let rest = rest.trim_start();
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        let (name, value) = rest.split_at(end);
        // A function-like macro is not a constant.
        if name.is_empty() || value.starts_with('(') {
            return None;
        }
        let value = value.trim();
        return (!value.is_empty()).then_some((name, value));
    }
    let rest = line.strip_prefix("static ").unwrap_or(line);
    let rest = rest.strip_prefix("constexpr ")?;
    let (decl, value) = rest.split_once('=')?;
    let name = decl.split_whitespace().last()?;
    let integer = decl.split_whitespace().rev().skip(1).any(|w| {
        matches!(
            w,
            "int"
                | "unsigned"
                | "long"
                | "int32_t"
                | "uint32_t"
                | "int64_t"
                | "uint64_t"
                | "size_t"
        )
    });
    let value = value.trim().strip_suffix(';')?.trim();
    integer.then_some((name, value))
}

/// The value of `expr`: integer literals (decimal or hex, with `u`/`l` suffixes), names in
/// `known`, `+ - * / %` and parentheses; `None` for anything else or a negative result.
fn evaluate(expr: &str, known: &[(String, u64)]) -> Option<u64> {
    let tokens = tokens(expr)?;
    let mut at = 0;
    let value = sum(&tokens, &mut at, known)?;
    (at == tokens.len() && value >= 0).then_some(value as u64)
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Number(i128),
    Name(String),
    Op(char),
}

fn tokens(expr: &str) -> Option<Vec<Token>> {
    let mut out = Vec::new();
    let chars: Vec<char> = expr.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if "+-*/%()".contains(c) {
            out.push(Token::Op(c));
            i += 1;
        } else if c.is_ascii_alphanumeric() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            if c.is_ascii_digit() {
                let digits = word.trim_end_matches(['u', 'U', 'l', 'L']);
                let value = match digits.strip_prefix("0x").or(digits.strip_prefix("0X")) {
                    Some(hex) => i128::from_str_radix(hex, 16).ok()?,
                    None => digits.parse().ok()?,
                };
                out.push(Token::Number(value));
            } else {
                out.push(Token::Name(word));
            }
        } else {
            return None;
        }
    }
    Some(out)
}

fn sum(t: &[Token], at: &mut usize, known: &[(String, u64)]) -> Option<i128> {
    let mut value = product(t, at, known)?;
    while let Some(Token::Op(op @ ('+' | '-'))) = t.get(*at) {
        *at += 1;
        let rhs = product(t, at, known)?;
        value = if *op == '+' { value + rhs } else { value - rhs };
    }
    Some(value)
}

fn product(t: &[Token], at: &mut usize, known: &[(String, u64)]) -> Option<i128> {
    let mut value = atom(t, at, known)?;
    while let Some(Token::Op(op @ ('*' | '/' | '%'))) = t.get(*at) {
        *at += 1;
        let rhs = atom(t, at, known)?;
        value = match op {
            '*' => value.checked_mul(rhs)?,
            '/' => value.checked_div(rhs)?,
            _ => value.checked_rem(rhs)?,
        };
    }
    Some(value)
}

fn atom(t: &[Token], at: &mut usize, known: &[(String, u64)]) -> Option<i128> {
    let token = t.get(*at)?.clone();
    *at += 1;
    match token {
        Token::Number(n) => Some(n),
        Token::Name(name) => known
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| i128::from(*v)),
        Token::Op('(') => {
            let value = sum(t, at, known)?;
            if t.get(*at) != Some(&Token::Op(')')) {
                return None;
            }
            *at += 1;
            Some(value)
        }
        Token::Op('-') => Some(-atom(t, at, known)?),
        Token::Op(_) => None,
    }
}

/// `pub mod FILE { pub const NAME: usize = value; ... }` for each source's constants.
pub fn modules(files: &[(String, Vec<(String, u64)>)]) -> String {
    let mut out = String::from("// Generated by build.rs from cuda/*.cu and cuda/*.cuh.\n");
    for (file, constants) in files {
        if constants.is_empty() {
            continue;
        }
        let module = file.split('.').next().unwrap_or(file);
        let _ = writeln!(
            out,
            "\n/// The integer constants of `cuda/{file}`.\npub mod {module} {{"
        );
        for (name, value) in constants {
            let _ = writeln!(out, "    pub const {name}: usize = {value};");
        }
        out.push_str("}\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defines_and_constexprs_read_with_their_values() {
        let source = "#define WARPS 16\n#define THREADS (WARPS * 32)  // a block\n\
                      #define HEX 0x400u\n#define TWICE(x) ((x) * 2)\n\
                      constexpr int BK = 32;\nconstexpr int LDS = BK + 8;  /* padded */\n\
                      static constexpr unsigned SBO = (BK / 8) * 128 % 1000;\n\
                      constexpr uint32_t kDesc = (1u << 7) | 3;\n\
                      constexpr float SCALE = 0.5f;\n\
                      __global__ void f() {\n    constexpr int LOCAL = 3;\n}\n\
                      #define LATE UNKNOWN + 1\n";
        let found = constants(source);
        let want: Vec<(String, u64)> = [
            ("WARPS", 16),
            ("THREADS", 512),
            ("HEX", 1024),
            ("BK", 32),
            ("LDS", 40),
            ("SBO", 512),
        ]
        .iter()
        .map(|(n, v)| ((*n).to_owned(), *v))
        .collect();
        assert_eq!(found, want);
    }

    /// A name given two values is left out; the same value twice is kept once.
    #[test]
    fn a_name_with_two_values_is_left_out() {
        let found = constants("#define A 4\n#define B 1\n#define A 8\n#define B 1\n");
        assert_eq!(found, [("B".to_owned(), 1)]);
        assert_eq!(evaluate("(2 + 3) * 4 - 6 / 4", &[]), Some(19));
        assert_eq!(evaluate("2 - 3", &[]), None);
        assert_eq!(evaluate("(2", &[]), None);
        assert_eq!(evaluate("4 / 0", &[]), None);
    }

    /// The real sources' constants, derived ones included.
    #[test]
    fn the_kernel_sources_constants() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
        let of = |file: &str| constants(&std::fs::read_to_string(dir.join(file)).unwrap());
        let get = |found: &[(String, u64)], name: &str| {
            found.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
        };
        let sm100 = of("nvfp4_gemm_sm100.cu");
        assert_eq!(get(&sm100, "TMEM_SFW_COL"), Some(128 + 4 * 4));
        assert_eq!(get(&sm100, "STAGE_K"), Some(256));
        assert_eq!(get(&of("attn_decode_fp8.cu"), "THREADS"), Some(512));
        assert_eq!(get(&of("wgmma.cuh"), "SBO"), Some(512));
        let code = modules(&[("wgmma.cuh".into(), of("wgmma.cuh"))]);
        assert!(
            code.contains("pub mod wgmma {\n")
                && code.contains("    pub const SBO: usize = 512;\n")
        );
    }
}
