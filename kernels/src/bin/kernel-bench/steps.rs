//! kernel-bench's engine-level rows: whole forward passes and steps on the `small` synthetic
//! model, each a rate in its own unit.

use std::{sync::Arc, time::Instant};

use kernels::cuda::{Gpu, KernelError};

/// Engine-level rows: a rate in their own unit.
pub struct StepRow {
    pub what: String,
    pub seconds: f64,
    pub rate: f64,
    pub unit: &'static str,
}

/// Whole engine steps on the `small` synthetic model (NVFP4 experts) on the CPU reference and
/// with the CUDA backend in hybrid mode: a 256-token prefill, then decode steps of 8 sequences.
/// On a model this small the device's per-op overhead shows, not its bandwidth.
pub fn engine_steps() -> Result<Vec<StepRow>, KernelError> {
    use engine::{
        config::ExpertFormat,
        model::{Logits, Model, SequenceState, Step},
        synth::{GenerateOptions, Preset, generate},
    };
    let dir = std::env::temp_dir().join(format!("pdserve-kernel-bench-{}", std::process::id()));
    let fail = |e: String| KernelError::Checkpoint(e);
    generate(&GenerateOptions::new(
        Preset::Small,
        1,
        ExpertFormat::Nvfp4,
        dir.clone(),
    ))
    .map_err(|e| fail(e.to_string()))?;
    let cpu = Model::load(&dir).map_err(|e| fail(e.to_string()))?;
    let mut cuda = Model::load(&dir).map_err(|e| fail(e.to_string()))?;
    let backend = kernels::cuda::CudaBackend::load(&dir, &cuda.config)?
        .ok_or_else(|| KernelError::Unsupported("no device".into()))?;
    cuda.attach_backend(Arc::new(backend), true)
        .map_err(|e| fail(e.to_string()))?;
    let _ = std::fs::remove_dir_all(&dir);
    let prompt: Vec<u32> = (0..256).map(|i| (i * 7919 + 5) % 1000).collect();
    let mut rows = Vec::new();
    let mut prefilled: Vec<SequenceState> = Vec::new();
    for (name, model) in [("cpu", &cpu), ("cuda hybrid", &cuda)] {
        let start = Instant::now();
        let mut states: Vec<SequenceState> = Vec::new();
        for s in 0..8u32 {
            let mut state = model.new_state();
            let mut p = prompt.clone();
            p[0] = s;
            model
                .forward(&mut state, &p, Logits::Last)
                .map_err(|e| fail(e.to_string()))?;
            states.push(state);
        }
        let prefill = start.elapsed().as_secs_f64() / 8.0;
        if prefilled.is_empty() {
            prefilled.clone_from(&states);
        }
        rows.push(StepRow {
            what: format!("engine prefill, small model, 256 tokens ({name})"),
            seconds: prefill,
            rate: 256.0 / prefill,
            unit: "tok/s",
        });
        let steps = 16;
        let start = Instant::now();
        for t in 0..steps {
            let tokens: Vec<[u32; 1]> = (0..8).map(|s| [(t * 8 + s) % 1000]).collect();
            let mut batch: Vec<Step<'_>> = states
                .iter_mut()
                .zip(&tokens)
                .map(|(state, token)| Step {
                    state,
                    tokens: token,
                    logits: Logits::Last,
                })
                .collect();
            model
                .forward_batch(&mut batch)
                .map_err(|e| fail(e.to_string()))?;
        }
        let step = start.elapsed().as_secs_f64() / f64::from(steps);
        rows.push(StepRow {
            what: format!("engine decode step, small model, batch 8 ({name})"),
            seconds: step,
            rate: 8.0 / step,
            unit: "tok/s",
        });
    }
    rows.push(device_prefill(&cpu, &prompt)?);
    rows.push(device_prefill_read_back(&cpu, &prompt, false)?);
    rows.push(device_prefill_read_back(&cpu, &prompt, true)?);
    rows.extend(device_steps(&cpu, &prefilled, prompt.len())?);
    Ok(rows)
}

/// The same 8 prompts through the whole device step on the GPU in chunks of 64 tokens (each
/// step a chunk of every sequence, `StateLayout::chunked`; the head over each prompt's last
/// token only, `prompt_step`), exact kernels: seconds per prompt, as the engine rows count
/// them.
fn device_prefill(model: &engine::model::Model, prompt: &[u32]) -> Result<StepRow, KernelError> {
    use kernels::{
        cuda::{CudaKernels, CudaStepOps},
        step::{
            decode::{Seat, prompt_step},
            layout::StateLayout,
        },
    };
    const CHUNK: usize = 64;
    let (sequences, c) = (8usize, &model.config);
    let gpu = Arc::new(Gpu::open()?.ok_or_else(|| KernelError::Unsupported("no device".into()))?);
    let ops = CudaStepOps::new(CudaKernels::new(gpu), model)?;
    let shape = (sequences, prompt.len() + 1);
    let layout = StateLayout::chunked(c, shape, model.kv_rows(), CHUNK);
    let fail = |e: String| KernelError::Checkpoint(e);
    let mut arenas = layout.arenas(&ops)?;
    let start = Instant::now();
    for from in (0..prompt.len()).step_by(CHUNK) {
        let to = (from + CHUNK).min(prompt.len());
        let (mut seats, mut ids, mut wanted) = (Vec::new(), Vec::new(), Vec::new());
        for slot in 0..sequences {
            for (pos, &token) in prompt.iter().enumerate().take(to).skip(from) {
                seats.push(Seat { slot, len: pos });
                // Each sequence's first token its own, as the engine rows' prompts.
                ids.push(if pos == 0 { slot as u32 } else { token });
            }
            // The logits of each prompt's last token only.
            if to == prompt.len() {
                wanted.push(ids.len() - 1);
            }
        }
        prompt_step(&ops, c, &layout, &mut arenas, &mut seats, (&ids, &wanted))
            .map_err(|e| fail(e.to_string()))?;
    }
    let per = start.elapsed().as_secs_f64() / sequences as f64;
    Ok(StepRow {
        what: format!(
            "device prefill, small model, {} tokens in chunks of {CHUNK} (exact step)",
            prompt.len()
        ),
        seconds: per,
        rate: prompt.len() as f64 / per,
        unit: "tok/s",
    })
}

/// [`device_prefill`] as an engine runs it (`StepDecoder::with_prompts`, the
/// `StepDevice::prompt_step` a prefill worker on cuda calls): after each step every chunk's
/// delta is read back to the host for its pages. Beside the row above, what the read-back costs;
/// with `gemms`, the prompt GEMMs a prefill worker may choose (`prefill_linears` and
/// `prefill_experts` = "fast": the dense and grouped GEMMs).
fn device_prefill_read_back(
    model: &engine::model::Model,
    prompt: &[u32],
    gemms: bool,
) -> Result<StepRow, KernelError> {
    use engine::{
        model::Logits,
        scheduler::{PromptChunk, StepDevice},
    };
    use kernels::{cuda::CudaKernels, step::decoder::StepDecoder};
    const CHUNK: usize = 64;
    let sequences = 8usize;
    let fail = |e: String| KernelError::Checkpoint(e);
    let gpu = Arc::new(Gpu::open()?.ok_or_else(|| KernelError::Unsupported("no device".into()))?);
    let shape = (sequences, prompt.len() + 1);
    let mut decoder = StepDecoder::new("cuda", CudaKernels::new(gpu), model, shape, |_, _| Ok(()))?
        .with_prompts(CHUNK, |_, _| Ok(()))?;
    if gemms {
        decoder = decoder.with_fast_linears().with_gemm_experts();
    }
    let empty = model.new_state();
    for slot in 0..sequences {
        decoder
            .load(slot, &empty)
            .map_err(|e| fail(e.to_string()))?;
    }
    // Each sequence's first token its own, as the engine rows' prompts.
    let prompts: Vec<Vec<u32>> = (0..sequences)
        .map(|slot| {
            let mut p = prompt.to_vec();
            p[0] = slot as u32;
            p
        })
        .collect();
    let start = Instant::now();
    for from in (0..prompt.len()).step_by(CHUNK) {
        let to = (from + CHUNK).min(prompt.len());
        let logits = if to == prompt.len() {
            Logits::Last
        } else {
            Logits::None
        };
        let chunks: Vec<PromptChunk<'_>> = prompts
            .iter()
            .enumerate()
            .map(|(slot, p)| PromptChunk {
                slot,
                start: from,
                tokens: &p[from..to],
                logits,
            })
            .collect();
        decoder
            .prompt_step(&chunks)
            .map_err(|e| fail(e.to_string()))?;
    }
    let per = start.elapsed().as_secs_f64() / sequences as f64;
    Ok(StepRow {
        what: format!(
            "device prefill, small model, {} tokens in chunks of {CHUNK} ({}, deltas read back)",
            prompt.len(),
            if gemms {
                "dense and grouped GEMMs"
            } else {
                "exact step"
            }
        ),
        seconds: per,
        rate: prompt.len() as f64 / per,
        unit: "tok/s",
    })
}

/// The whole decode step on the GPU (`StepDecoder`) over `prefilled` sequences of `len`
/// tokens: exact kernels, the fast linears and experts, and the exact step replayed as graphs;
/// 16 timed steps after 4 (which record the graphs).
fn device_steps(
    model: &engine::model::Model,
    prefilled: &[engine::model::SequenceState],
    len: usize,
) -> Result<Vec<StepRow>, KernelError> {
    use engine::scheduler::{DecodeSeat, StepDevice};
    use kernels::{cuda::CudaKernels, step::decoder::StepDecoder};
    let (warm, timed) = (4usize, 16usize);
    let fail = |e: String| KernelError::Checkpoint(e);
    let mut rows = Vec::new();
    for (name, fast, graphs) in [
        ("exact", false, false),
        ("fast linears and experts", true, false),
        ("exact, graphs", false, true),
    ] {
        let gpu =
            Arc::new(Gpu::open()?.ok_or_else(|| KernelError::Unsupported("no device".into()))?);
        let shape = (prefilled.len(), len + warm + timed + 1);
        let mut decoder =
            StepDecoder::new("cuda", CudaKernels::new(gpu), model, shape, |_, _| Ok(()))?;
        if fast {
            decoder = decoder.with_fast_linears().with_fast_experts();
        }
        if graphs {
            decoder = decoder.with_graphs(|_, _| Ok(()))?;
        }
        for (slot, state) in prefilled.iter().enumerate() {
            decoder.load(slot, state).map_err(|e| fail(e.to_string()))?;
        }
        let mut start = Instant::now();
        for t in 0..warm + timed {
            if t == warm {
                start = Instant::now();
            }
            let seats: Vec<DecodeSeat> = (0..prefilled.len())
                .map(|slot| DecodeSeat {
                    slot,
                    len: len + t,
                    token: ((t * 8 + slot) % 1000) as u32,
                })
                .collect();
            decoder.step(&seats).map_err(|e| fail(e.to_string()))?;
        }
        let step = start.elapsed().as_secs_f64() / timed as f64;
        rows.push(StepRow {
            what: format!("device decode step, small model, batch 8 ({name})"),
            seconds: step,
            rate: prefilled.len() as f64 / step,
            unit: "tok/s",
        });
    }
    Ok(rows)
}
