//! The served model: its names, tokenizer, the official DeepSeek-V4 prompt encoding, context
//! limit and the backend that generates for it.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
};

use deepseek_recipe::request::{ConversionOptions, ModelVersion, WebSearchBehavior};
use deepseek_recipe_encoding::{PromptTokenizer, dsv4::DeepseekV4Encoding};
use engine::{
    config::ConfigError, grammar::TokenTableSource, model::Model, scheduler::EngineConfig,
    weights::LoadError,
};
use tokenizers::Tokenizer;

use crate::{
    RouterConfig,
    backend::{LocalBackend, SharedBackend},
};

/// `system_fingerprint` reported by the in-process backend.
pub const LOCAL_FINGERPRINT: &str = "pdserve-local";

/// Why the served model cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ServedError {
    /// `tokenizer.json` is missing or unreadable.
    #[error("{}: {source}", path.display())]
    Tokenizer {
        path: PathBuf,
        source: tokenizers::Error,
    },
    /// The checkpoint (config and weights) does not load.
    #[error("{}: {source}", dir.display())]
    Model { dir: PathBuf, source: LoadError },
    /// The checkpoint's config does not load (disaggregated: the router reads no weights).
    #[error("{}: {source}", dir.display())]
    Config { dir: PathBuf, source: ConfigError },
    /// The in-process engine does not start.
    #[error("engine: {0}")]
    Engine(#[source] std::io::Error),
}

/// Everything a request needs about the served model.
pub struct Served {
    /// The name responses report.
    pub name: String,
    /// The checkpoint folder (`/v1/models` `root`, as vLLM reports the model path).
    pub root: String,
    /// Every accepted request name (`name` first).
    pub names: Vec<String>,
    pub tokenizer: Arc<Tokenizer>,
    pub encoding: DeepseekV4Encoding,
    /// Prompt plus completion tokens, at most, as configured and as the model allows (the
    /// decode workers' pools may allow less: [`Served::max_model_len`]).
    configured_max_model_len: u32,
    /// The workers behind a disaggregated deployment, whose pools bound the context.
    workers: Option<Arc<crate::backend::workers::Workers>>,
    pub vocab_size: usize,
    pub eos_token_ids: Vec<u32>,
    pub thinking_default: bool,
    /// `</think>`: in thinking mode an output constraint starts after it.
    pub think_end_token: Option<u32>,
    /// `｜DSML｜`, the token that opens and closes V4's tool-call tags.
    pub dsml_token: Option<u32>,
    /// Output-token limit of requests that set none.
    pub default_max_tokens: u32,
    pub backend: SharedBackend,
    pub fingerprint: String,
}

impl std::fmt::Debug for Served {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Served")
            .field("name", &self.name)
            .field("names", &self.names)
            .field("max_model_len", &self.configured_max_model_len)
            .finish_non_exhaustive()
    }
}

impl Served {
    /// Loads the checkpoint at `dir`, its tokenizer, and starts the in-process engine.
    pub fn load_local(config: &RouterConfig, dir: &Path) -> Result<Self, ServedError> {
        let tokenizer = load_tokenizer(dir)?;
        let model = Model::load(dir).map_err(|source| ServedError::Model {
            dir: dir.to_owned(),
            source,
        })?;
        let engine_config = EngineConfig {
            num_pages: config.engine_num_pages,
            ..EngineConfig::default()
        };
        let pool_tokens = engine_config
            .page_size
            .saturating_mul(engine_config.num_pages as usize);
        let limit = model.config.max_position_embeddings.min(pool_tokens);
        let max_model_len = config
            .max_model_len
            .map_or(limit, |l| (l as usize).min(limit));
        let vocab_size = model.config.vocab_size;
        let eos_token_ids = model.config.eos_token_ids.clone();
        let tokens = TokenTableSource::from_dir(dir, vocab_size, &eos_token_ids);
        let backend = LocalBackend::start(model, engine_config, LOCAL_FINGERPRINT, tokens)
            .map_err(ServedError::Engine)?;
        Ok(Self::new(
            config,
            tokenizer,
            u32::try_from(max_model_len).unwrap_or(u32::MAX),
            vocab_size,
            eos_token_ids,
            Arc::new(backend),
        ))
    }

    /// The disaggregated deployment: the tokenizer and config from `dir` (no weights: the
    /// workers hold them) over the two-leg backend to the configured workers.
    pub fn load_pd(
        config: &RouterConfig,
        dir: &Path,
        workers: Arc<crate::backend::workers::Workers>,
    ) -> Result<Self, ServedError> {
        let tokenizer = load_tokenizer(dir)?;
        let model =
            engine::config::ModelConfig::from_dir(dir).map_err(|source| ServedError::Config {
                dir: dir.to_owned(),
                source,
            })?;
        let limit = u32::try_from(model.max_position_embeddings).unwrap_or(u32::MAX);
        let max_model_len = config.max_model_len.map_or(limit, |l| l.min(limit));
        let backend = crate::backend::pd::PdBackend::new(config, Arc::clone(&workers));
        let mut served = Self::new(
            config,
            tokenizer,
            max_model_len,
            model.vocab_size,
            model.eos_token_ids.clone(),
            Arc::new(backend),
        );
        "pdserve-pd".clone_into(&mut served.fingerprint);
        served.workers = Some(workers);
        Ok(served)
    }

    /// A served model over any backend.
    pub fn new(
        config: &RouterConfig,
        tokenizer: Tokenizer,
        max_model_len: u32,
        vocab_size: usize,
        eos_token_ids: Vec<u32>,
        backend: SharedBackend,
    ) -> Self {
        let encoding = DeepseekV4Encoding::new().with_tokenizer(PromptTokenizer::new(&tokenizer));
        let mut names = vec![config.served_model_name.clone()];
        for alias in &config.model_aliases {
            if !names.contains(alias) {
                names.push(alias.clone());
            }
        }
        Self {
            name: config.served_model_name.clone(),
            root: config.model_dir.as_ref().map_or_else(
                || config.served_model_name.clone(),
                |d| d.display().to_string(),
            ),
            names,
            think_end_token: tokenizer.token_to_id("</think>"),
            dsml_token: tokenizer.token_to_id("｜DSML｜"),
            tokenizer: Arc::new(tokenizer),
            encoding,
            configured_max_model_len: max_model_len,
            workers: None,
            vocab_size,
            eos_token_ids,
            thinking_default: config.thinking_default,
            default_max_tokens: config.default_max_tokens,
            backend,
            fingerprint: LOCAL_FINGERPRINT.to_owned(),
        }
    }

    /// Prompt plus completion tokens, at most: the configured limit, and in a disaggregated
    /// deployment what the largest pool among the decode workers that are up holds (a request
    /// that fits no decode worker could never be served). Workers not yet heard from leave
    /// the configured limit.
    pub fn max_model_len(&self) -> u32 {
        let pools = self
            .workers
            .as_ref()
            .and_then(|w| w.decode.largest_pool_tokens());
        pools.map_or(self.configured_max_model_len, |p| {
            self.configured_max_model_len
                .min(u32::try_from(p).unwrap_or(u32::MAX))
        })
    }

    /// Conversion options of the official converter: our names, all rendered as V4.
    pub fn conversion_options(&self) -> ConversionOptions {
        ConversionOptions::new()
            .with_model_versions_by_name(
                self.names
                    .iter()
                    .map(|name| (name.clone(), ModelVersion::DeepseekV4Pro)),
            )
            .with_default_thinking_mode(self.thinking_default)
            // No search runs here: a web search tool is refused, not dropped without a word
            // (the Responses default).
            .with_responses_web_search(WebSearchBehavior::Reject)
            .with_messages_web_search(WebSearchBehavior::Reject)
    }

    /// Whether `model` names this model.
    pub fn accepts(&self, model: &str) -> bool {
        self.names.iter().any(|n| n == model)
    }
}

/// The tokenizer in `dir` (`tokenizer.json`).
fn load_tokenizer(dir: &Path) -> Result<Tokenizer, ServedError> {
    let path = dir.join("tokenizer.json");
    Tokenizer::from_file(&path).map_err(|source| ServedError::Tokenizer { path, source })
}
