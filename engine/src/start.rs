//! Starting an engine for a worker: its checkpoint loaded and fingerprinted, each rank's
//! backend or step device opened, one engine thread (a [`Runner`]) or a group of ranks in
//! lockstep ([`crate::parallel::group`]).

pub use crate::parallel::group::{MakeCollectives, OpenDecode};
use crate::{runner::Runner, scheduler::Engine};

/// An engine loaded for a worker: its thread, the layout it exposes to peers and the facts
/// about the model a worker needs.
#[derive(Debug, Clone)]
pub struct LoadedEngine {
    /// One runner per rank (one for a one-GPU worker).
    pub ranks: crate::parallel::group::Ranks,
    /// How the model is spread over the ranks.
    pub group: crate::parallel::group::GroupSpec,
    pub layout: proto::v1::StateLayout,
    pub eos_token_ids: Vec<u32>,
    pub vocab_size: usize,
    pub fingerprint: String,
    /// Where the forward pass's ops run; `None`: all on the CPU reference.
    pub backend_plan: Option<crate::backend::BackendPlan>,
}

/// Why an engine did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The checkpoint did not load (or its fingerprint could not be computed).
    #[error(transparent)]
    Load(#[from] crate::weights::LoadError),
    /// The compute backend could not start, or cannot serve this model as configured.
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendError),
    /// The engine refused its configuration.
    #[error(transparent)]
    Engine(#[from] crate::scheduler::EngineError),
    /// The engine thread could not be started.
    #[error("cannot start the engine thread: {0}")]
    Thread(#[from] std::io::Error),
    /// The worker's ranks could not start as configured.
    #[error("{0}")]
    Group(#[from] crate::parallel::group::GroupError),
    /// The state pools would not fit the host's memory.
    #[error("{0}")]
    Memory(String),
}

/// Loads the checkpoint at `dir`, computes its fingerprint, builds the engine and starts its
/// thread (all on the CPU reference).
pub fn start_from_dir(
    dir: &std::path::Path,
    config: crate::scheduler::EngineConfig,
    thread_name: &str,
) -> Result<LoadedEngine, StartError> {
    let progress = std::sync::Arc::new(crate::weights::LoadProgress::new());
    start_with_backend(
        dir,
        config,
        thread_name,
        RankDevices::CPU,
        crate::parallel::group::GroupSpec::SINGLE,
        &progress,
    )
}

/// Opens rank `rank`'s compute backend for a loaded model (`None`: the CPU reference only).
pub type OpenBackend<'a> = &'a dyn Fn(
    &std::path::Path,
    &crate::config::ModelConfig,
    usize,
) -> Result<
    Option<std::sync::Arc<dyn crate::backend::Backend>>,
    crate::backend::BackendError,
>;

/// Where a worker's ranks compute: each rank's backend (rank r on its own device), whether ops
/// the backend does not run may stay on the CPU (`hybrid`), the collectives of the model's
/// groups (`None`: in-process, for ranks on the CPU or sharing host memory), and the device a
/// one-rank engine decodes on (`decode`: then no backend is attached, the decode steps run
/// whole on the device and the host forward computes only prompts).
#[derive(Clone, Copy)]
pub struct RankDevices<'a> {
    pub open: OpenBackend<'a>,
    pub hybrid: bool,
    pub collectives: Option<MakeCollectives<'a>>,
    pub decode: Option<OpenDecode<'a>>,
    /// The engines take requests only with their prompts' state (a decode worker's:
    /// [`Engine::set_decode_only`]).
    pub decode_only: bool,
}

impl std::fmt::Debug for RankDevices<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankDevices")
            .field("hybrid", &self.hybrid)
            .field("collectives", &self.collectives.is_some())
            .finish_non_exhaustive()
    }
}

impl RankDevices<'static> {
    /// Every rank on the CPU reference, in-process collectives.
    pub const CPU: Self = Self {
        open: &|_, _, _| Ok(None),
        hybrid: false,
        collectives: None,
        decode: None,
        decode_only: false,
    };
}

/// [`start_from_dir`] with each rank's backend (`devices.open`) attached to its model; a
/// backend that does not run every op is refused unless `devices.hybrid` (see
/// `engine::backend`). With more than one rank in `group`, one engine per rank starts in
/// lockstep, rank r with the backend opened for r and its groups' collectives from
/// `devices.collectives`. How far the weights check is (the part of starting that takes
/// minutes on a large checkpoint) shows in `progress` while this runs.
pub fn start_with_backend(
    dir: &std::path::Path,
    config: crate::scheduler::EngineConfig,
    thread_name: &str,
    devices: RankDevices<'_>,
    group: crate::parallel::group::GroupSpec,
    progress: &std::sync::Arc<crate::weights::LoadProgress>,
) -> Result<LoadedEngine, StartError> {
    use crate::parallel::group::{self, GroupError};
    let fingerprint = crate::weights::fingerprint(dir)?;
    let mut model = crate::model::Model::load_with_progress(dir, progress)?;
    group
        .check(&model.config)
        .map_err(|e| StartError::Group(GroupError::Refused(e)))?;
    // Refused now rather than killed later, when requests fill pools the host cannot hold.
    if let Some(available) = crate::plan::host::available_memory() {
        crate::plan::host::check_pools(&model.config, &config, group.ranks(), available)
            .map_err(StartError::Memory)?;
    }
    if let Some(open_decode) = devices.decode.filter(|_| group.ranks() == 1) {
        return start_decoding_on_device(
            model,
            config,
            (dir, &fingerprint),
            thread_name,
            (group, devices.decode_only),
            open_decode,
        );
    }
    let mut backends = Vec::with_capacity(group.ranks());
    for rank in 0..group.ranks() {
        // Ranks stepping on their devices have no per-op backend.
        let backend = match devices.decode {
            Some(_) => None,
            None => (devices.open)(dir, &model.config, rank)?,
        };
        backends.push(backend);
    }
    let mut backend_plan = match backends.first().cloned().flatten() {
        Some(backend) if group.ranks() == 1 => Some(model.attach_backend(backend, devices.hybrid)?),
        Some(backend) => Some(crate::backend::BackendPlan::decide(
            backend.as_ref(),
            devices.hybrid,
        )?),
        None => None,
    };
    let eos_token_ids = model.config.eos_token_ids.clone();
    let vocab_size = model.config.vocab_size;
    let table = crate::grammar::TokenTableSource::from_dir(dir, vocab_size, &eos_token_ids);
    // Each rank's device, the first one's plan kept for the log.
    let first_plan = std::sync::Mutex::new(None);
    let open_rank =
        |model: &crate::model::Model, config: &crate::scheduler::EngineConfig, rank: usize| {
            let open = devices
                .decode
                .ok_or_else(|| crate::backend::BackendError::Unavailable {
                    backend: "step device".to_owned(),
                    reason: "none to open".to_owned(),
                })?;
            let device = open(model, config, rank)?;
            if rank == 0 {
                *first_plan
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(device_plan(
                    device.as_ref(),
                    &group.parallel.describe_ranks(),
                ));
            }
            Ok(device)
        };
    let (ranks, layout) = if group.ranks() > 1 {
        let ranks = group::RankSetup {
            backends,
            hybrid: devices.hybrid,
            collectives: devices.collectives,
            decode: devices.decode.map(|_| &open_rank as OpenDecode<'_>),
        };
        let started = group::start(
            model,
            &config,
            &fingerprint,
            (group, ranks),
            thread_name,
            &|e| {
                e.set_token_table(table.clone());
                if devices.decode_only {
                    e.set_decode_only();
                }
            },
        )?;
        if let Some(plan) = first_plan
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
        {
            backend_plan = Some(plan);
        }
        started
    } else {
        let decode_only = devices.decode_only;
        let start = (
            move |e: &mut Engine| {
                if decode_only {
                    e.set_decode_only();
                }
                Ok(())
            },
            backend_plan,
        );
        return start_single(
            model,
            config,
            (dir, &fingerprint),
            (thread_name, group),
            start,
        );
    };
    Ok(LoadedEngine {
        ranks,
        group,
        layout,
        eos_token_ids,
        vocab_size,
        fingerprint,
        backend_plan,
    })
}

/// One engine thread of `model` (its token table from `dir`), `setup` run on the engine first;
/// its plan says what the backend runs.
fn start_single(
    model: crate::model::Model,
    config: crate::scheduler::EngineConfig,
    (dir, fingerprint): (&std::path::Path, &str),
    (thread_name, group): (&str, crate::parallel::group::GroupSpec),
    (setup, backend_plan): (
        impl FnOnce(&mut Engine) -> Result<(), StartError>,
        Option<crate::backend::BackendPlan>,
    ),
) -> Result<LoadedEngine, StartError> {
    let eos_token_ids = model.config.eos_token_ids.clone();
    let vocab_size = model.config.vocab_size;
    let table = crate::grammar::TokenTableSource::from_dir(dir, vocab_size, &eos_token_ids);
    let mut engine = Engine::new(model, config, fingerprint)?;
    setup(&mut engine)?;
    engine.set_token_table(table);
    let layout = engine.store().layout.to_proto();
    Ok(LoadedEngine {
        ranks: crate::parallel::group::Ranks::single(Runner::start(engine, thread_name)?),
        group,
        layout,
        eos_token_ids,
        vocab_size,
        fingerprint: fingerprint.to_owned(),
        backend_plan,
    })
}

/// [`start_with_backend`] for an engine whose decode steps run whole on the device
/// `open_decode` opens (one rank; no backend attached: prompts compute there too where it steps
/// them, on the host reference otherwise).
fn start_decoding_on_device(
    mut model: crate::model::Model,
    config: crate::scheduler::EngineConfig,
    (dir, fingerprint): (&std::path::Path, &str),
    thread_name: &str,
    (group, decode_only): (crate::parallel::group::GroupSpec, bool),
    open_decode: OpenDecode<'_>,
) -> Result<LoadedEngine, StartError> {
    // The device rounds K=V rows as the engine will store them.
    model.set_kv_storage(config.kv);
    let device = open_decode(&model, &config, 0)?;
    let backend_plan = device_plan(device.as_ref(), "");
    let setup = move |engine: &mut Engine| {
        if decode_only {
            engine.set_decode_only();
        }
        Ok(engine.set_step_device(device)?)
    };
    start_single(
        model,
        config,
        (dir, fingerprint),
        (thread_name, group),
        (setup, Some(backend_plan)),
    )
}

/// The plan an engine stepping on `device` logs (`ranks` > 1: each rank of an expert-parallel
/// group on its own).
pub(crate) fn device_plan(
    device: &dyn crate::scheduler::StepDevice,
    group: &str,
) -> crate::backend::BackendPlan {
    let what = if device.prompt_chunk() > 0 {
        "whole steps on the device"
    } else {
        "the whole decode step on the device"
    };
    crate::backend::BackendPlan {
        backend: format!("{} ({what}{group})", device.name()),
        on_device: crate::backend::Op::ALL.to_vec(),
        on_cpu: Vec::new(),
    }
}
