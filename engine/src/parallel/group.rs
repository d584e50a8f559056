//! A worker's ranks as its services see them: one [`Runner`] per rank (rank `r` is the `r`-th
//! GPU of the worker's group, or the `r`-th CPU rank), the group's failure once its lockstep is
//! lost, and the per-rank load that places requests. Under data-parallel attention a request
//! lives whole on one rank, so every call about it goes to that rank's runner.

use std::{sync::Arc, time::Duration};

use super::{
    collective::{Collective, InProcessGroup},
    expert::ExpertParallel,
    ranks::Failure,
    tensor::TensorParallel,
};
use crate::{
    model::Model,
    plan::shard::Parallel,
    runner::{Job, Runner, Stopped, Subscribers, Wake},
    scheduler::{Engine, EngineConfig, EngineError},
};

/// How a worker spreads its model over ranks, validated against the model by [`GroupSpec::check`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupSpec {
    /// Attention heads (`tp`), experts (`ep`) and whether attention goes by requests.
    pub parallel: Parallel,
    /// How long a rank waits in a collective for its peers before the group fails.
    pub timeout: Duration,
    /// Compute threads of each rank's own pool (CPU ranks).
    pub threads_per_rank: usize,
}

impl GroupSpec {
    /// One rank: the plain engine.
    pub const SINGLE: Self = Self {
        parallel: Parallel::SINGLE,
        timeout: Duration::from_secs(30),
        threads_per_rank: 1,
    };

    pub fn ranks(&self) -> usize {
        self.parallel.gpus()
    }

    /// Whether this group can serve `model`, with the reason when not.
    pub fn check(&self, model: &crate::config::ModelConfig) -> Result<(), String> {
        let p = self.parallel;
        p.validate(model)?;
        if p.ep > 1 && p.tp > 1 && p.ep != p.tp {
            return Err(format!(
                "ep {} with tp {}: the experts are split over the same ranks as the heads",
                p.ep, p.tp
            ));
        }
        if self.ranks() > 1 && p.tp == 1 && !p.dp_attention {
            return Err(format!(
                "a group of {} ranks with tp 1 runs attention by requests: add --dp-attention",
                self.ranks()
            ));
        }
        Ok(())
    }

    /// The layout workers publish.
    pub fn to_proto(self) -> proto::v1::GroupLayout {
        let n = |x: usize| u32::try_from(x).unwrap_or(u32::MAX);
        proto::v1::GroupLayout {
            ranks: n(self.ranks()),
            tp: n(self.parallel.tp),
            ep: n(self.parallel.ep),
            dp_attention: self.parallel.dp_attention,
            moe_tp: self.parallel.moe_tp,
        }
    }
}

/// Handles to a worker's ranks; cheap to clone.
#[derive(Debug, Clone)]
pub struct Ranks {
    runners: Vec<Runner>,
    failure: Arc<Failure>,
    /// Every rank runs every request (tensor parallelism): calls go to all ranks.
    replicated: Option<Replicated>,
}

/// The group queue of a replicated group: jobs every rank applies before the same step.
#[derive(Debug, Clone)]
struct Replicated {
    queues: Vec<std::sync::mpsc::Sender<Job>>,
    wake: Arc<Wake>,
    /// Held while a job is queued on every rank, so all ranks see the jobs in one order.
    order: Arc<std::sync::Mutex<()>>,
}

impl Ranks {
    /// A one-rank worker.
    pub fn single(runner: Runner) -> Self {
        Self {
            runners: vec![runner],
            failure: Arc::default(),
            replicated: None,
        }
    }

    pub(crate) fn new(runners: Vec<Runner>, failure: Arc<Failure>) -> Self {
        Self {
            runners,
            failure,
            replicated: None,
        }
    }

    /// Starts one thread per engine ([`super::ranks::start`]); with `replicated` every rank
    /// runs every request (tensor-parallel attention): calls go to all ranks ([`Ranks::call`])
    /// and each rank applies them at the same step.
    pub(crate) fn start(
        engines: Vec<Engine>,
        control: Vec<Box<dyn Collective>>,
        name: &str,
        threads: usize,
        replicated: bool,
    ) -> std::io::Result<Self> {
        let started = super::ranks::start(engines, control, name, threads)?;
        let ranks = Self::new(started.runners, started.failure);
        Ok(if replicated {
            ranks.replicated(started.shared, started.wake)
        } else {
            ranks
        })
    }

    /// These ranks with every call going to all of them through their group `queues`.
    pub(crate) fn replicated(
        mut self,
        queues: Vec<std::sync::mpsc::Sender<Job>>,
        wake: Arc<Wake>,
    ) -> Self {
        self.replicated = Some(Replicated {
            queues,
            wake,
            order: Arc::default(),
        });
        self
    }

    /// Whether every rank runs every request (tensor-parallel attention); callers then place
    /// requests on rank 0, and their calls reach every rank.
    pub fn is_replicated(&self) -> bool {
        self.replicated.is_some()
    }

    /// Ranks a new request may be placed on: every rank, or rank 0 alone when every rank runs
    /// every request.
    pub fn placeable(&self) -> usize {
        if self.is_replicated() {
            1
        } else {
            self.runners.len()
        }
    }

    pub fn len(&self) -> usize {
        self.runners.len()
    }

    pub fn is_empty(&self) -> bool {
        self.runners.is_empty()
    }

    /// Rank `rank`'s runner.
    pub fn get(&self, rank: usize) -> Option<&Runner> {
        self.runners.get(rank)
    }

    /// Rank 0 (the only rank of a one-rank worker).
    ///
    /// # Panics
    /// Never: a group has at least one rank.
    pub fn first(&self) -> &Runner {
        &self.runners[0]
    }

    pub fn runners(&self) -> &[Runner] {
        &self.runners
    }

    /// Why the group stopped serving, once it has.
    pub fn failure(&self) -> Option<String> {
        self.failure.reason()
    }

    /// Resolves when the group fails, with the reason (never, for a group that does not).
    pub async fn failed(&self) -> String {
        let mut rx = self.failure.subscribe();
        let reason = rx
            .wait_for(Option::is_some)
            .await
            .map(|reason| reason.clone().unwrap_or_default());
        match reason {
            Ok(reason) => reason,
            // The sender lives as long as `self`: unreachable, but never resolve wrongly.
            Err(_) => std::future::pending().await,
        }
    }

    /// [`Runner::call`] on rank `rank`, which fails (rather than waiting forever on a hung
    /// rank) once the group has failed. In a replicated group `f` runs on every rank, before
    /// the same step, and rank 0's result is returned.
    pub async fn call<R: Send + 'static>(
        &self,
        rank: usize,
        f: impl Fn(&mut Engine, &mut Subscribers) -> R + Send + Sync + 'static,
    ) -> Result<R, Stopped> {
        if self.replicated.is_some() {
            return self
                .call_each(0, f)
                .await?
                .into_iter()
                .next()
                .ok_or(Stopped);
        }
        self.call_one(rank, f).await
    }

    /// `f` on rank `rank` alone, failing once the group has failed.
    async fn call_one<R: Send + 'static>(
        &self,
        rank: usize,
        f: impl FnOnce(&mut Engine, &mut Subscribers) -> R + Send + 'static,
    ) -> Result<R, Stopped> {
        let runner = self.runners.get(rank).ok_or(Stopped)?;
        if self.runners.len() == 1 {
            return runner.call(f).await;
        }
        tokio::select! {
            r = runner.call(f) => r,
            _ = self.failed() => Err(Stopped),
        }
    }

    /// `f` on every rank of a replicated group (all before the same step), each rank's result
    /// in rank order; on a group that is not replicated, on rank `rank` only.
    pub async fn call_each<R: Send + 'static>(
        &self,
        rank: usize,
        f: impl Fn(&mut Engine, &mut Subscribers) -> R + Send + Sync + 'static,
    ) -> Result<Vec<R>, Stopped> {
        let Some(group) = &self.replicated else {
            return Ok(vec![self.call_one(rank, f).await?]);
        };
        let f = Arc::new(f);
        let mut answers = Vec::with_capacity(group.queues.len());
        {
            let _order = group
                .order
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for queue in &group.queues {
                let (tx, rx) = tokio::sync::oneshot::channel();
                let f = Arc::clone(&f);
                let job: Job = Box::new(move |engine, subs| {
                    let _ = tx.send(f(engine, subs));
                });
                queue.send(job).map_err(|_| Stopped)?;
                answers.push(rx);
            }
        }
        group.wake.bump();
        let all = async {
            let mut out = Vec::with_capacity(answers.len());
            for rx in answers {
                out.push(rx.await.map_err(|_| Stopped)?);
            }
            Ok(out)
        };
        tokio::select! {
            r = all => r,
            _ = self.failed() => Err(Stopped),
        }
    }

    /// [`Runner::post`] on rank `rank` (on every rank of a replicated group), without waiting.
    pub fn post(
        &self,
        rank: usize,
        f: impl Fn(&mut Engine, &mut Subscribers) + Send + Sync + 'static,
    ) -> Result<(), Stopped> {
        let Some(group) = &self.replicated else {
            return self.runners.get(rank).ok_or(Stopped)?.post(f);
        };
        let f = Arc::new(f);
        {
            let _order = group
                .order
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for queue in &group.queues {
                let f = Arc::clone(&f);
                queue
                    .send(Box::new(move |engine, subs| f(engine, subs)))
                    .map_err(|_| Stopped)?;
            }
        }
        group.wake.bump();
        Ok(())
    }

    /// Each rank's load, in rank order (read between steps, outside the group's order).
    pub async fn loads(&self) -> Result<Vec<proto::v1::Load>, Stopped> {
        let mut out = Vec::with_capacity(self.runners.len());
        for runner in &self.runners {
            let load = runner.call(|engine, _| Runner::load_of(engine));
            out.push(tokio::select! {
                r = load => r?,
                _ = self.failed() => return Err(Stopped),
            });
        }
        Ok(out)
    }

    /// The worker's load: the ranks' sums, with each rank's own when there are several. In a
    /// replicated group every rank holds the same requests and a copy of their state, so the
    /// totals are rank 0's (one pool's worth), with every rank's own listed.
    pub async fn load(&self) -> Result<proto::v1::Load, Stopped> {
        let loads = self.loads().await?;
        if self.is_replicated() {
            let mut first = loads.first().cloned().unwrap_or_default();
            first.ranks = loads;
            return Ok(first);
        }
        Ok(sum_loads(loads))
    }
}

/// The sums of per-rank `loads`, listing them when there are several.
pub fn sum_loads(loads: Vec<proto::v1::Load>) -> proto::v1::Load {
    let mut total = proto::v1::Load::default();
    for l in &loads {
        total.running_requests = total.running_requests.saturating_add(l.running_requests);
        total.queued_requests = total.queued_requests.saturating_add(l.queued_requests);
        total.pages_total = total.pages_total.saturating_add(l.pages_total);
        total.pages_used = total.pages_used.saturating_add(l.pages_used);
        total.pages_cached = total.pages_cached.saturating_add(l.pages_cached);
        total.reservations = total.reservations.saturating_add(l.reservations);
    }
    if loads.len() > 1 {
        total.ranks = loads;
    }
    total
}

/// Pages a rank can still give (free, or held only by the prefix cache).
pub fn free_pages(load: &proto::v1::Load) -> u64 {
    load.pages_total
        .saturating_sub(load.pages_used.saturating_sub(load.pages_cached))
}

/// The ranks of `loads` from the best place for a new request to the worst: most free pages
/// first, then fewest requests, then lowest rank.
pub fn ranks_by_room(loads: &[proto::v1::Load]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..loads.len()).collect();
    order.sort_by_key(|&r| {
        let l = &loads[r];
        (
            std::cmp::Reverse(free_pages(l)),
            l.running_requests.saturating_add(l.queued_requests),
            r,
        )
    });
    order
}

/// How many more requests than the least busy rank a rank holding a longer cached prefix of
/// the prompt may have and still be chosen (computing a prefix costs more than waiting a little
/// behind a few requests).
pub const PREFIX_SLACK: u32 = 4;

/// The rank to compute a prompt on, from each rank's load and how many of the prompt's blocks
/// its prefix cache holds: the rank with the longest cached prefix unless it has more than
/// [`PREFIX_SLACK`] requests beyond the least busy rank; otherwise the least busy (fewest
/// requests, then most free pages, then the lowest rank).
pub fn prompt_rank(loads: &[proto::v1::Load], cached: &[usize]) -> usize {
    let busy = |r: usize| {
        loads.get(r).map_or(u32::MAX, |l| {
            l.running_requests.saturating_add(l.queued_requests)
        })
    };
    let least = (0..loads.len())
        .min_by_key(|&r| {
            (
                busy(r),
                std::cmp::Reverse(loads.get(r).map_or(0, free_pages)),
                r,
            )
        })
        .unwrap_or(0);
    let best = (0..loads.len())
        .max_by_key(|&r| (cached.get(r).copied().unwrap_or(0), std::cmp::Reverse(r)))
        .unwrap_or(0);
    let longer = cached.get(best).copied().unwrap_or(0) > cached.get(least).copied().unwrap_or(0);
    if longer && busy(best) <= busy(least).saturating_add(PREFIX_SLACK) {
        best
    } else {
        least
    }
}

/// Why a group did not start.
#[derive(Debug, thiserror::Error)]
pub enum GroupError {
    /// The group cannot serve this model (or this backend) as configured.
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("cannot start the ranks' threads: {0}")]
    Thread(#[from] std::io::Error),
}

/// Makes one collective per rank for a group of `n` ranks that waits at most the timeout.
pub type MakeCollectives<'a> =
    &'a dyn Fn(
        usize,
        std::time::Duration,
    ) -> Result<Vec<Box<dyn crate::parallel::collective::Collective>>, String>;

/// Opens the device an engine steps its decode tokens on (and its prompt chunks, where the
/// device steps them), for rank `rank`'s model (a rank of an expert-parallel group: the device
/// exchanges over the model's group) and the engine's configuration.
pub type OpenDecode<'a> =
    &'a dyn Fn(
        &crate::model::Model,
        &crate::scheduler::EngineConfig,
        usize,
    ) -> Result<Box<dyn crate::scheduler::StepDevice>, crate::backend::BackendError>;

/// What each rank of a group computes with: its backend (rank r's device; `None`: the CPU
/// reference), whether ops its backend does not run may stay on the CPU, and the collectives
/// of the model's groups (`None`: in-process).
pub struct RankSetup<'a> {
    pub backends: Vec<Option<Arc<dyn crate::backend::Backend>>>,
    pub hybrid: bool,
    pub collectives: Option<MakeCollectives<'a>>,
    /// Each rank's step device (rank r's opened for its model): then every rank steps there,
    /// exchanging its routed experts' pairs over its expert-parallel group.
    pub decode: Option<OpenDecode<'a>>,
}

impl std::fmt::Debug for RankSetup<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankSetup")
            .field("backends", &self.backends.len())
            .field("hybrid", &self.hybrid)
            .field("collectives", &self.collectives.is_some())
            .finish()
    }
}

impl RankSetup<'static> {
    /// `n` ranks on the CPU reference with in-process collectives.
    pub fn cpu(n: usize) -> Self {
        Self {
            backends: vec![None; n],
            hybrid: false,
            collectives: None,
            decode: None,
        }
    }
}

/// One engine per rank of `spec` over `model` (each rank a replica reading the same mapped
/// checkpoint; with `ep` > 1 a rank computes only the experts it holds), started in lockstep,
/// rank r with `setup`'s backend r attached and its groups' collectives. `prepare` runs on each
/// engine before it starts (token tables, observers). Returns the ranks and their state layout
/// (the same on every rank).
pub fn start(
    model: Model,
    config: &EngineConfig,
    fingerprint: &str,
    (spec, setup): (GroupSpec, RankSetup<'_>),
    name: &str,
    prepare: &dyn Fn(&mut Engine),
) -> Result<(Ranks, proto::v1::StateLayout), GroupError> {
    spec.check(&model.config).map_err(GroupError::Refused)?;
    let n = spec.ranks();
    if setup.backends.len() != n {
        return Err(GroupError::Refused(format!(
            "{} backends for a group of {n} ranks",
            setup.backends.len()
        )));
    }
    let experts = model.config.n_routed_experts;
    let make =
        |wanted: bool| -> Result<Option<std::vec::IntoIter<Box<dyn Collective>>>, GroupError> {
            if !wanted {
                return Ok(None);
            }
            let ranks = match setup.collectives {
                Some(make) => make(n, spec.timeout).map_err(GroupError::Refused)?,
                None => InProcessGroup::new(n, spec.timeout)
                    .into_iter()
                    .map(|r| Box::new(r) as Box<dyn Collective>)
                    .collect(),
            };
            if ranks.len() != n {
                return Err(GroupError::Refused(format!(
                    "{} collectives for a group of {n} ranks",
                    ranks.len()
                )));
            }
            Ok(Some(ranks.into_iter()))
        };
    let mut expert_ranks = make(spec.parallel.ep > 1)?;
    let mut head_ranks = make(spec.parallel.tp > 1)?;
    let mut slice_ranks = make(spec.parallel.moe_tp)?;
    let inter = model.config.moe_intermediate_size;
    let mut models: Vec<Model> = (1..n).map(|_| model.replica()).collect();
    models.push(model);
    let mut engines = Vec::with_capacity(n);
    // Each rank's step device (its name and prompt chunk), where it has one.
    let mut stepping: Vec<Option<(String, usize)>> = Vec::with_capacity(n);
    for (rank, (mut replica, backend)) in models.into_iter().zip(setup.backends).enumerate() {
        if let Some(backend) = backend {
            replica
                .attach_backend(backend, setup.hybrid)
                .map_err(|e| GroupError::Refused(e.to_string()))?;
        }
        if let Some(ranks) = expert_ranks.as_mut()
            && let Some(rank) = ranks.next()
        {
            let ep = ExpertParallel::new(rank, experts).map_err(GroupError::Refused)?;
            replica.set_expert_parallel(Arc::new(ep));
        }
        if let Some(ranks) = head_ranks.as_mut()
            && let Some(rank) = ranks.next()
        {
            let tp = TensorParallel::new(rank, &replica.config).map_err(GroupError::Refused)?;
            replica.set_tensor_parallel(Arc::new(tp));
        }
        if let Some(ranks) = slice_ranks.as_mut()
            && let Some(rank) = ranks.next()
        {
            let sliced = crate::parallel::sliced::SlicedExperts::new(rank, inter)
                .map_err(GroupError::Refused)?;
            replica.set_sliced_experts(Arc::new(sliced));
        }
        let device = match setup.decode {
            Some(open) => {
                // The device rounds K=V rows as the engine will store them.
                replica.set_kv_storage(config.kv);
                Some(open(&replica, config, rank).map_err(|e| GroupError::Refused(e.to_string()))?)
            }
            None => None,
        };
        // The ranks meet at every exchange of every phase: they must step alike.
        let steps = device
            .as_ref()
            .map(|d| (d.name().to_owned(), d.prompt_chunk()));
        if let Some(first) = stepping.first()
            && *first != steps
        {
            return Err(GroupError::Refused(format!(
                "rank {rank} steps {} and rank 0 {}: a group's ranks step alike (each meets \
                 the others' exchanges)",
                describe_steps(steps.as_ref()),
                describe_steps(first.as_ref())
            )));
        }
        stepping.push(steps);
        let mut engine = Engine::new(replica, config.clone(), fingerprint)?;
        if let Some(device) = device {
            engine
                .set_step_device(device)
                .map_err(|e| GroupError::Refused(e.to_string()))?;
        }
        prepare(&mut engine);
        engines.push(engine);
    }
    let layout = engines
        .first()
        .map(|e| e.store().layout.to_proto())
        .unwrap_or_default();
    let control = InProcessGroup::new(n, spec.timeout)
        .into_iter()
        .map(|r| Box::new(r) as Box<dyn super::collective::Collective>)
        .collect();
    let replicated = spec.parallel.tp > 1;
    let ranks = Ranks::start(engines, control, name, spec.threads_per_rank, replicated)?;
    Ok((ranks, layout))
}

/// How a rank steps, in words: its step device (name, prompt chunk) or the host forward.
fn describe_steps(steps: Option<&(String, usize)>) -> String {
    match steps {
        None => "on the host forward".to_owned(),
        Some((name, 0)) => format!("on {name} (prompts on the host)"),
        Some((name, chunk)) => format!("on {name} (prompt chunk {chunk})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(total: u64, used: u64, cached: u64, running: u32) -> proto::v1::Load {
        proto::v1::Load {
            running_requests: running,
            pages_total: total,
            pages_used: used,
            pages_cached: cached,
            ..proto::v1::Load::default()
        }
    }

    #[test]
    fn requests_go_where_the_most_pages_are_free() {
        let loads = [
            load(100, 90, 0, 1),
            load(100, 50, 40, 3),
            load(100, 50, 0, 0),
        ];
        // Rank 1's cached pages can be evicted: 90 free, against 50 and 10.
        assert_eq!(ranks_by_room(&loads), vec![1, 2, 0]);
        // Ties go to the rank with fewer requests, then the lower rank.
        let loads = [load(10, 0, 0, 2), load(10, 0, 0, 1), load(10, 0, 0, 1)];
        assert_eq!(ranks_by_room(&loads), vec![1, 2, 0]);
        let total = sum_loads(loads.to_vec());
        assert_eq!((total.pages_total, total.running_requests), (30, 4));
        assert_eq!(total.ranks.len(), 3);
        assert!(sum_loads(vec![load(10, 1, 0, 0)]).ranks.is_empty());
    }

    #[test]
    fn a_prompt_goes_where_its_prefix_is_cached_unless_that_rank_is_much_busier() {
        let loads = [load(100, 10, 0, 3), load(100, 0, 0, 0), load(100, 50, 0, 0)];
        // Nothing cached: the least busy, then most free pages.
        assert_eq!(prompt_rank(&loads, &[0, 0, 0]), 1);
        // Rank 0 holds 5 blocks and has 3 requests more than the least busy: taken.
        assert_eq!(prompt_rank(&loads, &[5, 0, 0]), 0);
        // The longest prefix wins among several.
        assert_eq!(prompt_rank(&loads, &[2, 0, 4]), 2);
        // Beyond the slack, the prefix is computed again on the least busy rank.
        let busy = [load(100, 10, 0, PREFIX_SLACK + 1), load(100, 0, 0, 0)];
        assert_eq!(prompt_rank(&busy, &[5, 0]), 1);
        // Equal prefixes: the least busy.
        assert_eq!(prompt_rank(&loads, &[3, 3, 3]), 1);
    }

    #[test]
    fn a_group_is_refused_with_its_reason() {
        let c = crate::synth::Preset::Tiny.config(crate::config::ExpertFormat::Nvfp4);
        let spec = |tp, ep, dp_attention| GroupSpec {
            parallel: Parallel {
                tp,
                ep,
                dp_attention,
                moe_tp: false,
            },
            ..GroupSpec::SINGLE
        };
        assert_eq!(spec(1, 1, false).check(&c), Ok(()));
        assert_eq!(spec(1, 2, true).check(&c), Ok(()));
        let e = spec(1, 2, false).check(&c).unwrap_err();
        assert!(e.contains("--dp-attention"), "{e}");
        assert_eq!(spec(2, 2, false).check(&c), Ok(()));
        assert_eq!(spec(2, 1, false).check(&c), Ok(()));
        let e = spec(2, 2, true).check(&c).unwrap_err();
        assert!(e.contains("tp must be 1"), "{e}");
        let e = spec(4, 1, false).check(&c).unwrap_err();
        assert!(e.contains("output groups"), "{e}");
        let odd = c.n_routed_experts + 1;
        let e = spec(1, odd, true).check(&c).unwrap_err();
        assert!(e.contains("routed experts"), "{e}");
    }

    mod placement {
        use proptest::prelude::*;

        use super::super::*;

        fn loads() -> impl Strategy<Value = Vec<proto::v1::Load>> {
            prop::collection::vec((0u64..100, 0u64..100, 0u64..100, 0u32..10, 0u32..10), 1..8)
                .prop_map(|rows| {
                    rows.into_iter()
                        .map(|(total, used, cached, running, queued)| proto::v1::Load {
                            pages_total: total,
                            pages_used: used.min(total),
                            pages_cached: cached.min(used.min(total)),
                            running_requests: running,
                            queued_requests: queued,
                            ..proto::v1::Load::default()
                        })
                        .collect()
                })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]

            /// Every rank is tried once, the ones with more free pages first.
            #[test]
            fn ranks_by_room_is_a_permutation_by_free_pages(loads in loads()) {
                let order = ranks_by_room(&loads);
                let mut sorted = order.clone();
                sorted.sort_unstable();
                prop_assert_eq!(sorted, (0..loads.len()).collect::<Vec<_>>());
                for pair in order.windows(2) {
                    prop_assert!(free_pages(&loads[pair[0]]) >= free_pages(&loads[pair[1]]));
                }
            }

            /// The chosen rank exists; it is never busier than the least busy by more than
            /// the slack; and it holds at least as long a cached prefix as the least busy.
            #[test]
            fn a_prompts_rank_is_bounded_by_the_slack(
                (loads, cached) in loads().prop_flat_map(|l| {
                    let n = l.len();
                    (Just(l), prop::collection::vec(0usize..6, n))
                })
            ) {
                let chosen = prompt_rank(&loads, &cached);
                prop_assert!(chosen < loads.len());
                let busy = |l: &proto::v1::Load| l.running_requests + l.queued_requests;
                let least = loads.iter().map(busy).min().unwrap_or(0);
                prop_assert!(busy(&loads[chosen]) <= least + PREFIX_SLACK);
                let least_cached = (0..loads.len())
                    .filter(|&r| busy(&loads[r]) == least)
                    .map(|r| cached[r])
                    .min()
                    .unwrap_or(0);
                prop_assert!(cached[chosen] >= least_cached);
            }
        }
    }
}
