//! The engines of a worker's ranks, each on its own thread with its own compute pool, stepping
//! in lockstep: before every step the ranks agree (an all-gather on a control group) whether any
//! of them has work; if one has, all step, and a rank without tokens runs an idle forward for
//! the others' experts (expert parallelism needs every rank in every MoE exchange). When none
//! has work they sleep until a job reaches any of them (every job wakes the whole group), so an
//! idle worker does not poll.
//!
//! Each rank owns whole requests (data-parallel attention): callers address a rank's
//! [`Runner`] directly. If the control group fails (a rank died or hung past the group's
//! timeout), every rank fails its requests with that error and serves no more: the worker is
//! unhealthy and must be restarted.

use std::{
    collections::VecDeque,
    sync::{Arc, mpsc as std_mpsc},
};

use tokio::sync::watch;

use super::collective::Collective;
use crate::{
    runner::{Job, Runner, Subscribers, Wake},
    scheduler::Engine,
};

/// Set once, when a group's ranks lost lockstep (a rank died or hung past the timeout): the
/// ranks that still run failed their requests and serve none; a hung rank answers nothing.
#[derive(Debug)]
pub struct Failure(watch::Sender<Option<String>>);

impl Default for Failure {
    fn default() -> Self {
        Self(watch::channel(None).0)
    }
}

impl Failure {
    /// The reason, once set.
    pub fn reason(&self) -> Option<String> {
        self.0.borrow().clone()
    }

    /// Watches the reason.
    pub fn subscribe(&self) -> watch::Receiver<Option<String>> {
        self.0.subscribe()
    }

    /// Records `reason` (the first one stays).
    pub fn set(&self, reason: &str) {
        self.0
            .send_if_modified(|f| f.is_none().then(|| *f = Some(reason.to_owned())).is_some());
    }
}

/// How long an idle rank sleeps before it checks again without being woken (a safety net:
/// every job wakes it at once).
const IDLE_RECHECK: std::time::Duration = std::time::Duration::from_secs(1);

/// The handles of started ranks, which the group's `Ranks` holds.
#[derive(Debug)]
pub struct Started {
    /// Each rank's own queue.
    pub runners: Vec<Runner>,
    pub failure: Arc<Failure>,
    /// Each rank's group queue (jobs every rank applies before the same step).
    pub shared: Vec<std_mpsc::Sender<Job>>,
    pub wake: Arc<Wake>,
}

/// Starts one thread per engine (rank `r` = `engines[r]`, meeting the others in
/// `control[r]`), each with a compute pool of `threads` threads.
pub fn start(
    engines: Vec<Engine>,
    control: Vec<Box<dyn Collective>>,
    name: &str,
    threads: usize,
) -> std::io::Result<Started> {
    if engines.len() != control.len() {
        return Err(std::io::Error::other(format!(
            "{} engines for {} control ranks",
            engines.len(),
            control.len()
        )));
    }
    let wake = Arc::new(Wake::default());
    let failure: Arc<Failure> = Arc::default();
    let mut runners = Vec::with_capacity(engines.len());
    let mut shared = Vec::with_capacity(engines.len());
    for (rank, (engine, control)) in engines.into_iter().zip(control).enumerate() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(move |i| format!("rank{rank}-compute{i}"))
            .build()
            .map_err(std::io::Error::other)?;
        let (jobs, receiver) = std_mpsc::channel::<Job>();
        let (shared_jobs, shared_receiver) = std_mpsc::channel::<Job>();
        let group = Arc::clone(&wake);
        let failed = Arc::clone(&failure);
        std::thread::Builder::new()
            .name(format!("{name}-rank{rank}"))
            .spawn(move || {
                let queues = Queues {
                    local: receiver,
                    shared: shared_receiver,
                };
                run_rank(engine, &queues, control, &group, &pool, &failed);
            })?;
        runners.push(Runner::ranked(jobs, Arc::clone(&wake)));
        shared.push(shared_jobs);
    }
    Ok(Started {
        runners,
        failure,
        shared,
        wake,
    })
}

/// A rank's job queues: its own (run between steps as they come) and the group's (jobs every
/// rank receives in the same order; run only once every rank has them, so every rank applies
/// them before the same step).
struct Queues {
    local: std_mpsc::Receiver<Job>,
    shared: std_mpsc::Receiver<Job>,
}

impl Queues {
    /// Runs the local jobs that arrived and moves the group's into `pending`; true when the
    /// rank's handles are all gone.
    fn drain(
        &self,
        engine: &mut Engine,
        subs: &mut Subscribers,
        pending: &mut VecDeque<Job>,
    ) -> bool {
        pending.extend(self.shared.try_iter());
        loop {
            match self.local.try_recv() {
                Ok(job) => job(engine, subs),
                Err(std_mpsc::TryRecvError::Disconnected) => return true,
                Err(std_mpsc::TryRecvError::Empty) => return false,
            }
        }
    }
}

fn run_rank(
    mut engine: Engine,
    queues: &Queues,
    mut control: Box<dyn Collective>,
    wake: &Wake,
    pool: &rayon::ThreadPool,
    failure: &Failure,
) {
    let mut subs = Subscribers::default();
    let mut broken: Option<String> = None;
    let mut pending: VecDeque<Job> = VecDeque::new();
    loop {
        let seen = wake.current();
        let gone = queues.drain(&mut engine, &mut subs, &mut pending);
        if let Some(reason) = &broken {
            // No lockstep any more: whatever arrives fails at once.
            for job in pending.drain(..) {
                job(&mut engine, &mut subs);
            }
            for event in engine.fail_all(reason) {
                subs.deliver(event);
            }
            if gone {
                return;
            }
            wake.wait_past(seen, IDLE_RECHECK);
            continue;
        }
        let busy = !engine.is_idle();
        let vote = vec![
            f32::from(u8::from(busy)),
            f32::from(u8::from(gone)),
            pending.len() as f32,
        ];
        let votes = match control.all_gather(vote) {
            Ok(votes) => votes,
            Err(e) => {
                let reason = format!("the worker's ranks lost lockstep: {e}");
                stop_serving(&mut engine, &mut subs, (failure, control.rank()), &reason);
                broken = Some(reason);
                continue;
            }
        };
        // The group's jobs that every rank has, in their order: the same on every rank.
        let agreed = votes
            .iter()
            .map(|v| v.get(2).map_or(0, |&n| n as usize))
            .min()
            .unwrap_or(0);
        for job in pending.drain(..agreed.min(pending.len())) {
            job(&mut engine, &mut subs);
        }
        let voted_busy = votes.iter().any(|v| v.first().is_some_and(|&b| b != 0.0));
        if voted_busy || !engine.is_idle() {
            let emitted = pool.install(|| engine.step_with(&mut |event| subs.deliver(event)));
            // A failed expert exchange (a rank's step failed, on its device or here) fails
            // every later one: the worker serves no more, as when it loses lockstep.
            if let Some(e) = engine
                .model()
                .expert_parallel()
                .and_then(super::expert::ExpertParallel::failure)
            {
                let reason = format!("the worker's expert-parallel exchanges failed: {e}");
                stop_serving(&mut engine, &mut subs, (failure, control.rank()), &reason);
                broken = Some(reason);
                continue;
            }
            if emitted == 0 && engine.load().0 == 0 && busy {
                // Waiting for pages only a job can free: do not spin.
                wake.wait_past(seen, std::time::Duration::from_millis(5));
            }
            continue;
        }
        if agreed > 0 {
            continue;
        }
        if votes.iter().all(|v| v.get(1).is_some_and(|&g| g != 0.0)) {
            return;
        }
        wake.wait_past(seen, IDLE_RECHECK);
    }
}

/// A rank that can no longer step with its group: peers waiting in an expert or attention
/// exchange stop now (not at their timeout), its requests fail with `reason`, and the group's
/// failure is set (the worker reports itself failed).
fn stop_serving(
    engine: &mut Engine,
    subs: &mut Subscribers,
    (failure, rank): (&Failure, usize),
    reason: &str,
) {
    tracing::error!(rank, %reason, "rank stops serving");
    engine.model().fail_groups(reason);
    for event in engine.fail_all(reason) {
        subs.deliver(event);
    }
    failure.set(reason);
}

#[cfg(test)]
mod tests;
