//! Weights as stored: a model whose large tensors are read from the checkpoint's mapping gives
//! logits bit-identical to the same model with every tensor expanded to f32 (the form the
//! loader used to produce), for each expert format, prompt chunked or whole; and loading holds
//! only a few percent of the checkpoint's bytes on the heap.
#![allow(clippy::unwrap_used, reason = "test code")]

use std::{
    alloc::{GlobalAlloc, Layout, System},
    sync::atomic::{AtomicUsize, Ordering},
};

use engine::{
    config::ExpertFormat,
    model::{Logits, Model},
    synth::{GenerateOptions, Preset, generate},
};

/// Counts the bytes currently allocated on the heap and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: defers to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) };
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The heap counters are process-wide: tests take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn checkpoint(experts: ExpertFormat, preset: Preset) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let options = GenerateOptions::new(preset, 3, experts, dir.path());
    generate(&options).unwrap();
    dir
}

fn bits(logits: &[Vec<f32>]) -> Vec<u32> {
    logits.iter().flatten().map(|v| v.to_bits()).collect()
}

#[test]
fn stored_weights_give_the_expanded_logits_bit_for_bit() {
    let _turn = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for experts in [
        ExpertFormat::Nvfp4,
        ExpertFormat::Mxfp4,
        ExpertFormat::Fp8Block,
        ExpertFormat::Bf16,
    ] {
        let dir = checkpoint(experts, Preset::Tiny);
        let stored = Model::load(dir.path()).unwrap();
        let expanded = Model::new(stored.config.clone(), stored.weights.expanded());
        let tokens: Vec<u32> = (0..45u32).map(|i| (i * 2_654_435) % 129_280).collect();
        let mut a = stored.new_state();
        let mut b = expanded.new_state();
        let whole = stored.forward(&mut a, &tokens, Logits::All).unwrap();
        let reference = expanded.forward(&mut b, &tokens, Logits::All).unwrap();
        assert_eq!(bits(&whole), bits(&reference), "{experts:?} whole prompt");
        // Decode steps (one vector per product: the register decoders).
        for t in [7u32, 99, 12_345] {
            let x = stored.forward(&mut a, &[t], Logits::Last).unwrap();
            let y = expanded.forward(&mut b, &[t], Logits::Last).unwrap();
            assert_eq!(bits(&x), bits(&y), "{experts:?} decode {t}");
        }
        // The same prompt in uneven chunks.
        let mut c = stored.new_state();
        let mut chunked = Vec::new();
        for part in tokens.chunks(11) {
            chunked.extend(stored.forward(&mut c, part, Logits::All).unwrap());
        }
        assert_eq!(bits(&chunked), bits(&reference), "{experts:?} chunked");
    }
}

/// Loading keeps the large tensors in the mapping: the heap grows by under 5% of the
/// checkpoint's bytes (the f32 expansion was ~2-8x the checkpoint).
#[test]
fn loading_allocates_a_small_fraction_of_the_checkpoint() {
    let _turn = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for experts in [ExpertFormat::Nvfp4, ExpertFormat::Mxfp4] {
        let dir = checkpoint(experts, Preset::Small);
        let file_bytes: u64 = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap())
            .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
            .map(|e| e.metadata().unwrap().len())
            .sum();
        let before = LIVE.load(Ordering::Relaxed);
        PEAK.store(before, Ordering::Relaxed);
        let model = Model::load(dir.path()).unwrap();
        let held = LIVE.load(Ordering::Relaxed) - before;
        let peak = PEAK.load(Ordering::Relaxed) - before;
        let limit = file_bytes / 20;
        assert!(
            (peak as u64) < limit,
            "{experts:?}: loading peaked at {peak} heap bytes (held {held}) for a \
             {file_bytes}-byte checkpoint (limit {limit})"
        );
        // The model really holds the weights: its stored bytes are most of the checkpoint.
        let stored = model.weights.held_bytes() as u64;
        assert!(
            stored > file_bytes / 2 && stored <= file_bytes,
            "{stored} vs {file_bytes}"
        );
        drop(model);
    }
}
