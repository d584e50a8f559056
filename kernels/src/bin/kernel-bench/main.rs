//! `kernel-bench`: per kernel and shape, the analytic bytes and FLOPs of one launch
//! ([`kernels::cost`]: what it must read or write at least once, and its multiply-adds); on a
//! GPU also the measured time, the achieved GB/s and TFLOP/s, and the GB/s as a share of the
//! device's copy bandwidth measured in the same run. Without a GPU it prints the analytic table
//! and exits 0 (non-zero under `PDSERVE_REQUIRE_GPU=1`). Built here (`cargo build -p kernels
//! --features cuda --release --bins`), run by `kernels/gpu-check.sh` on a lent GPU machine.
//!
//! Times are best-of-three means over enough calls to run ~0.3 s.
#![allow(clippy::print_stdout, reason = "benchmark output")]

use std::time::{Duration, Instant};

use cudarc::driver::CudaSlice;
use engine::{quant, synth::Rng};
use kernels::{
    arch::Bf16Mma,
    cost::{self, Cost},
    cuda::{AttnShape, DenseWeight, DeviceExperts, GemmWeight, GemvFormat, Gpu, KernelError},
    step::kernels::ScoreSpec,
};

/// Shapes of the cases, shared by the analytic table and the timed runs.
const COPY_BYTES: usize = 1 << 30;
/// One 16384 x 7168 weight: a large projection at batch 1.
const GEMV: (usize, usize) = (16_384, 7168);
/// Prefill-sized.
const GEMM: (usize, usize, usize) = (4096, 4096, 4096);
/// One token routed to 8 of 64 experts of 2048 x 7168: (experts, rows, cols, pairs).
const GROUPED: (usize, usize, usize, usize) = (64, 2048, 7168, 8);
/// DeepSeek-V4-Flash's output head for one decode token.
const HEAD: (usize, usize) = (129_280, 4096);
/// 16 requests x 64 heads over 4096 f32 rows of 512: (batch, heads, dim, rows per request).
const ATTN: (usize, usize, usize, usize) = (16, 64, 512, 4096);
/// The exact attention (rows read twice per head on CUDA cores): 4 requests x 64 heads over 1024
/// f32 rows of 512.
const EXACT_ATTN: (usize, usize, usize, usize) = (4, 64, 512, 1024);
/// A V4-Flash prefill chunk's routed experts, gate and up fused: (tokens, top-k, experts, n,
/// k) = 2048 tokens to 6 of 256 experts of 4096 x 4096.
const MOE_PREFILL: (usize, usize, usize, usize, usize) = (2048, 6, 256, 4096, 4096);
/// Decode attention over the engine's 584-byte FP8 rows, all heads of a request per tile:
/// 32 requests x 8192 rows, 64 heads (one GPU) and 16 (TP 4), 132 parts (an H100's SMs).
const ATTN_FP8: (usize, usize, [usize; 2], usize) = (32, 8192, [64, 16], 132);

/// The indexer's scores of a decode step: 32 requests at 8K context (2048 compressed keys each,
/// ratio 4), V4-Flash's 64 indexer heads of 128: (tokens, keys, heads, dim).
const INDEXER: (usize, usize, usize, usize) = (32, 2048, 64, 128);

/// Dense linears of V4-Flash through the dense GEMM: (name, FP8, m, n, k). A decode step of 32
/// sequences through wq_b, the shared expert's gate (few tiles: K split) and the bf16 output
/// head; a prefill chunk of 2048 tokens through a 4096 x 4096 FP8 linear.
const DENSE: [(&str, bool, usize, usize, usize); 4] = [
    ("wq_b", true, 32, 32_768, 1024),
    ("shared gate", true, 32, 2048, 4096),
    ("output head", false, 32, 129_280, 4096),
    ("prefill", true, 2048, 4096, 4096),
];

/// The cases in table order, with their analytic costs.
fn planned() -> Vec<Row> {
    let (gr, gc) = GEMV;
    let (m, n, k) = GEMM;
    let (experts, er, ec, pairs) = GROUPED;
    let (vocab, hidden) = HEAD;
    let (batch, heads, dim, per) = ATTN;
    let row = |what: String, cost: Cost| Row {
        what,
        cost,
        seconds: None,
    };
    let mut out = vec![
        row(
            "device copy (1 GiB, read + write)".into(),
            cost::device_copy(COPY_BYTES),
        ),
        row(format!("NVFP4 GEMV {gr}x{gc}"), cost::nvfp4_gemv(gr, gc)),
        row(
            format!("NVFP4 GEMM {m}x{n}x{k} (bf16 tensor cores)"),
            cost::nvfp4_gemm(m, n, k),
        ),
        row(
            format!("MXFP4 grouped GEMV {pairs} of {experts} experts {er}x{ec}"),
            cost::mxfp4_grouped_gemv(pairs, 1, er, ec),
        ),
        row(
            format!("bf16 GEMV (output head) {vocab}x{hidden}"),
            cost::bf16_gemv(vocab, hidden, 1),
        ),
        row(
            format!("decode attention {batch}x{heads} heads, {per} f32 rows of {dim}"),
            cost::attn_decode(batch, heads, dim, per, 4 * dim),
        ),
    ];
    let (tokens, top_k, experts, mn, mk) = MOE_PREFILL;
    for mma in ["device MMA", "mma.sync"] {
        out.push(row(
            format!(
                "NVFP4 grouped GEMM {tokens} tokens x top-{top_k} of {experts} experts {mn}x{mk} \
                 ({mma})"
            ),
            cost::grouped_gemm(tokens * top_k, tokens, experts, mn, mk),
        ));
    }
    let (batch, per, heads_fp8, _) = ATTN_FP8;
    for heads in heads_fp8 {
        let shape = fp8_shape(heads);
        out.push(row(
            format!("decode attention FP8 {batch}x{heads} heads (MMA), {per} rows of 584 B"),
            cost::attn_decode(batch, heads, shape.dim(), per, shape.row_bytes()),
        ));
    }
    // The exact kernels (the engine's bits) at the shapes of their fast counterparts above.
    out.push(row(
        format!("exact GEMV bf16 (output head) {vocab}x{hidden}"),
        cost::bf16_gemv(vocab, hidden, 1),
    ));
    let (batch, heads, dim, per) = EXACT_ATTN;
    out.push(row(
        format!("exact attention {batch}x{heads} heads, {per} f32 rows of {dim}"),
        cost::attn_decode(batch, heads, dim, per, 4 * dim),
    ));
    // What the device decode step runs for the routed experts (`exact_pairs`), next to the
    // grouped GEMV above.
    out.push(row(
        format!("exact pairs MXFP4 {pairs} of {experts} experts {er}x{ec}"),
        cost::mxfp4_grouped_gemv(pairs, 1, er, ec),
    ));
    // Each on the device's own tile instruction (the warpgroup MMA on sm_90), then on
    // `mma.sync` (the same kernel elsewhere; on sm_90 the comparison).
    for (what, fp8, m, n, k) in DENSE {
        let form = if fp8 { "FP8" } else { "bf16" };
        for mma in ["device MMA", "mma.sync"] {
            out.push(row(
                format!("dense GEMM {form} ({what}) {m}x{n}x{k} ({mma})"),
                cost::dense_gemm(m, n, k, fp8),
            ));
        }
    }
    // The FP8 GEMV the per-op backend runs, one weight read per vector, at wq_b's shape.
    let (_, _, m, n, k) = DENSE[0];
    out.push(row(
        format!("FP8 GEMV per vector (wq_b) {m}x{n}x{k}"),
        cost::dense_gemm(m, n, k, true),
    ));
    let (tokens, keys, heads, dim) = INDEXER;
    for how in ["exact, CUDA cores", "tensor cores"] {
        out.push(row(
            format!("indexer scores {tokens}x{keys} keys, {heads} heads of {dim} ({how})"),
            cost::indexer_scores(tokens, keys, heads, dim),
        ));
    }
    out
}

/// V4's attention rows: 448 e4m3 + 64 bf16 values.
fn fp8_shape(heads: usize) -> kernels::attn_fp8::Fp8AttnShape {
    kernels::attn_fp8::Fp8AttnShape {
        heads,
        nope: 448,
        rope: 64,
        scale: 1.0 / 512f32.sqrt(),
        parts: ATTN_FP8.3,
    }
}

/// Mean seconds per call of `run`, best of three timed batches.
fn time(gpu: &Gpu, mut run: impl FnMut() -> Result<(), KernelError>) -> Result<f64, KernelError> {
    run()?;
    gpu.stream.synchronize()?;
    let probe = Instant::now();
    run()?;
    gpu.stream.synchronize()?;
    let once = probe.elapsed().max(Duration::from_micros(1));
    let calls = (0.1 / once.as_secs_f64()).clamp(3.0, 2000.0) as u32;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let start = Instant::now();
        for _ in 0..calls {
            run()?;
        }
        gpu.stream.synchronize()?;
        best = best.min(start.elapsed().as_secs_f64() / f64::from(calls));
    }
    Ok(best)
}

/// `count` random bytes, each and-ed with `mask`.
fn random_bytes(rng: &mut Rng, count: usize, mask: u8) -> Vec<u8> {
    let mut out: Vec<u8> = (0..count.div_ceil(8))
        .flat_map(|_| rng.next_u64().to_le_bytes())
        .map(|b| b & mask)
        .collect();
    out.truncate(count);
    out
}

fn random(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.normal()).collect()
}

struct Row {
    what: String,
    cost: Cost,
    /// Measured (GPU runs only).
    seconds: Option<f64>,
}

mod steps;
use steps::engine_steps;

/// The kernel table: analytic columns always, measured ones where timed; `copy` is the
/// measured copy bandwidth in GB/s.
fn print_table(rows: &[Row], copy: Option<f64>) {
    println!(
        "{:<58} {:>12} {:>12} {:>10} {:>9} {:>9} {:>7}",
        "kernel", "MB/launch", "GFLOP/launch", "us/call", "GB/s", "TFLOP/s", "% copy"
    );
    for row in rows {
        let (mb, gflop) = (row.cost.bytes as f64 / 1e6, row.cost.flops as f64 / 1e9);
        let measured = row.seconds.map_or_else(
            || format!("{:>10} {:>9} {:>9} {:>7}", "-", "-", "-", "-"),
            |t| {
                let gbs = row.cost.bytes as f64 / t / 1e9;
                let tflops = row.cost.flops as f64 / t / 1e12;
                let share =
                    copy.map_or_else(|| "-".to_owned(), |c| format!("{:.0}%", 100.0 * gbs / c));
                format!("{:>10.1} {gbs:>9.1} {tflops:>9.2} {share:>7}", t * 1e6)
            },
        );
        println!("{:<58} {mb:>12.2} {gflop:>12.3} {measured}", row.what);
    }
}

fn main() -> Result<(), KernelError> {
    let Some(mut gpu) = Gpu::open()? else {
        println!("kernel-bench: no CUDA driver or device; analytic costs only\n");
        print_table(&planned(), None);
        // Where a GPU is required (gpu-check.sh), measuring nothing is a failure.
        if kernels::gpu_test::required() {
            return Err(KernelError::Unsupported(format!(
                "no GPU, and {}=1",
                kernels::gpu_test::REQUIRE_GPU
            )));
        }
        return Ok(());
    };
    let mut rng = Rng::for_tensor(9, "bench");
    let mut rows = planned();
    let mut times = Vec::with_capacity(rows.len());

    // Device copy: read + write of 1 GiB.
    let src: CudaSlice<u8> = gpu.stream.alloc_zeros(COPY_BYTES)?;
    let mut dst: CudaSlice<u8> = gpu.stream.alloc_zeros(COPY_BYTES)?;
    let t = time(&gpu, || Ok(gpu.stream.memcpy_dtod(&src, &mut dst)?))?;
    times.push(t);
    drop((src, dst));

    let (r, c) = GEMV;
    let w = random(&mut rng, r * c);
    let (packed, scales, scale_2) = quant::quant_nvfp4(&w, r, c).map_err(shape)?;
    drop(w);
    let d_packed = gpu.stream.clone_htod(&packed)?;
    let d_scales = gpu.stream.clone_htod(&scales)?;
    let d_x = gpu.stream.clone_htod(&random(&mut rng, c))?;
    let mut d_y: CudaSlice<f32> = gpu.stream.alloc_zeros(r)?;
    let format = GemvFormat::Nvfp4 { scale_2 };
    let t = time(&gpu, || {
        gpu.launch_gemv(format, &d_packed, &d_scales, &d_x, r, c, &mut d_y)
    })?;
    times.push(t);

    let (m, n, k) = GEMM;
    let w = random(&mut rng, n * k);
    let (gp, gs, g2) = quant::quant_nvfp4(&w, n, k).map_err(shape)?;
    let d_a = gpu.stream.clone_htod(&random(&mut rng, m * k))?;
    let d_gp = gpu.stream.clone_htod(&gp)?;
    let d_gs = gpu.stream.clone_htod(&gs)?;
    let mut d_c: CudaSlice<f32> = gpu.stream.alloc_zeros(m * n)?;
    let t = time(&gpu, || {
        gpu.launch_nvfp4_gemm(&d_a, &d_gp, &d_gs, g2, (m, n, k), &mut d_c)
    })?;
    times.push(t);
    drop((d_a, d_gp, d_gs, d_c));

    let (experts, er, ec, pairs) = GROUPED;
    let one = random(&mut rng, er * ec);
    let (ep, es) = quant::quant_mxfp4(&one, er, ec).map_err(shape)?;
    let d_ep = gpu.stream.clone_htod(&ep.repeat(experts))?;
    let d_es = gpu.stream.clone_htod(&es.repeat(experts))?;
    let d_ex = gpu.stream.clone_htod(&random(&mut rng, ec))?;
    let chosen: Vec<i32> = (0..pairs as i32).map(|i| i * 7 % experts as i32).collect();
    let d_token = gpu.stream.clone_htod(&vec![0i32; pairs])?;
    let d_expert = gpu.stream.clone_htod(&chosen)?;
    let mut d_ey: CudaSlice<f32> = gpu.stream.alloc_zeros(pairs * er)?;
    let stack = DeviceExperts {
        packed: &d_ep,
        scales: &d_es,
        scale_2: None,
        experts,
        rows: er,
        cols: ec,
    };
    let t = time(&gpu, || {
        gpu.launch_grouped_gemv(&stack, &d_ex, &d_token, &d_expert, pairs, &mut d_ey)
    })?;
    times.push(t);
    let ones = gpu.stream.clone_htod(&vec![1.0f32; experts])?;
    let exact_stack = kernels::cuda::PairStackRef {
        kernel: "exact_pairs_mxfp4",
        packed: &d_ep,
        scales: &d_es,
        scale_2: &ones,
        shape: (experts, er, ec),
    };
    let exact_pairs = time(&gpu, || {
        gpu.launch_exact_pairs(&exact_stack, (&d_token, &d_expert), &d_ex, pairs, &mut d_ey)
    })?;
    drop((d_ep, d_es, ones));

    let (vocab, hidden) = HEAD;
    let head: Vec<u16> = random(&mut rng, vocab * hidden)
        .into_iter()
        .map(engine::formats::f32_to_bf16)
        .collect();
    let d_head = gpu.stream.clone_htod(&head)?;
    let d_hx = gpu.stream.clone_htod(&random(&mut rng, hidden))?;
    let mut d_logits: CudaSlice<f32> = gpu.stream.alloc_zeros(vocab)?;
    let t = time(&gpu, || {
        gpu.launch_bf16_gemv(&d_head, &d_hx, vocab, hidden, 1, &mut d_logits)
    })?;
    times.push(t);
    drop((d_head, d_logits));

    let (batch, heads, dim, per) = ATTN;
    let pool_rows = batch * per;
    let pool: CudaSlice<u8> = gpu.stream.alloc_zeros(pool_rows * dim * 4)?;
    // Rows in a shuffled page order, as a real page table scatters them.
    let offsets: Vec<i64> = (0..pool_rows)
        .map(|i| ((i * 7919) % pool_rows * dim * 4) as i64)
        .collect();
    let starts: Vec<i64> = (0..=batch).map(|b| (b * per) as i64).collect();
    let shape = AttnShape {
        heads,
        dim,
        splits: 32,
        scale: 1.0 / (dim as f32).sqrt(),
    };
    let q = gpu
        .stream
        .clone_htod(&random(&mut rng, batch * heads * dim))?;
    let d_offsets = gpu.stream.clone_htod(&offsets)?;
    let d_starts = gpu.stream.clone_htod(&starts)?;
    let d_sinks = gpu.stream.clone_htod(&random(&mut rng, heads))?;
    let mut scratch = gpu.attn_scratch(batch, shape)?;
    let t = time(&gpu, || {
        gpu.launch_attn_decode(
            &q,
            &pool,
            &d_offsets,
            &d_starts,
            &d_sinks,
            shape,
            &mut scratch,
        )
    })?;
    times.push(t);
    drop((pool, d_offsets, d_starts, d_sinks, scratch));
    times.extend(time_moe_prefill(&mut gpu, &mut rng)?);
    times.extend(time_attn_fp8(&gpu, &mut rng)?);
    times.extend(time_exact(&gpu, &mut rng)?);
    times.push(exact_pairs);
    times.extend(time_dense(&mut gpu, &mut rng)?);
    times.extend(time_indexer(&gpu, &mut rng)?);

    for (row, t) in rows.iter_mut().zip(&times) {
        row.seconds = Some(*t);
    }
    let copy = rows[0].cost.bytes as f64 / times[0] / 1e9;
    print_table(&rows, Some(copy));

    println!("\n{:<58} {:>10} {:>12}", "engine", "us/step", "rate");
    for row in engine_steps()? {
        println!(
            "{:<58} {:>10.1} {:>7.1} {}",
            row.what,
            row.seconds * 1e6,
            row.rate,
            row.unit
        );
    }
    Ok(())
}

/// Times the exact GEMV on the output head and the exact attention on [`EXACT_ATTN`].
fn time_exact(gpu: &Gpu, rng: &mut Rng) -> Result<Vec<f64>, KernelError> {
    let (vocab, hidden) = HEAD;
    let head: Vec<u8> = random(rng, vocab * hidden)
        .into_iter()
        .flat_map(|v| engine::formats::f32_to_bf16(v).to_le_bytes())
        .collect();
    let w = gpu.upload_rows(kernels::cuda::StoredRows::Bf16(&head), vocab, hidden)?;
    drop(head);
    let x = gpu.stream.clone_htod(&random(rng, hidden))?;
    let mut y: CudaSlice<f32> = gpu.stream.alloc_zeros(vocab)?;
    let gemv = time(gpu, || gpu.launch_exact_gemv(&w, (0, vocab), &x, 1, &mut y))?;
    drop((w, y));
    let (batch, heads, dim, per) = EXACT_ATTN;
    let rows = batch * per;
    // f32 rows at byte offsets of a byte pool.
    let bytes: Vec<u8> = random(rng, rows * dim)
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let pool = gpu.stream.clone_htod(&bytes)?;
    let offsets: Vec<i64> = (0..rows)
        .map(|i| ((i * 7919) % rows * dim * 4) as i64)
        .collect();
    let starts: Vec<i64> = (0..=batch).map(|b| (b * per) as i64).collect();
    let q = gpu.stream.clone_htod(&random(rng, batch * heads * dim))?;
    let sinks = gpu.stream.clone_htod(&random(rng, heads))?;
    let (d_offsets, d_starts) = (
        gpu.stream.clone_htod(&offsets)?,
        gpu.stream.clone_htod(&starts)?,
    );
    let mut out: CudaSlice<f32> = gpu.stream.alloc_zeros(batch * heads * dim)?;
    let attn = time(gpu, || {
        gpu.launch_attn_exact(
            (
                (&q, &pool, &d_offsets, &d_starts, &sinks),
                engine::paged::layout::RowFormat::F32,
            ),
            (batch, heads, dim, per),
            1.0 / (dim as f32).sqrt(),
            &mut out,
        )
    })?;
    Ok(vec![gemv, attn])
}

/// Times the dense GEMM on each of [`DENSE`] (the device's tile instruction, then
/// `mma.sync`), then the per-vector FP8 GEMV on the first. Weights are random bytes (finite
/// values): the timing does not depend on them.
fn time_dense(gpu: &mut Gpu, rng: &mut Rng) -> Result<Vec<f64>, KernelError> {
    let own = gpu.bf16_mma();
    let mut times = Vec::with_capacity(2 * DENSE.len() + 1);
    for (_, fp8, m, n, k) in DENSE {
        // FP8 codes below 0x78 (no NaN); bf16 bytes whose high byte keeps the value small.
        let (w, scales) = if fp8 {
            let scales: Vec<u8> = (0..n.div_ceil(128) * k.div_ceil(128))
                .flat_map(|_| (1.0f32 / 256.0).to_le_bytes())
                .collect();
            (random_bytes(rng, n * k, 0x77), scales)
        } else {
            (random_bytes(rng, 2 * n * k, 0xBF), vec![0; 4])
        };
        let d_w = gpu.stream.clone_htod(&w)?;
        let d_s = gpu.stream.clone_htod(&scales)?;
        drop(w);
        let weight = if fp8 {
            GemmWeight::Fp8Block {
                codes: &d_w,
                scales: &d_s,
            }
        } else {
            GemmWeight::Bf16(&d_w)
        };
        let a = gpu.stream.clone_htod(&random(rng, m * k))?;
        let mut c: CudaSlice<f32> = gpu.stream.alloc_zeros(m * n)?;
        let mut scratch: CudaSlice<f32> = gpu
            .stream
            .alloc_zeros(gpu.dense_gemm_scratch((m, n, k)).max(1))?;
        for mma in [own, Bf16Mma::MmaSync] {
            gpu.set_bf16_mma(mma)?;
            times.push(time(gpu, || {
                gpu.launch_dense_gemm(weight, 0, &a, (m, n, k), &mut scratch, &mut c)
            })?);
        }
        gpu.set_bf16_mma(own)?;
    }
    let (_, _, m, n, k) = DENSE[0];
    let d_w = gpu.stream.clone_htod(&random_bytes(rng, n * k, 0x77))?;
    let d_s = gpu
        .stream
        .clone_htod(&vec![120u8; n.div_ceil(128) * k.div_ceil(128)])?;
    let x = gpu.stream.clone_htod(&random(rng, m * k))?;
    let mut y: CudaSlice<f32> = gpu.stream.alloc_zeros(m * n)?;
    let weight = DenseWeight::Fp8Block {
        w: &d_w,
        scales: &d_s,
    };
    times.push(time(gpu, || {
        gpu.launch_dense_gemv(weight, 0, &x, (n, k), m, &mut y)
    })?);
    Ok(times)
}

/// Times the indexer's scores on [`INDEXER`]: the exact kernel, then the tensor-core one.
fn time_indexer(gpu: &Gpu, rng: &mut Rng) -> Result<Vec<f64>, KernelError> {
    let (tokens, keys, heads, dim) = INDEXER;
    let s = &gpu.stream;
    let q = s.clone_htod(&random(rng, tokens * heads * dim))?;
    let w = s.clone_htod(&random(rng, tokens * heads))?;
    let d_keys = s.clone_htod(&random(rng, tokens * keys * dim))?;
    let starts: Vec<i64> = (0..tokens).map(|t| (t * keys) as i64).collect();
    let (d_starts, d_visible) = (
        s.clone_htod(&starts)?,
        s.clone_htod(&vec![keys as i32; tokens])?,
    );
    let mut scores: CudaSlice<f32> = s.alloc_zeros(tokens * keys)?;
    let mut times = Vec::with_capacity(2);
    for tensor_cores in [false, true] {
        let spec = ScoreSpec {
            tokens,
            heads,
            dim,
            scale: 1.0 / (dim as f32).sqrt(),
            max_keys: keys,
            tensor_cores,
        };
        times.push(time(gpu, || {
            gpu.launch_indexer_scores(
                (&q, &w, &d_keys),
                (&d_starts, &d_visible),
                spec,
                &mut scores,
            )
        })?);
    }
    Ok(times)
}

/// Times the grouped GEMM on [`MOE_PREFILL`] (uniform routing: every expert used), on the
/// device's tile instruction then on `mma.sync`.
fn time_moe_prefill(gpu: &mut Gpu, rng: &mut Rng) -> Result<Vec<f64>, KernelError> {
    let (tokens, top_k, experts, n, k) = MOE_PREFILL;
    let one = random(rng, n * k);
    let (packed, scales, scale_2) = quant::quant_nvfp4(&one, n, k).map_err(shape)?;
    drop(one);
    let d_packed = gpu.stream.clone_htod(&packed.repeat(experts))?;
    let d_scales = gpu.stream.clone_htod(&scales.repeat(experts))?;
    let d_scale_2 = gpu.stream.clone_htod(&vec![scale_2; experts])?;
    let pairs = tokens * top_k;
    let token: Vec<i32> = (0..pairs).map(|p| (p / top_k) as i32).collect();
    let expert: Vec<i32> = (0..pairs).map(|p| ((p * 37) % experts) as i32).collect();
    let d_a = gpu.stream.clone_htod(&random(rng, tokens * k))?;
    let d_token = gpu.stream.clone_htod(&token)?;
    let d_expert = gpu.stream.clone_htod(&expert)?;
    let mut out: CudaSlice<f32> = gpu.stream.alloc_zeros(pairs * n)?;
    let mut grouping = gpu.moe_grouping(pairs, experts)?;
    let stack = kernels::cuda::DeviceStack {
        packed: &d_packed,
        scales: &d_scales,
        scale_2: Some(&d_scale_2),
        experts,
        n,
        k,
    };
    let own = gpu.bf16_mma();
    let mut times = Vec::with_capacity(2);
    for mma in [own, Bf16Mma::MmaSync] {
        gpu.set_bf16_mma(mma)?;
        times.push(time(gpu, || {
            gpu.launch_grouped_gemm(&d_a, &d_token, &d_expert, &stack, &mut grouping, &mut out)
        })?);
    }
    gpu.set_bf16_mma(own)?;
    Ok(times)
}

/// Times FP8 decode attention at each head count of [`ATTN_FP8`] over one pool of
/// `batch * per` encoded rows, the rows of each request scattered over the pool.
fn time_attn_fp8(gpu: &Gpu, rng: &mut Rng) -> Result<Vec<f64>, KernelError> {
    let (batch, per, heads_fp8, _) = ATTN_FP8;
    let data = kernels::attn_fp8::synthetic(rng, fp8_shape(64), &vec![per; batch], 0);
    let n = data.offsets.len();
    // A fixed permutation (multiplying by a unit mod n), as a page table scatters rows.
    let offsets: Vec<i64> = (0..n).map(|i| data.offsets[(i * 7919) % n]).collect();
    let d_pool = gpu.stream.clone_htod(&data.pool)?;
    let d_offsets = gpu.stream.clone_htod(&offsets)?;
    let d_starts = gpu.stream.clone_htod(&data.starts)?;
    let mut times = Vec::new();
    for heads in heads_fp8 {
        let shape = fp8_shape(heads);
        let q = gpu
            .stream
            .clone_htod(&random(rng, batch * heads * shape.dim()))?;
        let sinks = gpu.stream.clone_htod(&random(rng, heads))?;
        let mut scratch = gpu.attn_fp8_scratch(batch, shape)?;
        times.push(time(gpu, || {
            gpu.launch_attn_decode_fp8(&q, &d_pool, &d_offsets, &d_starts, &sinks, &mut scratch)
        })?);
    }
    Ok(times)
}

#[expect(clippy::needless_pass_by_value, reason = "used as map_err(shape)")]
fn shape(e: quant::QuantError) -> KernelError {
    KernelError::Shape(e.to_string())
}
