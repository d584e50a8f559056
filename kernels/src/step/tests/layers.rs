//! One MoE layer's routed experts over a group's ranks on their devices (over the kernels'
//! references): each rank's rows equal the one-rank step's, bit for bit, and what crosses to
//! the host is counted: the messages' counts alone for ranks with their own tokens, nothing
//! for ranks that hold the same tokens.

use std::{sync::Arc, time::Duration};

use engine::{
    model::Model,
    parallel::{collective::InProcessGroup, expert::ExpertParallel},
    synth::Rng,
};

use crate::step::{StepOps, device_ops::DeviceStepOps, emulated::EmulatedKernels, routed_here};

/// The group tests' checkpoint, and its model (each rank loads its own).
fn checkpoint() -> (tempfile::TempDir, Model) {
    let dir = super::group::checkpoint();
    let model = Model::load(dir.path()).unwrap();
    (dir, model)
}

/// One layer's routed experts over 4 ranks on their devices (one without tokens): each rank's
/// outputs are the one-rank step's rows, bit for bit, and nothing crossed to the host but the
/// messages' counts (no row read back, no row uploaded: the exchange is device to device).
#[test]
fn a_layers_exchange_reads_back_only_the_messages_counts() {
    let (dir, full) = checkpoint();
    let c = full.config.clone();
    let (d, k, inter) = (c.hidden_size, c.experts_per_token, c.moe_intermediate_size);
    let mut rng = Rng::for_tensor(5, "ep-layer");
    let work: Vec<(Vec<f32>, Vec<i32>)> = [4usize, 0, 7, 1]
        .iter()
        .map(|&tokens| {
            let h = (0..tokens * d).map(|_| rng.normal()).collect();
            let ids = (0..tokens * k)
                .map(|_| (rng.next_u64() % c.n_routed_experts as u64) as i32)
                .collect();
            (h, ids)
        })
        .collect();
    let rows = |ops: &DeviceStepOps<EmulatedKernels>, (h, ids): &(Vec<f32>, Vec<i32>)| {
        let mut x = ops.alloc(h.len().max(1)).unwrap();
        ops.put_at(&mut x, 0, h).unwrap();
        (x, ops.put_idx(ids).unwrap())
    };
    let one = DeviceStepOps::new(EmulatedKernels::new(&c), &full).unwrap();
    let want: Vec<Vec<f32>> = work
        .iter()
        .map(|w| {
            let (x, ids) = rows(&one, w);
            let ys = routed_here(&one, 1, &x, &ids, (k, inter), w.1.len()).unwrap();
            one.get(&ys, 0..w.1.len() * d).unwrap()
        })
        .collect();
    let group = InProcessGroup::new(4, Duration::from_secs(20));
    let got: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = group
            .into_iter()
            .zip(&work)
            .map(|(rank, w)| {
                let (dir, c) = (dir.path(), &c);
                s.spawn(move || {
                    let mut model = Model::load(dir).unwrap();
                    let ep = ExpertParallel::new(Box::new(rank), c.n_routed_experts).unwrap();
                    model.set_expert_parallel(Arc::new(ep));
                    let ops = DeviceStepOps::new(EmulatedKernels::new(c), &model).unwrap();
                    let (x, ids) = rows(&ops, w);
                    ops.kernels().take_reads();
                    ops.kernels().take_uploads();
                    let pairs = w.1.len();
                    let ys = ops.routed_experts(1, &x, &ids, (k, inter), pairs).unwrap();
                    let traffic = (ops.kernels().take_reads(), ops.kernels().take_uploads());
                    (ops.get(&ys, 0..pairs * d).unwrap(), traffic)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, ((ys, (reads, uploads)), want)) in got.iter().zip(&want).enumerate() {
        assert!(
            ys.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()) && ys.len() == want.len(),
            "rank {r}'s outputs"
        );
        assert_eq!(*reads, (1, 4 + 1), "rank {r} read back the counts only");
        assert_eq!(uploads.0, 0, "rank {r} uploaded no f32 values");
    }
}

/// One layer's routed experts over 4 ranks that hold the same pairs (tensor-parallel
/// attention with the experts split between them): each rank's outputs are the one-rank
/// step's rows, bit for bit, and nothing crossed to the host, not even a count (the ranks'
/// rows are merged device to device, each pair's by the rank that holds its expert). A pair
/// of no expert is NaN on every rank.
#[test]
fn replicated_pairs_merge_on_the_devices_without_a_read() {
    let (dir, full) = checkpoint();
    let c = full.config.clone();
    let (d, k, inter) = (c.hidden_size, c.experts_per_token, c.moe_intermediate_size);
    let mut rng = Rng::for_tensor(6, "tp-ep-layer");
    let tokens = 5;
    let h: Vec<f32> = (0..tokens * d).map(|_| rng.normal()).collect();
    let mut ids: Vec<i32> = (0..tokens * k)
        .map(|_| (rng.next_u64() % c.n_routed_experts as u64) as i32)
        .collect();
    let pairs = ids.len();
    let rows = |ops: &DeviceStepOps<EmulatedKernels>, ids: &[i32]| {
        let mut x = ops.alloc(h.len()).unwrap();
        ops.put_at(&mut x, 0, &h).unwrap();
        (x, ops.put_idx(ids).unwrap())
    };
    let one = DeviceStepOps::new(EmulatedKernels::new(&c), &full).unwrap();
    let (x, e) = rows(&one, &ids);
    let ys = routed_here(&one, 1, &x, &e, (k, inter), pairs).unwrap();
    let want = one.get(&ys, 0..pairs * d).unwrap();
    // The last pair names no expert of the model.
    ids[pairs - 1] = c.n_routed_experts as i32;
    let group = InProcessGroup::new(4, Duration::from_secs(20));
    let got: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = group
            .into_iter()
            .map(|rank| {
                let (dir, c, ids) = (dir.path(), &c, &ids);
                s.spawn(move || {
                    let mut model = Model::load(dir).unwrap();
                    let ep =
                        Arc::new(ExpertParallel::new(Box::new(rank), c.n_routed_experts).unwrap());
                    model.set_expert_parallel(Arc::clone(&ep));
                    let ops = DeviceStepOps::new(EmulatedKernels::new(c), &model).unwrap();
                    let (x, e) = rows(&ops, ids);
                    ops.kernels().take_reads();
                    ops.kernels().take_uploads();
                    let ys = ops
                        .routed_replicated(&ep, 1, &x, &e, (k, inter), pairs)
                        .unwrap();
                    let traffic = (ops.kernels().take_reads(), ops.kernels().take_uploads());
                    (ops.get(&ys, 0..pairs * d).unwrap(), traffic)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let valid = (pairs - 1) * d;
    for (r, (ys, (reads, uploads))) in got.iter().enumerate() {
        assert_eq!(
            bits(&ys[..valid]),
            bits(&want[..valid]),
            "rank {r}'s outputs"
        );
        assert!(
            ys[valid..].iter().all(|v| v.is_nan()),
            "rank {r}'s pair of no expert"
        );
        assert_eq!(*reads, (0, 0), "rank {r} read nothing back");
        assert_eq!(uploads.0, 0, "rank {r} uploaded no f32 values");
    }
}
