//! A group's ranks get their own devices: the worker opens one backend per rank (rank r its
//! own), attaches each to its rank's model, and makes the groups' collectives through the hook
//! a GPU worker gives NCCL to. Here the backends are reference backends and the collectives
//! in-process ones, so on any machine: every rank has its own backend, each rank's backend does
//! work, the collectives are made once per group, and the ranks' logits equal one engine's.
#![allow(clippy::unwrap_used, reason = "test code")]

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use engine::{
    backend::{Backend, DeviceError, Op},
    config::ExpertFormat,
    model::{Logits, Model},
    parallel::{
        collective::{Collective, InProcessGroup},
        group::GroupSpec,
    },
    plan::shard::Parallel,
    scheduler::EngineConfig,
    start::{RankDevices, start_with_backend},
    synth::{GenerateOptions, Preset, generate},
    tensor::Weight,
    weights::LoadProgress,
};

/// The output head through the reference matrix, counting the hidden states it saw.
#[derive(Debug)]
struct Head {
    head: Weight,
    seen: Arc<AtomicUsize>,
}

impl Backend for Head {
    fn name(&self) -> &'static str {
        "reference head"
    }

    fn runs(&self, op: Op) -> bool {
        op == Op::OutputHead
    }

    fn output_head(&self, hidden: &[Vec<f32>]) -> Result<Vec<Vec<f32>>, DeviceError> {
        self.seen.fetch_add(hidden.len(), Ordering::Relaxed);
        Ok(self.head.apply_many(hidden))
    }
}

#[test]
fn each_rank_computes_on_its_own_backend_with_the_groups_collectives() {
    let dir = tempfile::tempdir().unwrap();
    let options = GenerateOptions::new(Preset::Tiny, 21, ExpertFormat::Nvfp4, dir.path());
    generate(&options).unwrap();
    let plain = Model::load(dir.path()).unwrap();
    let seen: Vec<Arc<AtomicUsize>> = (0..2).map(|_| Arc::default()).collect();
    let opened = Mutex::new(Vec::new());
    let open = |_: &std::path::Path, _: &engine::config::ModelConfig, rank: usize| {
        opened.lock().unwrap().push(rank);
        Ok(Some(Arc::new(Head {
            head: plain.weights.head.clone(),
            seen: Arc::clone(&seen[rank]),
        }) as Arc<dyn Backend>))
    };
    let groups = AtomicUsize::new(0);
    let collectives = |n: usize, timeout: Duration| {
        groups.fetch_add(1, Ordering::Relaxed);
        Ok(InProcessGroup::new(n, timeout)
            .into_iter()
            .map(|r| Box::new(r) as Box<dyn Collective>)
            .collect())
    };
    let devices = RankDevices {
        open: &open,
        hybrid: true,
        collectives: Some(&collectives),
        decode: None,
        decode_only: false,
    };
    let spec = GroupSpec {
        parallel: Parallel {
            tp: 2,
            ep: 1,
            dp_attention: false,
            moe_tp: false,
        },
        timeout: Duration::from_secs(30),
        threads_per_rank: 1,
    };
    let progress = Arc::new(LoadProgress::new());
    let loaded = start_with_backend(
        dir.path(),
        EngineConfig::default(),
        "rank-devices",
        devices,
        spec,
        &progress,
    )
    .unwrap();
    assert_eq!(*opened.lock().unwrap(), vec![0, 1], "a backend per rank");
    assert_eq!(
        groups.load(Ordering::Relaxed),
        1,
        "the heads' group, made once"
    );
    let plan = loaded.backend_plan.as_ref().unwrap();
    assert!(plan.is_hybrid() && plan.on_device == vec![Op::OutputHead]);
    let prompt: Vec<u32> = vec![5, 900, 31, 7, 4000, 12, 77];
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let ranks = loaded.ranks.clone();
    let job_prompt = prompt.clone();
    let logits = runtime
        .block_on(ranks.call_each(0, move |engine, _| {
            // On a pool of the rank's own, as the ranks step: on the shared global pool one
            // rank's forward could be stolen onto a thread that waits in the other's exchange.
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap();
            let model = engine.model();
            let mut state = model.new_state();
            pool.install(|| model.forward(&mut state, &job_prompt, Logits::Last))
                .map_err(|e| e.to_string())
        }))
        .unwrap();
    let mut state = plain.new_state();
    let want = plain.forward(&mut state, &prompt, Logits::Last).unwrap();
    assert_eq!(logits.len(), 2);
    for (rank, got) in logits.into_iter().enumerate() {
        let got = got.unwrap();
        let same = got[0]
            .iter()
            .zip(&want[0])
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "rank {rank}'s logits differ from one engine's");
        assert_eq!(
            seen[rank].load(Ordering::Relaxed),
            1,
            "rank {rank}'s own head"
        );
    }
}
