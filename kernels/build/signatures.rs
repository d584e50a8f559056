//! The parameter lists of the kernels in `cuda/*.cu`, read from their source (`extern "C"
//! __global__` functions, and those a `#define` writes for each of its uses). The build script
//! writes a typed launcher for each (`kernel_params.rs`), so every launch's arguments are
//! checked by the compiler against the kernel's own parameters: a scalar of the wrong width or
//! an argument out of order, which a GPU would read as garbage, does not compile. With nvcc
//! at hand the build also compares each list with the compiled PTX's `.entry` parameters, which
//! checks this reader.

use std::fmt::Write as _;

/// What a kernel parameter is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Param {
    /// A scalar passed by value: the Rust type of the same width.
    Scalar(&'static str),
    /// A device pointer: its element's Rust type (`None` for `void`), and whether the kernel
    /// may write through it (no `const`).
    Pointer {
        element: Option<&'static str>,
        writes: bool,
    },
}

impl Param {
    /// Bytes the parameter takes in the launch's parameter buffer.
    pub fn bytes(&self) -> usize {
        match self {
            Param::Pointer { .. } | Param::Scalar("i64" | "u64" | "f64") => 8,
            Param::Scalar(_) => 4,
        }
    }
}

/// One kernel's name and parameters (names as written, in order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kernel {
    pub name: String,
    pub params: Vec<(String, Param)>,
    /// The `#define` that wrote it, if one did.
    pub family: Option<String>,
}

/// The kernels defined in one `.cu` source.
pub fn kernels(source: &str) -> Result<Vec<Kernel>, String> {
    let text = strip_comments(source).replace("\\\n", " ");
    let mut found = Vec::new();
    let mut macros = Vec::new();
    for line in text.lines() {
        let line = line.trim_start();
        if let Some(define) = line.strip_prefix("#define")
            && define.contains("__global__")
        {
            macros.push(macro_definition(define)?);
        }
    }
    // Outside `#define` lines: the kernels written out, and the uses of the macros.
    let body: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n");
    let mut at = 0;
    while let Some(i) = body[at..].find("__global__") {
        let start = at + i;
        let kernel = signature(&body[start..], None)?;
        at = start + "__global__".len();
        found.push(kernel);
    }
    for (name, params, definition) in &macros {
        let mut at = 0;
        while let Some(i) = find_word(&body[at..], name) {
            let start = at + i + name.len();
            let args = balanced(&body[start..])
                .ok_or_else(|| format!("a use of {name} without its arguments"))?;
            at = start + args.len() + 2;
            let values: Vec<&str> = args.split(',').map(str::trim).collect();
            if values.len() != params.len() {
                return Err(format!("{name}({args}): {} arguments", values.len()));
            }
            let expanded = params
                .iter()
                .zip(&values)
                .fold(definition.clone(), |text, (p, v)| replace_word(&text, p, v));
            let g = expanded
                .find("__global__")
                .ok_or_else(|| format!("{name}: no __global__"))?;
            found.push(signature(&expanded[g..], Some(name))?);
        }
    }
    Ok(found)
}

/// `(name, parameter names, body)` of a `#define NAME(A, B) body`.
fn macro_definition(define: &str) -> Result<(String, Vec<String>, String), String> {
    let define = define.trim_start();
    let open = define
        .find('(')
        .ok_or_else(|| format!("#define {define}: a kernel macro without parameters"))?;
    let name = define[..open].trim().to_owned();
    let params = balanced(&define[open..]).ok_or_else(|| format!("#define {name}: unclosed"))?;
    let body = define[open + params.len() + 2..].to_owned();
    let params = params.split(',').map(|p| p.trim().to_owned()).collect();
    Ok((name, params, body))
}

/// The kernel whose `__global__` starts `text`.
fn signature(text: &str, family: Option<&str>) -> Result<Kernel, String> {
    let rest = text["__global__".len()..].trim_start();
    let rest = rest
        .strip_prefix("void")
        .ok_or_else(|| format!("a kernel that is not void: {}", head(text)))?
        .trim_start();
    let rest = match rest.strip_prefix("__launch_bounds__") {
        Some(bounds) => {
            let inner = balanced(bounds.trim_start())
                .ok_or_else(|| format!("unclosed __launch_bounds__: {}", head(text)))?;
            bounds.trim_start()[inner.len() + 2..].trim_start()
        }
        None => rest,
    };
    let open = rest
        .find('(')
        .ok_or_else(|| format!("a kernel without parameters: {}", head(text)))?;
    let name = rest[..open].trim().to_owned();
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(format!("not a kernel name: {name:?} in {}", head(text)));
    }
    let list = balanced(&rest[open..]).ok_or_else(|| format!("{name}: unclosed parameters"))?;
    let params = if list.trim().is_empty() {
        Vec::new()
    } else {
        list.split(',')
            .map(|p| param(p).map_err(|e| format!("{name}: {e}")))
            .collect::<Result<_, _>>()?
    };
    Ok(Kernel {
        name,
        params,
        family: family.map(str::to_owned),
    })
}

/// One parameter: `const float* __restrict__ x`, `long long n`, `float* y`.
fn param(text: &str) -> Result<(String, Param), String> {
    let spaced = text.replace('*', " * ");
    let words: Vec<&str> = spaced
        .split_whitespace()
        .filter(|w| *w != "__restrict__")
        .collect();
    let Some((name, ty)) = words.split_last() else {
        return Err(format!("an empty parameter in {text:?}"));
    };
    let pointers = ty.iter().filter(|w| **w == "*").count();
    let konst = ty.contains(&"const");
    let base: Vec<&str> = ty
        .iter()
        .copied()
        .filter(|w| *w != "*" && *w != "const")
        .collect();
    let base = base.join(" ");
    let element = match base.as_str() {
        "float" => Some("f32"),
        "double" => Some("f64"),
        "int" => Some("i32"),
        "unsigned" | "unsigned int" | "uint32_t" => Some("u32"),
        "long long" | "int64_t" => Some("i64"),
        "unsigned long long" | "uint64_t" => Some("u64"),
        "uint8_t" | "unsigned char" => Some("u8"),
        "uint16_t" | "unsigned short" => Some("u16"),
        "void" if pointers == 1 => None,
        _ => {
            return Err(format!(
                "parameter {name}: type {base:?} has no Rust type here"
            ));
        }
    };
    let param = match (pointers, element) {
        (0, Some(scalar)) => Param::Scalar(scalar),
        (1, element) => Param::Pointer {
            element,
            writes: !konst,
        },
        _ => return Err(format!("parameter {name}: {pointers} levels of pointer")),
    };
    Ok(((*name).to_owned(), param))
}

/// The text between the `(` that starts `text` and its matching `)`.
fn balanced(text: &str) -> Option<&str> {
    let text = text.strip_prefix('(')?;
    let mut depth = 1usize;
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&text[..i]);
                }
            }
            _ => {}
        }
    }
    None
}

fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Where `word` first stands alone in `text`, followed by `(`.
fn find_word(text: &str, word: &str) -> Option<usize> {
    let mut at = 0;
    while let Some(i) = text[at..].find(word) {
        let start = at + i;
        let end = start + word.len();
        let before = text[..start]
            .chars()
            .next_back()
            .is_none_or(|c| !is_word_char(c));
        let after = text[end..].starts_with('(');
        if before && after {
            return Some(start);
        }
        at = end;
    }
    None
}

fn replace_word(text: &str, word: &str, with: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find(word) {
        let before = out
            .chars()
            .chain(rest[..i].chars())
            .next_back()
            .is_none_or(|c| !is_word_char(c));
        let after = rest[i + word.len()..]
            .chars()
            .next()
            .is_none_or(|c| !is_word_char(c));
        out.push_str(&rest[..i]);
        out.push_str(if before && after { with } else { word });
        rest = &rest[i + word.len()..];
    }
    out.push_str(rest);
    out
}

/// `source` without its comments (a line comment's `\\` line continuation kept).
pub fn strip_comments(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    loop {
        let line = rest.find("//");
        let block = rest.find("/*");
        match (line, block) {
            (Some(l), b) if b.is_none_or(|b| l < b) => {
                out.push_str(&rest[..l]);
                // A line comment ends at its line's end; a continued line keeps its `\`.
                let end = rest[l..].find('\n').map_or(rest.len(), |e| l + e);
                if rest[l..end].trim_end().ends_with('\\') {
                    out.push('\\');
                }
                rest = &rest[end..];
            }
            (_, Some(b)) => {
                out.push_str(&rest[..b]);
                let end = rest[b + 2..]
                    .find("*/")
                    .map_or(rest.len(), |e| b + 2 + e + 2);
                out.push(' ');
                rest = &rest[end..];
            }
            _ => {
                out.push_str(rest);
                return out;
            }
        }
    }
}

fn head(text: &str) -> &str {
    let end = text.char_indices().nth(80).map_or(text.len(), |(i, _)| i);
    &text[..end]
}

/// The parameter widths of each `.entry` in `ptx` (`.u64`, `.u32`, `.f32` ...), by name.
pub fn ptx_entries(ptx: &str) -> Vec<(String, Vec<usize>)> {
    let mut entries = Vec::new();
    let mut rest = ptx;
    while let Some(i) = rest.find(".entry ") {
        rest = &rest[i + ".entry ".len()..];
        let open = rest.find('(').unwrap_or(rest.len());
        let name = rest[..open].trim().to_owned();
        let Some(list) = balanced(&rest[open..]) else {
            break;
        };
        let widths = list
            .split(',')
            .filter(|p| p.contains(".param"))
            .map(|p| {
                let ty = p.split_whitespace().nth(1).unwrap_or("");
                ty.trim_start_matches(['.', 'u', 's', 'f', 'b'])
                    .parse::<usize>()
                    .map_or(0, |bits| bits / 8)
            })
            .collect();
        entries.push((name, widths));
    }
    entries
}

/// The Rust name of a C parameter (a keyword gets a `_`).
fn rust_name(name: &str) -> String {
    const KEYWORDS: &[&str] = &[
        "as",
        "async",
        "await",
        "box",
        "break",
        "const",
        "continue",
        "crate",
        "dyn",
        "else",
        "enum",
        "extern",
        "fn",
        "for",
        "gen",
        "if",
        "impl",
        "in",
        "let",
        "loop",
        "match",
        "mod",
        "move",
        "mut",
        "pub",
        "ref",
        "return",
        "self",
        "static",
        "struct",
        "super",
        "trait",
        "type",
        "unsafe",
        "use",
        "where",
        "while",
        "yield",
        "launch_args",
    ];
    if KEYWORDS.contains(&name) {
        format!("{name}_")
    } else {
        name.to_owned()
    }
}

/// The typed launcher of each kernel (see the module's doc): a module per kernel with its
/// `NAME` and `args`, which pushes the arguments in the kernel's order; a `#define`'s kernels
/// share the `args` of a module named after it.
pub fn launchers(files: &[(String, Vec<Kernel>)]) -> String {
    let mut out = String::from("// Generated by build.rs from cuda/*.cu: a launcher per kernel.\n");
    let mut families: Vec<(String, Vec<&Kernel>)> = Vec::new();
    for (file, kernels) in files {
        for k in kernels {
            // A `#define`'s kernels take their arguments through their family's module.
            let args = if k.family.is_some() {
                String::new()
            } else {
                args_fn(k, &format!("`{}`", k.name))
            };
            let _ = writeln!(
                out,
                "\n/// `{}` of `cuda/{file}.cu`.\npub(crate) mod {} {{\n    pub(crate) const NAME: &str = \"{}\";\n    /// Its parameter types in order: kernels with equal `PARAMS` take one launcher.\n    #[allow(dead_code, reason = \"compared where two kernels share a launcher\")]\n    pub(crate) const PARAMS: &str = \"{}\";\n{args}}}",
                k.name,
                k.name,
                k.name,
                param_types(k),
            );
            if let Some(f) = &k.family {
                match families.iter_mut().find(|(n, _)| n == f) {
                    Some((_, list)) => list.push(k),
                    None => families.push((f.clone(), vec![k])),
                }
            }
        }
    }
    for (family, kernels) in families {
        let first = kernels[0];
        // Kernels of one `#define` whose parameters differ (a parameter's type from the
        // macro's arguments) get no shared launcher: none compiles against them.
        let args = if kernels.iter().all(|k| k.params == first.params) {
            args_fn(first, &format!("every kernel of `{family}`"))
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "\n/// The kernels `#define {family}` writes.\npub(crate) mod {} {{\n{args}}}",
            family.to_ascii_lowercase(),
        );
    }
    out
}

/// `k`'s parameter types in order (`in f32, i64, out f32`), names left out.
fn param_types(k: &Kernel) -> String {
    let types: Vec<String> = k
        .params
        .iter()
        .map(|(_, p)| match p {
            Param::Scalar(t) => (*t).to_owned(),
            Param::Pointer { element, writes } => format!(
                "{} {}",
                if *writes { "out" } else { "in" },
                element.unwrap_or("void")
            ),
        })
        .collect();
    types.join(", ")
}

fn args_fn(k: &Kernel, what: &str) -> String {
    let mut generics = Vec::new();
    let mut params = String::new();
    let mut body = String::new();
    for (name, p) in &k.params {
        let name = rust_name(name);
        let ty = match p {
            Param::Scalar(t) => {
                let _ = writeln!(body, "        launch_args.arg({name});");
                format!("&'a {t}")
            }
            Param::Pointer { element, writes } => {
                let element = if let Some(e) = element {
                    (*e).to_owned()
                } else {
                    let g = format!("V{}", generics.len());
                    generics.push(g.clone());
                    g
                };
                let _ = writeln!(body, "        {name}.push(launch_args);");
                if *writes {
                    format!("&'a mut (impl crate::cuda::params::Writes<{element}> + ?Sized)")
                } else {
                    format!("&'a (impl crate::cuda::params::Reads<{element}> + ?Sized)")
                }
            }
        };
        let _ = write!(params, ",\n        {name}: {ty}");
    }
    let generics: String = generics.iter().fold(String::new(), |mut out, g| {
        let _ = write!(out, ", {g}");
        out
    });
    let scalars = k.params.iter().any(|(_, p)| matches!(p, Param::Scalar(_)));
    let import = if scalars {
        "        use cudarc::driver::PushKernelArg as _;\n"
    } else {
        ""
    };
    format!(
        "    /// Pushes the parameters of {what} in order.\n    #[allow(dead_code, reason = \"a kernel whose PARAMS equal another's may launch through that one's\")]\n    pub(crate) fn args<'a{generics}>(\n        launch_args: &mut cudarc::driver::LaunchArgs<'a>{params},\n    ) {{\n{import}{body}    }}\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ptr(element: &'static str, writes: bool) -> Param {
        Param::Pointer {
            element: Some(element),
            writes,
        }
    }

    #[test]
    fn parameters_read_as_their_rust_types() {
        let k = &kernels(
            "// a kernel\nextern \"C\" __global__ void __launch_bounds__(THREADS, 1)\n\
             pick(const float* __restrict__ x, // [n]\n long long n, int k, float s,\n\
             /* out */ int* __restrict__ out, const void* raw, unsigned int u) {\n}\n",
        )
        .unwrap()[0];
        assert_eq!(k.name, "pick");
        assert_eq!(k.family, None);
        let params: Vec<_> = k
            .params
            .iter()
            .map(|(n, p)| (n.as_str(), p.clone()))
            .collect();
        assert_eq!(
            params,
            [
                ("x", ptr("f32", false)),
                ("n", Param::Scalar("i64")),
                ("k", Param::Scalar("i32")),
                ("s", Param::Scalar("f32")),
                ("out", ptr("i32", true)),
                (
                    "raw",
                    Param::Pointer {
                        element: None,
                        writes: false
                    }
                ),
                ("u", Param::Scalar("u32")),
            ]
        );
        let bytes: Vec<usize> = k.params.iter().map(|(_, p)| p.bytes()).collect();
        assert_eq!(bytes, [8, 8, 4, 4, 8, 8, 4]);
    }

    #[test]
    fn a_macros_kernels_are_read_from_each_use() {
        let source = "#define TWICE(NAME, T)                       \\\n\
             extern \"C\" __global__ void NAME(const T* __restrict__ x, // in  \\\n\
             long long n, T* y) {                                         \\\n\
                 y[0] = x[0];                                             \\\n\
             }\n\
             TWICE(twice_f32, float)\nTWICE(twice_u8, uint8_t)\n";
        let found = kernels(source).unwrap();
        let names: Vec<_> = found.iter().map(|k| k.name.as_str()).collect();
        assert_eq!(names, ["twice_f32", "twice_u8"]);
        assert!(found.iter().all(|k| k.family.as_deref() == Some("TWICE")));
        assert_eq!(found[0].params[0].1, ptr("f32", false));
        assert_eq!(found[1].params[2].1, ptr("u8", true));
        // Their types differ: the family has no shared launcher.
        let code = launchers(&[("twice".into(), found)]);
        assert!(code.contains("pub(crate) mod twice {\n}"), "{code}");
    }

    #[test]
    fn what_has_no_rust_type_is_refused() {
        for bad in [
            "extern \"C\" __global__ void f(float** x) {}",
            "extern \"C\" __global__ void f(double2 x) {}",
            "extern \"C\" __global__ void f(void x) {}",
            "extern \"C\" __global__ int f(int x) {}",
            "extern \"C\" __global__ void f(int x {}",
        ] {
            assert!(kernels(bad).is_err(), "{bad}");
        }
    }

    /// The launcher pushes every parameter in order, each typed as the kernel takes it.
    #[test]
    fn a_launcher_takes_the_kernels_parameters_in_order() {
        let found = kernels(
            "extern \"C\" __global__ void held(const int* __restrict__ experts, long long \
             first, float* ys, int n) {}",
        )
        .unwrap();
        let code = launchers(&[("step".into(), found)]);
        let expected = "        launch_args: &mut cudarc::driver::LaunchArgs<'a>,\n        \
             experts: &'a (impl crate::cuda::params::Reads<i32> + ?Sized),\n        \
             first: &'a i64,\n        \
             ys: &'a mut (impl crate::cuda::params::Writes<f32> + ?Sized),\n        \
             n: &'a i32,\n    ) {\n        \
             use cudarc::driver::PushKernelArg as _;\n        \
             experts.push(launch_args);\n        \
             launch_args.arg(first);\n        \
             ys.push(launch_args);\n        \
             launch_args.arg(n);\n";
        assert!(code.contains(expected), "{code}");
        assert!(code.contains("pub(crate) const NAME: &str = \"held\";"));
        assert!(code.contains("pub(crate) const PARAMS: &str = \"in i32, i64, out f32, i32\";"));
    }

    #[test]
    fn ptx_entries_give_their_parameters_widths() {
        let ptx = ".visible .entry held_ids(\n.param .u64 held_ids_param_0,\n\
                   .param .u32 held_ids_param_1,\n.param .f32 held_ids_param_2\n)\n{\n}\n\
                   .visible .entry none(\n)\n{\n}\n";
        assert_eq!(
            ptx_entries(ptx),
            [
                ("held_ids".to_owned(), vec![8, 4, 4]),
                ("none".to_owned(), vec![])
            ]
        );
    }

    /// Every kernel of `cuda/` is read, with its parameters; spot checks of each form.
    #[test]
    fn the_kernel_sources_are_read() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
        let mut all = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|x| x == "cu") {
                let source = std::fs::read_to_string(&path).unwrap();
                let written = source.matches("extern \"C\" __global__").count();
                let found = kernels(&source).unwrap();
                assert!(found.len() >= written, "{}", path.display());
                all.extend(found);
            }
        }
        let mut names: Vec<_> = all.iter().map(|k| k.name.as_str()).collect();
        names.sort_unstable();
        let count = names.len();
        names.dedup();
        assert_eq!(names.len(), count, "a kernel name twice");
        let get = |name: &str| all.iter().find(|k| k.name == name).unwrap();
        let held = get("held_ids");
        let widths: Vec<_> = held.params.iter().map(|(_, p)| p.bytes()).collect();
        assert_eq!(widths, [8, 8, 8, 8, 8, 8]);
        assert_eq!(held.params[5].1, ptr("i32", true));
        // `__launch_bounds__(THREADS, 1)`, 13 parameters over comment lines.
        assert_eq!(get("attn_fp8_partial").params.len(), 13);
        // A `#define`'s five uses, one parameter list.
        let gemv: Vec<_> = all
            .iter()
            .filter(|k| k.family.as_deref() == Some("EXACT_GEMV"))
            .collect();
        assert_eq!(gemv.len(), 5);
        assert!(gemv.iter().all(|k| k.params == gemv[0].params));
        assert_eq!(
            gemv[0].params[0].1,
            Param::Pointer {
                element: None,
                writes: false
            }
        );
    }
}
