//! Expert-parallel ranks stepping on their devices (`device_group`) beside the one-rank host
//! engine: each rank a thread with its own engine, requests and step device, holding `1/N` of
//! every layer's routed experts (its copies of the others' are wrong on purpose, so only the
//! experts it holds can give the right answer); every step the ranks meet at each MoE layer to
//! exchange their pairs, a rank without work of a phase taking part with an idle step. What
//! the CPU test (`step::tests::group`, over the kernels' references) and the GPU test (ranks
//! sharing one GPU) run.

use std::{collections::BTreeMap, path::Path, sync::Arc, thread, time::Duration};

use engine::{
    model::Model,
    parallel::{
        collective::{Collective, InProcessGroup, InProcessRank},
        expert::ExpertParallel,
        sliced::SlicedExperts,
        tensor::TensorParallel,
    },
    sampling::{SamplingParams, StopConditions},
    scheduler::{Engine, EngineConfig, Event, GenerationRequest, StepDevice},
    synth::Rng,
};

/// Requests of several prompt lengths, greedy and sampled, with log-probabilities (and one
/// with prompt log-probabilities).
pub fn requests() -> Vec<GenerationRequest> {
    let mut rng = Rng::for_tensor(2, "ep-device-requests");
    [3usize, 70, 40, 1, 33, 29, 9]
        .iter()
        .enumerate()
        .map(|(i, &len)| GenerationRequest {
            id: i as u64 + 1,
            prompt: (0..len).map(|_| (rng.next_u64() % 1000) as u32).collect(),
            sampling: SamplingParams {
                temperature: if i % 2 == 0 { 0.0 } else { 0.8 },
                seed: Some(i as u64 * 7),
                logprobs: true,
                top_logprobs: 2,
                prompt_logprobs: (i == 2).then_some(1),
                ..SamplingParams::default()
            },
            stop: StopConditions {
                max_tokens: 3 + (i as u32 % 4),
                min_tokens: 0,
                stop_token_ids: Vec::new(),
                ignore_eos: true,
                eos_token_ids: vec![1],
            },
        })
        .collect()
}

/// Every engine's configuration (each rank's and the one-rank engine's).
pub fn config() -> EngineConfig {
    EngineConfig {
        page_size: 16,
        num_pages: 24,
        max_running: 3,
        max_batch_tokens: 48,
        ..EngineConfig::default()
    }
}

/// Tokens a slot holds: the longest a request may grow.
pub fn slot_tokens() -> usize {
    config().num_pages as usize * config().page_size
}

/// [`requests`] on the one-rank host engine of the checkpoint at `dir`, by request.
pub fn one_rank(dir: &Path) -> Result<BTreeMap<u64, Vec<Event>>, String> {
    let model = Model::load(dir).map_err(|e| e.to_string())?;
    let mut one = Engine::new(model, config(), "ep").map_err(|e| e.to_string())?;
    for r in requests() {
        one.add(r).map_err(|e| e.to_string())?;
    }
    Ok(Event::by_request(&one.run_to_completion()))
}

/// Opens rank `r`'s step device for its model (a rank of an expert-parallel group).
pub type OpenRank<'a> = dyn Fn(&Model, usize) -> Result<Box<dyn StepDevice>, String> + Sync + 'a;

/// How a group splits the model: by experts with each rank stepping its own requests
/// (`--ep N --dp-attention`), or by attention heads with every rank stepping every request
/// (`--tp N`), its experts whole on each rank or split among them too (`--tp N --ep N`), or
/// every expert sliced over them (`--tp N --moe-tp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    Experts,
    Heads { experts: bool },
    Sliced,
}

/// [`requests`] over `ranks` expert-parallel ranks of the checkpoint at `dir` (request `i` on
/// rank `i % ranks`), each stepping on the device `open` opens for it, by request.
pub fn on_ranks(
    dir: &Path,
    ranks: usize,
    open: &OpenRank<'_>,
) -> Result<BTreeMap<u64, Vec<Event>>, String> {
    on_group(dir, (ranks, Split::Experts), open)
}

/// [`requests`] over `ranks` ranks of the checkpoint at `dir` split as `split` says, each
/// stepping on the device `open` opens for it, by request (where every rank steps every
/// request, every rank's events, which must agree).
pub fn on_group(
    dir: &Path,
    (ranks, split): (usize, Split),
    open: &OpenRank<'_>,
) -> Result<BTreeMap<u64, Vec<Event>>, String> {
    run_group(dir, (ranks, split), Some(open))
}

/// [`on_group`] on the host forward (no step device): the group's reference.
pub fn on_group_host(
    dir: &Path,
    (ranks, split): (usize, Split),
) -> Result<BTreeMap<u64, Vec<Event>>, String> {
    run_group(dir, (ranks, split), None)
}

fn run_group(
    dir: &Path,
    (ranks, split): (usize, Split),
    open: Option<&OpenRank<'_>>,
) -> Result<BTreeMap<u64, Vec<Event>>, String> {
    let group = || InProcessGroup::new(ranks, Duration::from_secs(30));
    let (expert_ranks, head_ranks) = (group(), group());
    // The ranks agree before each step whether any of them has work.
    let control = group();
    let got: Vec<Result<Vec<Event>, String>> = thread::scope(|s| {
        let handles: Vec<_> = expert_ranks
            .into_iter()
            .zip(head_ranks)
            .zip(control)
            .map(|((ep, tp), control)| {
                let links = RankLinks { ep, tp, control };
                s.spawn(move || rank_run(dir, links, split, open))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a rank panicked".to_owned()))
            })
            .collect()
    });
    let events = got.into_iter().collect::<Result<Vec<_>, _>>()?;
    if split == Split::Experts {
        return Ok(Event::by_request(&events.concat()));
    }
    let first = Event::by_request(&events[0]);
    for (r, e) in events.iter().enumerate().skip(1) {
        if Event::by_request(e) != first {
            return Err(format!("rank {r}'s events differ from rank 0's"));
        }
    }
    Ok(first)
}

/// A rank's links to the others: its expert and head groups' and the step vote's.
struct RankLinks {
    ep: InProcessRank,
    tp: InProcessRank,
    control: InProcessRank,
}

/// One rank of [`on_group`]: its engine over its device (or the host forward), stepping in
/// lockstep with the others.
fn rank_run(
    dir: &Path,
    RankLinks {
        ep: rank,
        tp,
        mut control,
    }: RankLinks,
    split: Split,
    open: Option<&OpenRank<'_>>,
) -> Result<Vec<Event>, String> {
    let (me, ranks) = (rank.rank(), rank.size());
    let model = rank_model(dir, (rank, tp), split)?;
    let mut engine = Engine::new(model, config(), "ep").map_err(|e| e.to_string())?;
    if let Some(open) = open {
        let device = open(engine.model(), me)?;
        engine.set_step_device(device).map_err(|e| e.to_string())?;
    }
    let mine = |id: u64| split != Split::Experts || id as usize % ranks == me;
    for r in requests().into_iter().filter(|r| mine(r.id)) {
        engine.add(r).map_err(|e| e.to_string())?;
    }
    // Its own compute pool, as a worker's ranks have: on the shared global pool one rank's
    // host forward could be stolen onto a thread that waits in the other's exchange.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .map_err(|e| e.to_string())?;
    let mut events = Vec::new();
    for _ in 0..10_000 {
        let busy = control
            .all_gather(vec![f32::from(u8::from(!engine.is_idle()))])
            .map_err(|e| e.to_string())?;
        if busy.iter().all(|b| b[0] == 0.0) {
            return Ok(events);
        }
        events.extend(pool.install(|| engine.step()));
    }
    Err(format!("rank {me} made no progress"))
}

/// A rank's model of the checkpoint at `dir` split as `split` says, over its links to its
/// expert group (`ep`) and head group (`tp`): holding its experts (its copies of the other
/// ranks' are wrong on purpose: only the experts it holds may be used), or its slice of every
/// expert, or its share of the heads.
pub fn rank_model(
    dir: &Path,
    (rank, tp): (InProcessRank, InProcessRank),
    split: Split,
) -> Result<Model, String> {
    let me = rank.rank();
    let mut model = Model::load(dir).map_err(|e| e.to_string())?;
    let (experts, inter) = (
        model.config.n_routed_experts,
        model.config.moe_intermediate_size,
    );
    if split == Split::Sliced {
        let sliced = SlicedExperts::new(Box::new(rank), inter)?;
        model.set_sliced_experts(Arc::new(sliced));
    } else if matches!(split, Split::Experts | Split::Heads { experts: true }) {
        let ep = ExpertParallel::new(Box::new(rank), experts)?;
        let held = ep.split().held_by(me);
        for layer in &mut model.weights.layers {
            let stand_in = layer.moe.experts[held.start].clone();
            for (e, expert) in layer.moe.experts.iter_mut().enumerate() {
                if !held.contains(&e) {
                    *expert = stand_in.clone();
                }
            }
        }
        model.set_expert_parallel(Arc::new(ep));
    }
    if split != Split::Experts {
        let tp = TensorParallel::new(Box::new(tp), &model.config)?;
        model.set_tensor_parallel(Arc::new(tp));
    }
    Ok(model)
}
