//! `pdctl plan`: what a checkpoint needs before anything is downloaded or loaded. Weight
//! bytes by class, state bytes per token and per request in the engine's page layout, and
//! what fits beside the weights in a GPU group, all from `config.json`.

use std::{
    io::Write,
    path::{Path, PathBuf},
};

use engine::{
    config::{ExpertFormat, LinearFormat, ModelConfig},
    paged::layout::KvStorage,
    plan::{self, Fit, StatePlan, WeightPlan},
};
use serde_json::{Value, json};

use crate::PdctlError;

mod group;

use engine::plan::shard::Parallel;

/// Arguments of `pdctl plan`.
#[derive(Debug, Clone, clap::Args)]
pub struct PlanArgs {
    /// A checkpoint folder or its `config.json` (an `hf_quant_config.json` beside it is read
    /// too). Nothing else is opened: the shards need not be present.
    #[arg(long, value_name = "PATH")]
    pub config: PathBuf,
    /// Tokens per state page (as the workers' `page_size`).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub page_size: u32,
    /// How the state stores attention rows (the workers' `kv_cache_dtype`): `f32` (their
    /// default), `fp8` (DeepSeek's per-token FP8) or `bf16`. The per-token table shows all
    /// three; this one sizes the fit.
    #[arg(long, value_parser = ["f32", "fp8", "bf16"], default_value = "f32")]
    pub kv: String,
    /// Context length (prompt plus output) of the requests to size.
    #[arg(long, default_value_t = 65_536, value_name = "TOKENS")]
    pub context: u64,
    /// Memory of one GPU, as bytes or with a unit (`141GB`, `139GiB`, `80G` = GB). Without
    /// it, no fit is computed.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub gpu_memory: Option<u64>,
    /// GPUs in the group that holds one model copy.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub gpus: u64,
    /// Fraction of GPU memory the engine may use (the rest: CUDA context, activations,
    /// communication buffers).
    #[arg(long, default_value_t = 0.9, value_parser = parse_fraction)]
    pub utilization: f64,
    /// Attention tensor parallelism: ranks sharing each request's heads. With `--ep` or
    /// `--dp-attention`, a per-GPU section is printed and the group is `max(tp, ep)` GPUs.
    #[arg(long, visible_alias = "tensor-parallel-size", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub tp: u32,
    /// Expert parallelism: ranks holding disjoint routed experts.
    #[arg(long, visible_alias = "expert-parallel-size", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub ep: u32,
    /// Attention by requests: each of the `--ep` ranks runs whole requests (with `--tp 1`).
    #[arg(long)]
    pub dp_attention: bool,
    /// Every routed expert sliced over the `--tp` ranks (with `--ep 1`).
    #[arg(long, visible_alias = "moe-tensor-parallel")]
    pub moe_tp: bool,
    /// Print JSON instead of tables.
    #[arg(long)]
    pub json: bool,
}

impl PlanArgs {
    /// The group layout the flags name, when they name one.
    fn parallel(&self, c: &ModelConfig) -> Result<Option<Parallel>, PdctlError> {
        let p = Parallel {
            tp: self.tp as usize,
            ep: self.ep as usize,
            dp_attention: self.dp_attention,
            moe_tp: self.moe_tp,
        };
        if p == Parallel::SINGLE {
            return Ok(None);
        }
        p.validate(c).map_err(PdctlError::Model)?;
        if self.gpus != 1 && self.gpus != p.gpus() as u64 {
            return Err(PdctlError::Model(format!(
                "--gpus {} disagrees with --tp {} --ep {} (a group of {} GPUs)",
                self.gpus,
                self.tp,
                self.ep,
                p.gpus()
            )));
        }
        Ok(Some(p))
    }
}

/// Runs `pdctl plan`.
pub fn run(args: &PlanArgs) -> Result<(), PdctlError> {
    let config = read_config(&args.config)?;
    let parallel = args.parallel(&config)?;
    let kv = KvStorage::from_name(&args.kv).unwrap_or(KvStorage::F32);
    let page_size = args.page_size as usize;
    let weights = plan::weights(&config);
    let state =
        |kv| plan::state(&config, page_size, kv).map_err(|e| PdctlError::Model(format!("{e}")));
    let states = KvStorage::ALL
        .into_iter()
        .map(state)
        .collect::<Result<Vec<_>, _>>()?;
    let chosen = states.iter().find(|s| s.kv == kv).unwrap_or(&states[0]);
    let gpus = parallel.map_or(args.gpus, |p| p.gpus() as u64);
    let fit = args.gpu_memory.map(|memory| {
        plan::fit(
            &weights,
            chosen,
            memory,
            gpus,
            args.utilization,
            args.context,
        )
    });
    let group = parallel.map(|p| {
        group::GroupReport::new(
            &config,
            p,
            chosen,
            args.gpu_memory.map(|m| (m, args.utilization)),
            args.context,
        )
    });
    let report = Report {
        config: &config,
        weights: &weights,
        states: &states,
        kv,
        context: args.context,
        fit: fit.as_ref(),
        gpus,
        group: group.as_ref(),
        args,
    };
    let text = if args.json {
        let mut json = serde_json::to_string_pretty(&report.json())
            .map_err(|e| PdctlError::Model(format!("plan as JSON: {e}")))?;
        json.push('\n');
        json
    } else {
        report.text()
    };
    std::io::stdout().lock().write_all(text.as_bytes())?;
    Ok(())
}

fn read_config(path: &Path) -> Result<ModelConfig, PdctlError> {
    let parsed = if path.is_dir() {
        ModelConfig::from_dir(path)
    } else {
        ModelConfig::from_file(path)
    };
    parsed.map_err(|e| PdctlError::Model(format!("{}: {e}", path.display())))
}

/// Bytes from `141GB`, `139GiB`, `80G`, `1.5T` or a plain count.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size (e.g. 141GB, 139GiB, 80000000000)"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024f64.powi(2),
        "gib" => 1024f64.powi(3),
        "tib" => 1024f64.powi(4),
        other => {
            return Err(format!(
                "unknown unit {other:?} in {text:?} (use GB or GiB)"
            ));
        }
    };
    let bytes = (value * scale).round();
    if !(1.0..=1e18).contains(&bytes) {
        return Err(format!("{text:?} is not a plausible GPU memory size"));
    }
    Ok(bytes as u64)
}

fn parse_fraction(text: &str) -> Result<f64, String> {
    let v: f64 = text
        .parse()
        .map_err(|_| format!("{text:?} is not a number"))?;
    if v > 0.0 && v <= 1.0 {
        Ok(v)
    } else {
        Err(format!("utilization must be in (0, 1], got {v}"))
    }
}

struct Report<'a> {
    config: &'a ModelConfig,
    weights: &'a WeightPlan,
    /// One per storage, in `KvStorage::ALL`'s order (f32 first).
    states: &'a [StatePlan],
    kv: KvStorage,
    context: u64,
    fit: Option<&'a Fit>,
    /// GPUs in the group (`--gpus`, or the layout's).
    gpus: u64,
    group: Option<&'a group::GroupReport>,
    args: &'a PlanArgs,
}

fn linear_name(f: LinearFormat) -> &'static str {
    match f {
        LinearFormat::Bf16 => "bf16",
        LinearFormat::Fp8Block => "fp8-block",
    }
}

fn expert_name(f: ExpertFormat) -> &'static str {
    match f {
        ExpertFormat::Bf16 => "bf16",
        ExpertFormat::Fp8Block => "fp8-block",
        ExpertFormat::Mxfp4 => "mxfp4",
        ExpertFormat::Nvfp4 => "nvfp4",
    }
}

/// `1234567` as `1,234,567`.
fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

fn gb(bytes: u64) -> f64 {
    bytes as f64 / 1e9
}

impl Report<'_> {
    fn json(&self) -> Value {
        let c = self.config;
        let state = |s: &StatePlan| {
            json!({
                "kv": s.kv.name(),
                "page_size": s.page_size,
                "page_bytes": s.page_bytes,
                "bytes_per_token": s.bytes_per_token(),
                "slot_bytes": s.slot_bytes,
                "request_bytes": s.request_bytes(self.context),
                "kinds": s.kinds.iter().map(|k| json!({
                    "kind": k.kind.name(),
                    "layers": k.layers,
                    "bytes_per_token_per_layer": k.bytes_per_token,
                    "slot_bytes_per_layer": k.slot_bytes,
                })).collect::<Vec<_>>(),
            })
        };
        json!({
            "layers": c.num_layers(),
            "draft_stages": c.draft_layers.len(),
            "linear_format": linear_name(c.linear_format),
            "expert_format": expert_name(c.expert_format),
            "weight_bytes": self.weights.total,
            "weights": {
                "total_bytes": self.weights.total,
                "served_bytes": self.weights.served,
                "classes": self.weights.classes.iter().map(|k| json!({
                    "class": k.class.name(),
                    "bytes": k.bytes,
                    "tensors": k.tensors,
                    "served": k.class.served(),
                })).collect::<Vec<_>>(),
            },
            "context": self.context,
            "state": self.states.iter().map(|s| (s.kv.name().to_owned(), state(s)))
                .collect::<serde_json::Map<_, _>>(),
            "fit": self.fit.map(|f| json!({
                "kv": self.kv.name(),
                "gpu_memory_bytes": self.args.gpu_memory,
                "gpus": self.gpus,
                "utilization": self.args.utilization,
                "usable_bytes": f.usable_bytes,
                "weights_fit": f.weights_fit,
                "free_bytes": f.free_bytes,
                "pages": f.pages,
                "tokens": f.tokens,
                "requests_at_context": f.requests,
            })),
            "per_gpu": self.group.map(group::GroupReport::json),
        })
    }

    fn text(&self) -> String {
        use std::fmt::Write as _;
        let c = self.config;
        let mut out = String::new();
        let kinds: Vec<String> = self.states[0]
            .kinds
            .iter()
            .map(|k| format!("{} {}", k.layers, k.kind.name()))
            .collect();
        let _ = writeln!(
            out,
            "model: {} layers ({}), {} draft stage(s); linears {}, routed experts {}",
            c.num_layers(),
            kinds.join(", "),
            c.draft_layers.len(),
            linear_name(c.linear_format),
            expert_name(c.expert_format),
        );
        let _ = writeln!(out, "\nweights as stored");
        let _ = writeln!(
            out,
            "  {:<30} {:>19} {:>9} {:>8}",
            "class", "bytes", "GB", "tensors"
        );
        for k in &self.weights.classes {
            let name = if k.class.served() {
                k.class.name().to_owned()
            } else {
                format!("{} (not served)", k.class.name())
            };
            let _ = writeln!(
                out,
                "  {:<30} {:>19} {:>9.2} {:>8}",
                name,
                grouped(k.bytes),
                gb(k.bytes),
                k.tensors
            );
        }
        for (label, bytes) in [
            ("total (the shards' data)", self.weights.total),
            ("served (loaded by workers)", self.weights.served),
        ] {
            let _ = writeln!(
                out,
                "  {:<30} {:>19} {:>9.2}",
                label,
                grouped(bytes),
                gb(bytes)
            );
        }
        let _ = writeln!(
            out,
            "\nstate per token, pages of {} tokens (rows of every position are kept)",
            self.states[0].page_size
        );
        // One column per storage; every row a label and the states' cells.
        let mut row = |label: String, cells: Vec<String>| {
            let _ = write!(out, "  {label:<30}");
            for cell in cells {
                let _ = write!(out, " {cell:>14}");
            }
            out.push('\n');
        };
        let each = |f: &dyn Fn(&StatePlan) -> String| self.states.iter().map(f).collect();
        row(
            "bytes per token".to_owned(),
            each(&|s| s.kv.name().to_owned()),
        );
        for (i, k) in self.states[0].kinds.iter().enumerate() {
            row(
                format!("{} layer (x{})", k.kind.name(), k.layers),
                each(&|s| format!("{:.1}", s.kinds[i].bytes_per_token)),
            );
        }
        row(
            "all layers".to_owned(),
            each(&|s| format!("{:.1}", s.bytes_per_token())),
        );
        row(
            "slot per request (bytes)".to_owned(),
            each(&|s| grouped(s.slot_bytes)),
        );
        row(
            format!("request of {} tokens (GB)", self.context),
            each(&|s| format!("{:.3}", gb(s.request_bytes(self.context)))),
        );
        match self.fit {
            None => {
                let _ = writeln!(
                    out,
                    "\nfit: pass --gpu-memory (and --gpus) to size a GPU group"
                );
            }
            Some(f) => {
                let memory = self.args.gpu_memory.unwrap_or_default();
                let _ = writeln!(
                    out,
                    "\nfit: {} GPU(s) of {:.1} GB at {:.0}% = {:.1} GB usable, state stored as {}",
                    self.gpus,
                    gb(memory),
                    self.args.utilization * 100.0,
                    gb(f.usable_bytes),
                    self.kv.name(),
                );
                if f.weights_fit {
                    let _ = writeln!(
                        out,
                        "  served weights {:.1} GB; {:.1} GB left for state: {} pages = {} tokens, {} requests of {} tokens at once",
                        gb(self.weights.served),
                        gb(f.free_bytes),
                        grouped(f.pages),
                        grouped(f.tokens),
                        grouped(f.requests),
                        f.context,
                    );
                } else {
                    let _ = writeln!(
                        out,
                        "  served weights {:.1} GB do NOT fit in {:.1} GB usable: add GPUs",
                        gb(self.weights.served),
                        gb(f.usable_bytes)
                    );
                }
                let _ = writeln!(
                    out,
                    "  (weights counted as evenly sharded over the group; replicated tensors, activations and buffers are in the unused {:.0}%)",
                    (1.0 - self.args.utilization) * 100.0
                );
            }
        }
        if let Some(group) = self.group {
            group.text(&mut out);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_decimal_and_binary_units() {
        assert_eq!(parse_size("141GB"), Ok(141_000_000_000));
        assert_eq!(parse_size("139GiB"), Ok(139 * 1024 * 1024 * 1024));
        assert_eq!(parse_size("80g"), Ok(80_000_000_000));
        assert_eq!(parse_size("1.5T"), Ok(1_500_000_000_000));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("12 parsecs").unwrap_err().contains("unit"));
        assert!(parse_size("0GB").is_err());
    }

    #[test]
    fn utilization_is_a_fraction() {
        assert_eq!(parse_fraction("0.9"), Ok(0.9));
        assert!(parse_fraction("0").is_err());
        assert!(parse_fraction("1.5").is_err());
        assert!(parse_fraction("x").is_err());
    }

    #[test]
    fn grouped_digits() {
        assert_eq!(grouped(0), "0");
        assert_eq!(grouped(999), "999");
        assert_eq!(grouped(1000), "1,000");
        assert_eq!(grouped(159_600_177_736), "159,600,177,736");
    }
}
