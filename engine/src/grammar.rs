//! Structured outputs: a request's [`OutputConstraint`] compiled with llguidance against the
//! model's token table, and the per-request matcher that masks every token the grammar does
//! not allow before sampling.
//!
//! The token table is built from the checkpoint's `tokenizer.json` (its tokens' bytes, with
//! every added token marked `"special": true` made unreachable from grammar text), padded to
//! the logits width with unreachable placeholders. It is built once per process (about 0.2 s on
//! V4's 129,280 tokens), on a thread of its own when the engine starts
//! ([`TokenTableSource::build_in_background`]), so that a first constrained request does not
//! stall the engine's thread and every request in its batch. A constraint's matcher is rebuilt from the grammar and the tokens already generated
//! wherever a request moves (prefill worker to decode worker), so it needs no state on the wire.
//!
//! End of sequence: llguidance knows one eos id (the first of the model's); when the grammar is
//! complete it allows that id, and every eos id of the model is allowed with it. A generated
//! eos id is consumed as that one.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, OnceLock},
    time::Instant,
};

#[cfg(test)]
mod tests;

use llguidance::{Matcher, ParserFactory, api::TopLevelGrammar, toktrie};
use proto::request::{Grammar, OutputConstraint};
use serde_json::{Value, json};

/// Why a constraint cannot be compiled or followed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    /// The grammar is not one llguidance can compile (the message names the construct).
    #[error("the output constraint does not compile: {0}")]
    Compile(String),
    /// This process has no token table for constraints (e.g. no `tokenizer.json`).
    #[error("structured outputs are unavailable here: {0}")]
    NoTokenTable(String),
    /// The matcher failed while generating (a limit of the parser, or an internal error).
    #[error("the output constraint failed while generating: {0}")]
    Matcher(String),
    /// The grammar allows no token, yet it is not complete.
    #[error("the output constraint allows no further token")]
    Dead,
    /// A token was generated that the grammar does not allow (a token chosen elsewhere).
    #[error("token {0} is not allowed by the output constraint")]
    Rejected(u32),
}

/// The model's tokens as llguidance sees them, and the parser factory built over them.
pub struct TokenTable {
    factory: ParserFactory,
    /// The model's eos ids; the first is the one llguidance knows.
    eos: Arc<[u32]>,
    vocab_size: usize,
}

impl std::fmt::Debug for TokenTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenTable")
            .field("vocab_size", &self.vocab_size)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

impl TokenTable {
    /// Builds the table from `tokenizer.json` text for logits of `vocab_size` entries.
    pub fn from_tokenizer_json(
        text: &[u8],
        vocab_size: usize,
        eos_token_ids: &[u32],
    ) -> Result<Self, GrammarError> {
        let bad = |e: &dyn std::fmt::Display| GrammarError::NoTokenTable(e.to_string());
        let &tok_eos = eos_token_ids
            .first()
            .ok_or_else(|| bad(&"the model names no eos token"))?;
        let json: Value = serde_json::from_slice(text).map_err(|e| bad(&e))?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| bad(&e))?;
        if words.len() > vocab_size {
            return Err(bad(&format!(
                "tokenizer.json has {} tokens, more than the model's {vocab_size} logits",
                words.len()
            )));
        }
        // Ids the tokenizer does not define can never be produced by grammar text.
        let mut pad = 0usize;
        for word in &mut words {
            if word.is_empty() {
                *word = placeholder(pad);
                pad += 1;
            }
        }
        while words.len() < vocab_size {
            words.push(placeholder(pad));
            pad += 1;
        }
        let vocab = u32::try_from(vocab_size).map_err(|e| bad(&e))?;
        let info = toktrie::TokRxInfo {
            vocab_size: vocab,
            tok_eos,
            tok_bos: None,
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: None,
        };
        let trie = toktrie::TokTrie::from(&info, &words);
        let env: toktrie::TokEnv = Arc::new(toktrie::ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| bad(&e))?;
        factory.quiet();
        Ok(Self {
            factory,
            eos: eos_token_ids.into(),
            vocab_size,
        })
    }

    /// The bytes `tokens` stand for (special tokens as their text).
    pub fn token_bytes(&self, tokens: &[u32]) -> Vec<u8> {
        self.factory.tok_env().tok_trie().decode(tokens)
    }

    /// Compiles `constraint` into a fresh matcher.
    pub fn compile(&self, constraint: &OutputConstraint) -> Result<TokenConstraint, GrammarError> {
        let grammar = top_level(constraint)?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| GrammarError::Compile(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Compile(e));
        }
        Ok(TokenConstraint {
            matcher,
            start_after: constraint.start_after_token,
            active: constraint.start_after_token.is_none(),
            eos: Arc::clone(&self.eos),
            vocab_size: self.vocab_size,
        })
    }
}

/// An unreachable token: the special marker byte cannot occur in grammar text.
fn placeholder(n: usize) -> Vec<u8> {
    let mut word = vec![toktrie::TokTrie::SPECIAL_TOKEN_MARKER];
    word.extend_from_slice(format!("<pdserve_unused_{n}>").as_bytes());
    word
}

/// The llguidance grammar of a constraint. JSON gets the whitespace setting unless the schema
/// sets llguidance's own `x-guidance` options.
fn top_level(c: &OutputConstraint) -> Result<TopLevelGrammar, GrammarError> {
    let with_whitespace = |mut schema: Value| -> Result<TopLevelGrammar, GrammarError> {
        if let Value::Object(map) = &mut schema
            && !map.contains_key("x-guidance")
        {
            map.insert(
                "x-guidance".to_owned(),
                json!({ "whitespace_flexible": c.whitespace_flexible }),
            );
        }
        Ok(TopLevelGrammar::from_json_schema(schema))
    };
    match &c.grammar {
        Grammar::JsonSchema(text) => {
            let schema: Value = serde_json::from_str(text)
                .map_err(|e| GrammarError::Compile(format!("the schema is not JSON: {e}")))?;
            with_whitespace(schema)
        }
        Grammar::JsonObject => with_whitespace(json!({ "type": "object" })),
        Grammar::Regex(regex) => Ok(TopLevelGrammar::from_regex(regex)),
        Grammar::Lark(lark) => Ok(TopLevelGrammar::from_lark(lark.clone())),
    }
}

/// One request's grammar state.
#[derive(Clone)]
pub struct TokenConstraint {
    matcher: Matcher,
    start_after: Option<u32>,
    /// Whether the grammar applies yet (after `start_after` was generated).
    active: bool,
    eos: Arc<[u32]>,
    vocab_size: usize,
}

impl std::fmt::Debug for TokenConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenConstraint")
            .field("start_after", &self.start_after)
            .field("active", &self.active)
            .field("complete", &self.is_complete())
            .finish_non_exhaustive()
    }
}

impl TokenConstraint {
    /// Sets every logit the grammar does not allow to -inf (nothing while the constraint has
    /// not started).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        if !self.active {
            return Ok(());
        }
        let mask = self
            .matcher
            .compute_mask()
            .map_err(|e| GrammarError::Matcher(e.to_string()))?;
        let eos_allowed = self.eos.first().is_some_and(|&e| mask.is_allowed(e));
        // The other eos ids are special tokens llguidance does not know: they follow the first.
        let eos_logits: Vec<(usize, f32)> = self
            .eos
            .iter()
            .skip(1)
            .filter_map(|&e| logits.get(e as usize).map(|&l| (e as usize, l)))
            .collect();
        let words = mask.as_slice();
        let mut any = false;
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = words.get(w).copied().unwrap_or(0);
            // Most words are all forbidden or all allowed: one test each.
            if bits == 0 {
                chunk.fill(f32::NEG_INFINITY);
                continue;
            }
            if bits == u32::MAX && chunk.len() == 32 {
                any = true;
                continue;
            }
            for (b, l) in chunk.iter_mut().enumerate() {
                if bits & (1 << b) == 0 {
                    *l = f32::NEG_INFINITY;
                } else {
                    any = true;
                }
            }
        }
        for (e, l) in eos_logits {
            logits[e] = if eos_allowed { l } else { f32::NEG_INFINITY };
        }
        if !any && !eos_allowed {
            return Err(GrammarError::Dead);
        }
        Ok(())
    }

    /// Advances the grammar over a generated token.
    pub fn consume(&mut self, token: u32) -> Result<(), GrammarError> {
        self.advance(token, true)
    }

    /// [`Self::consume`] of a token sampled under this constraint's own mask, which allowed it:
    /// the matcher is not asked twice.
    pub fn consume_sampled(&mut self, token: u32) -> Result<(), GrammarError> {
        self.advance(token, false)
    }

    fn advance(&mut self, token: u32, check: bool) -> Result<(), GrammarError> {
        if !self.active {
            if self.start_after == Some(token) {
                self.active = true;
            }
            return Ok(());
        }
        if token as usize >= self.vocab_size {
            return Err(GrammarError::Rejected(token));
        }
        let token = if self.eos.contains(&token) {
            self.eos[0]
        } else {
            token
        };
        if check
            && self
                .matcher
                .validate_tokens(&[token])
                .map_err(|e| GrammarError::Matcher(e.to_string()))?
                == 0
        {
            return Err(GrammarError::Rejected(token));
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| GrammarError::Matcher(e.to_string()))
    }

    /// Whether the grammar is complete: nothing may follow, so the request ends.
    pub fn is_complete(&self) -> bool {
        self.active && self.matcher.is_stopped() && !self.matcher.is_error()
    }
}

/// Where an engine's token table comes from: built once from `tokenizer.json` in the
/// checkpoint folder (in the background, or on first use), then shared by its clones.
#[derive(Debug, Clone)]
pub struct TokenTableSource {
    dir: Option<PathBuf>,
    vocab_size: usize,
    eos: Vec<u32>,
    built: Arc<OnceLock<Result<Arc<TokenTable>, GrammarError>>>,
}

impl TokenTableSource {
    /// The table of the checkpoint in `dir`.
    pub fn from_dir(dir: &Path, vocab_size: usize, eos: &[u32]) -> Self {
        Self {
            dir: Some(dir.to_path_buf()),
            vocab_size,
            eos: eos.to_vec(),
            built: Arc::new(OnceLock::new()),
        }
    }

    /// No table: every constrained request is refused.
    pub fn none() -> Self {
        Self {
            dir: None,
            vocab_size: 0,
            eos: Vec::new(),
            built: Arc::new(OnceLock::new()),
        }
    }

    /// Starts building the table on a thread of its own (a source without a folder has
    /// nothing to build). A [`Self::get`] meanwhile waits for that one build.
    pub fn build_in_background(&self) {
        if self.dir.is_none() || self.built.get().is_some() {
            return;
        }
        let source = self.clone();
        let spawned = std::thread::Builder::new()
            .name("token-table".to_owned())
            .spawn(move || {
                if let Err(e) = source.get() {
                    tracing::warn!(error = %e, "structured outputs will be refused");
                }
            });
        if let Err(e) = spawned {
            // Not fatal: the first constrained request builds it.
            tracing::warn!(error = %e, "could not start the token table's thread");
        }
    }

    /// Whether the table (or the reason there is none) is ready.
    pub fn is_built(&self) -> bool {
        self.built.get().is_some()
    }

    /// The table, built now if this is the first call.
    pub fn get(&self) -> Result<Arc<TokenTable>, GrammarError> {
        self.built
            .get_or_init(|| {
                let Some(dir) = &self.dir else {
                    return Err(GrammarError::NoTokenTable(
                        "this engine was started without a tokenizer".to_owned(),
                    ));
                };
                let path = dir.join("tokenizer.json");
                let text = std::fs::read(&path)
                    .map_err(|e| GrammarError::NoTokenTable(format!("{}: {e}", path.display())))?;
                let started = Instant::now();
                let table = TokenTable::from_tokenizer_json(&text, self.vocab_size, &self.eos)?;
                tracing::info!(
                    tokens = self.vocab_size,
                    ms = started.elapsed().as_millis(),
                    "built the token table for structured outputs"
                );
                Ok(Arc::new(table))
            })
            .clone()
    }
}
