//! Settings of the prefill worker: the shared worker settings (worker-core) plus how it sends
//! the prompt state. Layering: defaults < `--config` TOML < `PDSERVE_*` env < flags.

use clap::Parser;
use common::config::{Invalid, ServiceConfig};
use serde::{Deserialize, Serialize};
use worker_core::{WorkerFlags, WorkerSettings};

/// Default gRPC port of a prefill worker.
const DEFAULT_PORT: u16 = 8101;

/// Validated settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PrefillConfig {
    /// Listening, model, pool, router, transports, backend, security.
    #[serde(flatten)]
    pub worker: WorkerSettings,
    /// Send each layer's state while the prompt is still being computed (true), or all of it
    /// after the forward passes (false: the baseline `pdctl bench-transfer` compares against;
    /// the transfer then adds its whole time to the first token).
    pub stream_state: bool,
}

impl Default for PrefillConfig {
    fn default() -> Self {
        Self {
            worker: WorkerSettings::listening_on(DEFAULT_PORT),
            stream_state: true,
        }
    }
}

impl ServiceConfig for PrefillConfig {
    const ROLE: &'static str = "prefill-worker";
    const HOST_PORT_KEY: Option<&'static str> = Some("grpc_listen");

    fn validate(&self) -> Result<(), Invalid> {
        self.worker
            .refuse_other_roles_settings(proto::v1::Role::Prefill)?;
        self.worker.validate()
    }
}

/// Command line of `pdserve-prefill`. Every flag overrides the setting of the same name.
#[derive(Debug, Parser, Serialize)]
#[command(name = "pdserve-prefill", version, about = "pdserve prefill worker", long_about = None)]
pub struct Cli {
    #[command(flatten)]
    #[serde(skip)]
    pub config: common::cli::ConfigFileArg,
    #[command(flatten)]
    #[serde(flatten)]
    pub worker: WorkerFlags,
    /// Stream the prompt state during the forward passes (true) or send it afterwards.
    #[arg(long, value_name = "BOOL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream_state: Option<bool>,
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    /// A prefill worker never decodes: asking it for a decode attention is refused naming the
    /// key, not ignored.
    #[test]
    fn decode_attention_is_refused() {
        let cli = Cli::try_parse_from([
            "pdserve-prefill",
            "--decode-attention",
            "fast",
            "--backend",
            "emulated",
            "--kv-cache-dtype",
            "fp8",
        ])
        .expect("flags");
        let err = common::config::load::<PrefillConfig>(None, std::iter::empty(), &cli)
            .expect_err("refused");
        assert!(err.to_string().contains("decode_attention"), "{err}");
    }

    /// The prompt chunks' GEMMs from flags or the environment on the device step; refused on
    /// the cpu backend naming the key.
    #[test]
    fn prefill_gemms_read_from_flags_and_environment() {
        use worker_core::settings::{PrefillAttention, PrefillExperts, PrefillLinears};
        let load = |args: &[&str], env: &[(&str, &str)]| {
            let cli =
                Cli::try_parse_from(std::iter::once("pdserve-prefill").chain(args.iter().copied()))
                    .expect("flags");
            let env = env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned()));
            common::config::load::<PrefillConfig>(None, env, &cli)
        };
        let c = load(&[], &[]).expect("defaults");
        assert_eq!(c.worker.prefill_linears, PrefillLinears::Exact);
        assert_eq!(c.worker.prefill_experts, PrefillExperts::Exact);
        let c = load(
            &["--backend", "emulated", "--prefill-linears", "fast"],
            &[("PDSERVE_PREFILL_EXPERTS", "fast")],
        )
        .expect("on the device step");
        assert_eq!(c.worker.prefill_linears, PrefillLinears::Fast);
        assert_eq!(c.worker.prefill_experts, PrefillExperts::Fast);
        // The fast attention reads FP8 rows: refused without them, naming the key.
        let fast = ["--backend", "emulated", "--prefill-attention", "fast"];
        let err = load(&fast, &[]).expect_err("f32 rows");
        assert!(err.to_string().contains("prefill_attention"), "{err}");
        let c = load(&[&fast[..], &["--kv-cache-dtype", "fp8"]].concat(), &[]).expect("fp8");
        assert_eq!(c.worker.prefill_attention, PrefillAttention::Fast);
        for (flag, key) in [
            ("--prefill-attention", "prefill_attention"),
            ("--prefill-linears", "prefill_linears"),
            ("--prefill-experts", "prefill_experts"),
        ] {
            let err = load(&[flag, "fast"], &[]).expect_err("cpu");
            assert!(err.to_string().contains(key), "{err}");
            let err = load(
                &[flag, "fast", "--backend", "emulated", "--hybrid", "true"],
                &[],
            )
            .expect_err("hybrid");
            assert!(err.to_string().contains(key), "{err}");
        }
    }

    /// Nor does it take decode experts.
    #[test]
    fn decode_experts_are_refused() {
        let cli = Cli::try_parse_from([
            "pdserve-prefill",
            "--decode-experts",
            "fast",
            "--backend",
            "emulated",
        ])
        .expect("flags");
        let err = common::config::load::<PrefillConfig>(None, std::iter::empty(), &cli)
            .expect_err("refused");
        assert!(err.to_string().contains("decode_experts"), "{err}");
    }

    /// Nor does it take decode linears.
    #[test]
    fn decode_linears_are_refused() {
        let cli = Cli::try_parse_from([
            "pdserve-prefill",
            "--decode-linears",
            "fast",
            "--backend",
            "emulated",
        ])
        .expect("flags");
        let err = common::config::load::<PrefillConfig>(None, std::iter::empty(), &cli)
            .expect_err("refused");
        assert!(err.to_string().contains("decode_linears"), "{err}");
    }

    /// Nor does it replay decode steps as graphs.
    #[test]
    fn decode_graphs_are_refused() {
        let cli = Cli::try_parse_from([
            "pdserve-prefill",
            "--decode-graphs",
            "true",
            "--backend",
            "emulated",
        ])
        .expect("flags");
        let err = common::config::load::<PrefillConfig>(None, std::iter::empty(), &cli)
            .expect_err("refused");
        assert!(err.to_string().contains("decode_graphs"), "{err}");
    }
}
