//! Settings of the decode worker: the shared worker settings (worker-core) and nothing of its
//! own yet. Layering: defaults < `--config` TOML < `PDSERVE_*` env < flags.

use clap::Parser;
use common::config::{Invalid, ServiceConfig};
use serde::{Deserialize, Serialize};
use worker_core::{WorkerFlags, WorkerSettings};

/// Default gRPC port of a decode worker.
const DEFAULT_PORT: u16 = 8201;

/// Validated settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DecodeConfig {
    /// Listening, model, pool, router, transports, backend, security.
    #[serde(flatten)]
    pub worker: WorkerSettings,
}

impl Default for DecodeConfig {
    fn default() -> Self {
        Self {
            worker: WorkerSettings::listening_on(DEFAULT_PORT),
        }
    }
}

impl ServiceConfig for DecodeConfig {
    const ROLE: &'static str = "decode-worker";
    const HOST_PORT_KEY: Option<&'static str> = Some("grpc_listen");

    fn validate(&self) -> Result<(), Invalid> {
        self.worker
            .refuse_other_roles_settings(proto::v1::Role::Decode)?;
        self.worker.validate()
    }
}

/// Command line of `pdserve-decode`. Every flag overrides the setting of the same name.
#[derive(Debug, Parser, Serialize)]
#[command(name = "pdserve-decode", version, about = "pdserve decode worker", long_about = None)]
pub struct Cli {
    #[command(flatten)]
    #[serde(skip)]
    pub config: common::cli::ConfigFileArg,
    #[command(flatten)]
    #[serde(flatten)]
    pub worker: WorkerFlags,
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;
    use worker_core::settings::KvCacheDtype;

    use super::*;

    fn load(args: &[&str], env: &[(&str, &str)]) -> DecodeConfig {
        let cli =
            Cli::try_parse_from(std::iter::once("pdserve-decode").chain(args.iter().copied()))
                .expect("flags");
        let env = env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned()));
        common::config::load::<DecodeConfig>(None, env, &cli).expect("settings")
    }

    /// Fast decode attention from a flag or the environment, with what it needs.
    #[test]
    fn decode_attention_reads_from_flags_and_environment() {
        use worker_core::settings::DecodeAttention;
        assert_eq!(
            load(&[], &[]).worker.decode_attention,
            DecodeAttention::Exact
        );
        let needs = ["--backend", "emulated", "--kv-cache-dtype", "fp8"];
        let c = load(&[&needs[..], &["--decode-attention", "fast"]].concat(), &[]);
        assert_eq!(c.worker.decode_attention, DecodeAttention::Fast);
        let c = load(&needs, &[("PDSERVE_DECODE_ATTENTION", "fast")]);
        assert_eq!(c.worker.decode_attention, DecodeAttention::Fast);
    }

    /// A decode worker computes no prompts: the prefill keys are refused naming the key.
    #[test]
    fn prefill_keys_are_refused() {
        for (flag, key) in [
            ("--prefill-attention", "prefill_attention"),
            ("--prefill-linears", "prefill_linears"),
            ("--prefill-experts", "prefill_experts"),
        ] {
            let cli =
                Cli::try_parse_from(["pdserve-decode", flag, "fast", "--backend", "emulated"])
                    .expect("flags");
            let err = common::config::load::<DecodeConfig>(None, std::iter::empty(), &cli)
                .expect_err("refused");
            assert!(err.to_string().contains(key), "{err}");
        }
    }

    /// Fast decode experts from a flag or the environment.
    #[test]
    fn decode_experts_read_from_flags_and_environment() {
        use worker_core::settings::DecodeExperts;
        assert_eq!(load(&[], &[]).worker.decode_experts, DecodeExperts::Exact);
        let c = load(&["--backend", "emulated", "--decode-experts", "fast"], &[]);
        assert_eq!(c.worker.decode_experts, DecodeExperts::Fast);
        let c = load(
            &["--backend", "emulated"],
            &[("PDSERVE_DECODE_EXPERTS", "fast")],
        );
        assert_eq!(c.worker.decode_experts, DecodeExperts::Fast);
    }

    /// Fast decode linears from a flag or the environment.
    #[test]
    fn decode_linears_read_from_flags_and_environment() {
        use worker_core::settings::DecodeLinears;
        assert_eq!(load(&[], &[]).worker.decode_linears, DecodeLinears::Exact);
        let c = load(&["--backend", "emulated", "--decode-linears", "fast"], &[]);
        assert_eq!(c.worker.decode_linears, DecodeLinears::Fast);
        let c = load(
            &["--backend", "emulated"],
            &[("PDSERVE_DECODE_LINEARS", "fast")],
        );
        assert_eq!(c.worker.decode_linears, DecodeLinears::Fast);
    }

    /// Decode graphs from a flag or the environment.
    #[test]
    fn decode_graphs_read_from_flags_and_environment() {
        assert!(!load(&[], &[]).worker.decode_graphs);
        let c = load(&["--backend", "emulated", "--decode-graphs", "true"], &[]);
        assert!(c.worker.decode_graphs);
        let c = load(
            &["--backend", "emulated"],
            &[("PDSERVE_DECODE_GRAPHS", "true")],
        );
        assert!(c.worker.decode_graphs);
    }

    /// vLLM's spellings set the same settings as ours, from flags and from the environment.
    #[test]
    fn vllm_flag_spellings_are_the_same_settings() {
        let defaults = load(&[], &[]);
        assert_eq!(defaults.worker.kv_cache_dtype, KvCacheDtype::Auto);
        assert!(defaults.worker.enable_prefix_caching);
        let c = load(
            &[
                "--model",
                "/m",
                "--max-num-seqs",
                "7",
                "--kv-cache-dtype",
                "fp8",
                "--no-enable-prefix-caching",
            ],
            &[],
        );
        assert_eq!(
            c.worker.model_dir.as_deref(),
            Some(std::path::Path::new("/m"))
        );
        assert_eq!(c.worker.max_running, 7);
        assert_eq!(c.worker.kv_cache_dtype, KvCacheDtype::Fp8);
        assert!(!c.worker.enable_prefix_caching);
        let engine = c.worker.engine_config();
        assert_eq!(engine.kv, engine::paged::layout::KvStorage::Fp8);
        assert!(!engine.prefix_cache);
        // The later of the two prefix-caching flags wins; the environment sets it too.
        let c = load(
            &["--no-enable-prefix-caching", "--enable-prefix-caching"],
            &[("PDSERVE_ENABLE_PREFIX_CACHING", "false")],
        );
        assert!(c.worker.enable_prefix_caching);
        let c = load(&[], &[("PDSERVE_KV_CACHE_DTYPE", "fp8")]);
        assert_eq!(c.worker.kv_cache_dtype, KvCacheDtype::Fp8);
        // bf16 rows, spelled as vLLM spells them too, from flags and the environment.
        for (args, env) in [
            (&["--kv-cache-dtype", "bf16"][..], &[][..]),
            (&["--kv-cache-dtype", "bfloat16"][..], &[][..]),
            (&[][..], &[("PDSERVE_KV_CACHE_DTYPE", "bfloat16")][..]),
        ] {
            let c = load(args, env);
            assert_eq!(
                c.worker.kv_cache_dtype,
                KvCacheDtype::Bf16,
                "{args:?} {env:?}"
            );
            let kv = c.worker.engine_config().kv;
            assert_eq!(kv, engine::paged::layout::KvStorage::Bf16);
        }
        assert!(Cli::try_parse_from(["pdserve-decode", "--kv-cache-dtype", "int4"]).is_err());
        // --host and --port edit the gRPC listen address, over --grpc-listen too.
        let c = load(&["--port", "9123"], &[]);
        assert_eq!(c.worker.grpc_listen.to_string(), "127.0.0.1:9123");
        let c = load(&["--grpc-listen", "127.0.0.1:1", "--host", "0.0.0.0"], &[]);
        assert_eq!(c.worker.grpc_listen.to_string(), "0.0.0.0:1");
    }
}
