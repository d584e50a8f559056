//! The worker settings' checks: each refusal names its key.

use super::*;

#[test]
fn defaults_are_valid_and_typed_choices_read_their_names() {
    let settings = WorkerSettings::listening_on(0);
    assert!(settings.validate().is_ok());
    let json = serde_json::to_value(&settings).unwrap();
    assert_eq!(json["backend"], "cpu");
    assert_eq!(json["transports"], serde_json::json!(["ucx", "tcp"]));
    let back: WorkerSettings = serde_json::from_value(json).unwrap();
    assert_eq!(back, settings);
    let bad = serde_json::json!({ "backend": "gpu" });
    let err = serde_json::from_value::<WorkerSettings>(bad).unwrap_err();
    assert!(
        err.to_string().contains("expected cpu, cuda or emulated"),
        "{err}"
    );
    let bad = serde_json::json!({ "transports": ["rdma"] });
    let err = serde_json::from_value::<WorkerSettings>(bad).unwrap_err();
    assert!(err.to_string().contains("unknown transport"), "{err}");
}

#[test]
fn shared_checks_name_their_key() {
    let mut settings = WorkerSettings::listening_on(0);
    settings.page_size = 48;
    assert_eq!(settings.validate().unwrap_err().key, "page_size");
    let mut settings = WorkerSettings::listening_on(0);
    settings.transports = vec![Transport(TransportKind::Tcp); 2];
    assert_eq!(settings.validate().unwrap_err().key, "transports");
    let mut settings = WorkerSettings::listening_on(0);
    settings.transports.clear();
    assert_eq!(settings.validate().unwrap_err().key, "transports");
}

/// Fast decode attention is honoured only where it runs (the device step of the cuda or
/// emulated backend, without hybrid, over FP8 rows), refused elsewhere naming the key.
#[test]
fn fast_decode_attention_needs_the_device_step_and_fp8_rows() {
    let mut settings = WorkerSettings::listening_on(0);
    settings.decode_attention = DecodeAttention::Fast;
    let e = settings.validate().unwrap_err();
    assert_eq!(e.key, "decode_attention", "{e:?}");
    assert!(e.reason.contains("cuda or emulated"), "{e:?}");
    settings.backend = BackendKind::Emulated;
    let e = settings.validate().unwrap_err();
    assert!(e.reason.contains("kv_cache_dtype"), "{e:?}");
    settings.kv_cache_dtype = KvCacheDtype::Fp8;
    assert!(settings.validate().is_ok());
    settings.hybrid = true;
    assert_eq!(settings.validate().unwrap_err().key, "decode_attention");
    settings.hybrid = false;
    // Expert-parallel ranks with data-parallel attention step on their devices too, and so
    // do tensor-parallel ranks (experts whole or split over the same ranks).
    settings.expert_parallel_size = 2;
    settings.dp_attention = true;
    assert!(settings.validate().is_ok());
    settings.dp_attention = false;
    settings.tensor_parallel_size = 2;
    assert!(settings.validate().is_ok());
    settings.expert_parallel_size = 1;
    assert!(settings.validate().is_ok());
    // Sliced experts step on the devices too: fast attention is honoured there.
    settings.moe_tensor_parallel = true;
    assert!(settings.validate().is_ok());
    settings.hybrid = true;
    assert_eq!(settings.validate().unwrap_err().key, "decode_attention");
    let mut json = serde_json::to_value(WorkerSettings::listening_on(0)).unwrap();
    assert_eq!(json["decode_attention"], "exact");
    json["decode_attention"] = serde_json::json!("fast");
    let back: WorkerSettings = serde_json::from_value(json).unwrap();
    assert_eq!(back.decode_attention, DecodeAttention::Fast);
}

/// Fast decode experts are honoured only where the device step runs, refused elsewhere
/// naming the key.
#[test]
fn fast_decode_experts_need_the_device_step() {
    let mut settings = WorkerSettings::listening_on(0);
    settings.decode_experts = DecodeExperts::Fast;
    let e = settings.validate().unwrap_err();
    assert_eq!(e.key, "decode_experts", "{e:?}");
    settings.backend = BackendKind::Emulated;
    assert!(settings.validate().is_ok());
    settings.hybrid = true;
    assert_eq!(settings.validate().unwrap_err().key, "decode_experts");
    let mut json = serde_json::to_value(WorkerSettings::listening_on(0)).unwrap();
    assert_eq!(json["decode_experts"], "exact");
    json["decode_experts"] = serde_json::json!("fast");
    let back: WorkerSettings = serde_json::from_value(json).unwrap();
    assert_eq!(back.decode_experts, DecodeExperts::Fast);
}

/// Fast decode linears are honoured only where the device step runs, refused elsewhere
/// naming the key.
#[test]
fn fast_decode_linears_need_the_device_step() {
    let mut settings = WorkerSettings::listening_on(0);
    settings.decode_linears = DecodeLinears::Fast;
    let e = settings.validate().unwrap_err();
    assert_eq!(e.key, "decode_linears", "{e:?}");
    settings.backend = BackendKind::Emulated;
    assert!(settings.validate().is_ok());
    settings.hybrid = true;
    assert_eq!(settings.validate().unwrap_err().key, "decode_linears");
    let mut json = serde_json::to_value(WorkerSettings::listening_on(0)).unwrap();
    assert_eq!(json["decode_linears"], "exact");
    json["decode_linears"] = serde_json::json!("fast");
    let back: WorkerSettings = serde_json::from_value(json).unwrap();
    assert_eq!(back.decode_linears, DecodeLinears::Fast);
}

/// Decode graphs are honoured only where the device step runs (cuda or emulated without
/// hybrid, one rank; a tensor-parallel group's ranks on emulated, the experts whole, split
/// or sliced over them), refused elsewhere naming the key: expert-parallel ranks with
/// their own requests (whose exchanges' sizes follow the routing), and a GPU group (its
/// NCCL collectives are not recorded).
#[test]
fn decode_graphs_need_the_device_step() {
    let mut settings = WorkerSettings::listening_on(0);
    settings.decode_graphs = true;
    let e = settings.validate().unwrap_err();
    assert_eq!(e.key, "decode_graphs", "{e:?}");
    assert!(e.reason.contains("cuda or emulated"), "{e:?}");
    settings.backend = BackendKind::Emulated;
    assert!(settings.validate().is_ok());
    settings.hybrid = true;
    assert_eq!(settings.validate().unwrap_err().key, "decode_graphs");
    settings.hybrid = false;
    settings.tensor_parallel_size = 2;
    assert!(settings.validate().is_ok());
    settings.expert_parallel_size = 2;
    assert!(settings.validate().is_ok());
    settings.expert_parallel_size = 1;
    settings.moe_tensor_parallel = true;
    assert!(settings.validate().is_ok());
    settings.moe_tensor_parallel = false;
    // (A build without the cuda feature refuses the backend first.)
    settings.backend = BackendKind::Cuda;
    let e = settings.graphs_refused().unwrap();
    assert!(e.contains("not recorded into graphs"), "{e}");
    settings.tensor_parallel_size = 1;
    assert_eq!(settings.graphs_refused(), None);
    settings.tensor_parallel_size = 2;
    settings.backend = BackendKind::Emulated;
    settings.tensor_parallel_size = 1;
    settings.expert_parallel_size = 2;
    settings.dp_attention = true;
    let e = settings.validate().unwrap_err();
    assert!(e.reason.contains("dp_attention"), "{e:?}");
    let mut json = serde_json::to_value(WorkerSettings::listening_on(0)).unwrap();
    assert_eq!(json["decode_graphs"], false);
    json["decode_graphs"] = serde_json::json!(true);
    let back: WorkerSettings = serde_json::from_value(json).unwrap();
    assert!(back.decode_graphs);
}

/// A group of ranks is honoured or refused with the setting to change, never run as
/// another layout.
#[test]
fn group_settings_are_checked_before_the_model_loads() {
    let mut settings = WorkerSettings::listening_on(0);
    settings.expert_parallel_size = 4;
    let e = settings.validate().unwrap_err();
    assert_eq!(e.key, "dp_attention", "{e:?}");
    settings.dp_attention = true;
    assert!(settings.validate().is_ok());
    let spec = settings.group_spec();
    assert_eq!((spec.ranks(), spec.parallel.ep), (4, 4));
    assert!(spec.threads_per_rank >= 1);
    settings.tensor_parallel_size = 2;
    assert_eq!(settings.validate().unwrap_err().key, "dp_attention");
    settings.dp_attention = false;
    assert_eq!(settings.validate().unwrap_err().key, "expert_parallel_size");
    settings.expert_parallel_size = 2;
    assert!(settings.validate().is_ok());
    assert_eq!(settings.group_spec().ranks(), 2);
    settings.tensor_parallel_size = 1;
    settings.dp_attention = true;
    settings.backend = BackendKind::Cuda;
    let e = settings.validate().unwrap_err();
    // Without the feature the backend itself is refused first.
    assert_eq!(e.key, "backend", "{e:?}");
    settings.backend = BackendKind::Cpu;
    settings.rank_timeout_ms = 5;
    assert_eq!(settings.validate().unwrap_err().key, "rank_timeout_ms");
}

/// Sliced experts need tensor-parallel ranks and no expert parallelism; with them the
/// group's layout carries the slicing.
#[test]
fn sliced_experts_need_tensor_parallel_ranks() {
    let mut settings = WorkerSettings::listening_on(0);
    settings.moe_tensor_parallel = true;
    let e = settings.validate().unwrap_err();
    assert_eq!(e.key, "moe_tensor_parallel", "{e:?}");
    assert!(e.reason.contains("tensor_parallel_size > 1"), "{e:?}");
    settings.tensor_parallel_size = 2;
    assert!(settings.validate().is_ok());
    let spec = settings.group_spec();
    assert!(spec.parallel.moe_tp);
    assert_eq!(spec.ranks(), 2);
    settings.expert_parallel_size = 2;
    assert_eq!(settings.validate().unwrap_err().key, "moe_tensor_parallel");
}

/// `hybrid` lets a device backend's missing ops fall back to the CPU: on the cpu backend it
/// would change nothing, so it is refused there.
#[test]
fn hybrid_is_refused_on_the_cpu_backend() {
    let mut settings = WorkerSettings::listening_on(0);
    settings.hybrid = true;
    let e = settings.validate().unwrap_err();
    assert_eq!(e.key, "hybrid", "{e:?}");
    settings.backend = BackendKind::Emulated;
    assert!(settings.validate().is_ok());
}
