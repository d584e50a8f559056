//! [`CudaBackend`], the engine backend on a CUDA device. It keeps every layer's routed experts
//! on the device in their stored FP4 form and runs a layer's (token, expert) pairs as grouped
//! GEMVs (gate and up, SwiGLU, down), the shared expert with the dense (bf16 or FP8-block)
//! GEMVs, the attention linears (projections, compressors, indexer) with the same GEMVs, the
//! bf16 output head as a GEMV over the final hidden states, and the attention core
//! (softmax with sinks over each token's keys) with the split-KV decode attention kernel over
//! the distinct rows of the call, uploaded per call. The expert compositions and the attention
//! packing are `crate::compose`'s, tested on the CPU references; [`LayerOps`] maps their
//! operations to kernels. Everything else of the forward pass stays on the CPU reference
//! (hybrid mode), which the engine only accepts when the operator asked for it.

use std::{collections::BTreeMap, ops::Range, path::Path};

use cudarc::driver::CudaSlice;
use engine::{
    backend::{AttendBatch, Backend, DeviceError, ExpertBatch, LinearId, Op},
    config::{ExpertFormat, ModelConfig},
    weights::stored::{Fp4Stack, StoredLinear, StoredWeights},
};

use super::{AttnShape, DenseWeight, DeviceExperts, GemmWeight, Gpu, KernelError, non_empty};
use crate::compose::{self, ExpertDims, Ops, Proj};

/// One projection of every routed expert of a layer, on the device.
#[derive(Debug)]
struct DeviceStack {
    packed: CudaSlice<u8>,
    scales: CudaSlice<u8>,
    scale_2: Option<CudaSlice<f32>>,
    experts: usize,
    rows: usize,
    cols: usize,
}

impl DeviceStack {
    /// Uploads every expert of `stack` straight from the checkpoint's mapping into one
    /// device buffer `[experts, rows, cols]` (no host staging copy).
    fn upload(gpu: &Gpu, stack: &Fp4Stack<'_>) -> Result<Self, KernelError> {
        let (per_packed, per_scales) = (stack.packed_per_expert(), stack.scales_per_expert());
        let experts = stack.experts.len();
        let bad = stack.experts.iter().any(|e| {
            e.packed.len() != per_packed
                || e.scales.len() != per_scales
                || e.scale_2.is_some() != (stack.format == ExpertFormat::Nvfp4)
        });
        if !stack.cols.is_multiple_of(stack.block()) || bad || experts == 0 {
            return Err(KernelError::Shape(format!(
                "{:?} experts {}x{}x{}",
                stack.format, experts, stack.rows, stack.cols
            )));
        }
        let s = &gpu.stream;
        let mut packed = s.alloc_zeros::<u8>((experts * per_packed).max(1))?;
        let mut scales = s.alloc_zeros::<u8>((experts * per_scales).max(1))?;
        for (x, e) in stack.experts.iter().enumerate() {
            if per_packed > 0 {
                s.memcpy_htod(
                    e.packed,
                    &mut packed.slice_mut(x * per_packed..(x + 1) * per_packed),
                )?;
            }
            if per_scales > 0 {
                s.memcpy_htod(
                    e.scales,
                    &mut scales.slice_mut(x * per_scales..(x + 1) * per_scales),
                )?;
            }
        }
        let scale_2: Vec<f32> = stack.experts.iter().filter_map(|e| e.scale_2).collect();
        Ok(Self {
            packed,
            scales,
            scale_2: match stack.format {
                ExpertFormat::Nvfp4 => Some(s.clone_htod(&scale_2)?),
                _ => None,
            },
            experts,
            rows: stack.rows,
            cols: stack.cols,
        })
    }

    fn view(&self) -> DeviceExperts<'_> {
        DeviceExperts {
            packed: &self.packed,
            scales: &self.scales,
            scale_2: self.scale_2.as_ref(),
            experts: self.experts,
            rows: self.rows,
            cols: self.cols,
        }
    }
}

/// A layer's routed experts on the device.
#[derive(Debug)]
struct DeviceLayer {
    w1: DeviceStack,
    w2: DeviceStack,
    w3: DeviceStack,
}

/// A dense linear on the device, in the checkpoint's linear format.
#[derive(Debug)]
enum DeviceLinear {
    Bf16(CudaSlice<u16>),
    Fp8Block {
        codes: CudaSlice<u8>,
        /// ue8m0 per 128 x 128 tile (the GEMV's form).
        scales: CudaSlice<u8>,
        /// The same scales as f32 bytes (the dense GEMM's form).
        f32_scales: CudaSlice<u8>,
    },
}

impl DeviceLinear {
    /// Uploads a stored linear straight from the checkpoint's mapping; returns it with its
    /// bytes.
    fn upload(gpu: &Gpu, stored: &StoredLinear<'_>) -> Result<(Self, usize), KernelError> {
        Ok(match *stored {
            StoredLinear::Bf16 { bytes, .. } => (
                Self::Bf16(upload_bf16(gpu, bytes)?),
                crate::backend::linear_device_bytes(stored),
            ),
            StoredLinear::Fp8Block { codes, scales, .. } => {
                let f32_scales: Vec<u8> = scales
                    .iter()
                    .flat_map(|&e| engine::formats::e8m0_to_f32(e).to_le_bytes())
                    .collect();
                (
                    Self::Fp8Block {
                        codes: upload_bytes(gpu, codes)?,
                        scales: upload_bytes(gpu, scales)?,
                        f32_scales: upload_bytes(gpu, &f32_scales)?,
                    },
                    crate::backend::linear_device_bytes(stored),
                )
            }
        })
    }

    fn gemm(&self) -> GemmWeight<'_> {
        match self {
            Self::Bf16(w) => GemmWeight::Bf16Bits(w),
            Self::Fp8Block {
                codes, f32_scales, ..
            } => GemmWeight::Fp8Block {
                codes,
                scales: f32_scales,
            },
        }
    }

    fn view(&self) -> DenseWeight<'_> {
        match self {
            Self::Bf16(w) => DenseWeight::Bf16(w),
            Self::Fp8Block { codes, scales, .. } => DenseWeight::Fp8Block { w: codes, scales },
        }
    }
}

/// Bytes from the mapping to a new device buffer (one byte when empty: the kernels take a
/// valid pointer).
fn upload_bytes(gpu: &Gpu, bytes: &[u8]) -> Result<CudaSlice<u8>, KernelError> {
    let mut out = gpu.stream.alloc_zeros::<u8>(bytes.len().max(1))?;
    if !bytes.is_empty() {
        gpu.stream
            .memcpy_htod(bytes, &mut out.slice_mut(..bytes.len()))?;
    }
    Ok(out)
}

/// Little-endian bf16 bytes from the mapping to a device bf16 buffer, copied as bytes (the
/// mapping need not be 2-aligned, so it is never reinterpreted as `u16` on the host).
fn upload_bf16(gpu: &Gpu, bytes: &[u8]) -> Result<CudaSlice<u16>, KernelError> {
    if !bytes.len().is_multiple_of(2) {
        return Err(KernelError::Shape(format!("{} bf16 bytes", bytes.len())));
    }
    let n = bytes.len() / 2;
    let mut out = gpu.stream.alloc_zeros::<u16>(n.max(1))?;
    if n > 0 {
        // SAFETY: a buffer of n u16 is 2n bytes, every byte pattern is a valid u8, and the
        // device is little-endian like the checkpoint, so the bytes land as the bf16 bits.
        let mut view = unsafe { out.transmute_mut::<u8>(bytes.len()) }
            .ok_or_else(|| KernelError::Shape(format!("{n} bf16 values")))?;
        gpu.stream.memcpy_htod(bytes, &mut view)?;
    }
    Ok(out)
}

/// A layer's shared expert on the device: gate `[inter, hidden]`, down `[hidden, inter]`, up.
#[derive(Debug)]
struct DeviceShared {
    w1: DeviceLinear,
    w2: DeviceLinear,
    w3: DeviceLinear,
}

/// The engine backend for the routed experts on a CUDA device.
#[derive(Debug)]
pub struct CudaBackend {
    gpu: Gpu,
    layers: Vec<DeviceLayer>,
    shared: Vec<DeviceShared>,
    /// Every layer's attention linears that exist in it, with their `(rows, cols)`.
    linears: BTreeMap<(usize, LinearId), (DeviceLinear, (usize, usize))>,
    /// `head.weight`, bf16 `[vocab, hidden]`.
    head: DeviceLinear,
    vocab: usize,
    hidden: usize,
    inter: usize,
    limit: f32,
    /// Bytes of weights on the device.
    pub device_bytes: usize,
}

impl CudaBackend {
    /// Opens device 0 and uploads every layer's routed experts (in their stored FP4 form), its
    /// shared expert (in the linear format) and the output head (bf16) from the checkpoint at
    /// `dir`. `Ok(None)` when no CUDA driver or
    /// device is present.
    pub fn load(dir: &Path, config: &ModelConfig) -> Result<Option<Self>, KernelError> {
        Self::load_on(dir, config, 0, true)
    }

    /// [`Self::load`] on device `ordinal`; without `routed`, the routed experts stay off the
    /// device (a rank whose experts are computed by its expert group, or sliced over the
    /// group, does not use them) and the backend does not claim them.
    pub fn load_on(
        dir: &Path,
        config: &ModelConfig,
        ordinal: usize,
        routed: bool,
    ) -> Result<Option<Self>, KernelError> {
        let Some(gpu) = Gpu::open_on(ordinal)? else {
            return Ok(None);
        };
        let checkpoint = |e: engine::weights::LoadError| KernelError::Checkpoint(e.to_string());
        let stored = StoredWeights::open(dir, config).map_err(checkpoint)?;
        let needed =
            crate::backend::device_weight_bytes(&stored, config, routed).map_err(checkpoint)?;
        crate::backend::check_device_room(ordinal, needed, gpu.memory()?)
            .map_err(KernelError::Unsupported)?;
        if !stored.has_fp4_experts() {
            return Err(KernelError::Unsupported(format!(
                "the CUDA backend runs FP4 routed experts (NVFP4 or MXFP4); this \
                 checkpoint's experts are {:?}",
                config.expert_format
            )));
        }
        let mut layers = Vec::with_capacity(config.num_layers());
        let mut shared = Vec::with_capacity(config.num_layers());
        let mut linears = BTreeMap::new();
        let mut device_bytes = 0;
        // Layer by layer, straight from the mapping; after each layer the pages it read are
        // released, so the host holds at most one layer of it beyond what the CPU model keeps.
        for layer in 0..config.num_layers() {
            if routed {
                let experts = stored.fp4_layer(layer).map_err(checkpoint)?;
                for s in [&experts.w1, &experts.w2, &experts.w3] {
                    device_bytes += s.stored_bytes();
                }
                layers.push(DeviceLayer {
                    w1: DeviceStack::upload(&gpu, &experts.w1)?,
                    w2: DeviceStack::upload(&gpu, &experts.w2)?,
                    w3: DeviceStack::upload(&gpu, &experts.w3)?,
                });
            }
            let mut linear = |name: &str| -> Result<(DeviceLinear, (usize, usize)), KernelError> {
                let s = stored.linear(name).map_err(checkpoint)?;
                let (linear, bytes) = DeviceLinear::upload(&gpu, &s)?;
                device_bytes += bytes;
                Ok((linear, s.shape()))
            };
            let shared_name =
                |w: &str| format!("{}ffn.shared_experts.{w}", engine::schema::layer(layer));
            shared.push(DeviceShared {
                w1: linear(&shared_name("w1"))?.0,
                w2: linear(&shared_name("w2"))?.0,
                w3: linear(&shared_name("w3"))?.0,
            });
            for which in LinearId::ALL {
                let name = which.tensor(layer);
                if stored.contains(&name) {
                    linears.insert((layer, which), linear(&name)?);
                }
            }
            gpu.stream.synchronize()?;
            stored.release_resident().map_err(checkpoint)?;
        }
        let head_bytes = stored.bf16("head.weight").map_err(checkpoint)?;
        device_bytes += head_bytes.len();
        let head = DeviceLinear::Bf16(upload_bf16(&gpu, head_bytes)?);
        gpu.stream.synchronize()?;
        Ok(Some(Self {
            gpu,
            layers,
            shared,
            linears,
            head,
            vocab: config.vocab_size,
            hidden: config.hidden_size,
            inter: config.moe_intermediate_size,
            limit: config.swiglu_limit,
            device_bytes,
        }))
    }
}

impl CudaBackend {
    fn logits_of(&self, hidden: &[Vec<f32>]) -> Result<Vec<Vec<f32>>, KernelError> {
        if let Some(h) = hidden.iter().find(|h| h.len() != self.hidden) {
            return Err(KernelError::Shape(format!(
                "hidden state of {} values, not {}",
                h.len(),
                self.hidden
            )));
        }
        if hidden.is_empty() {
            return Ok(Vec::new());
        }
        let s = &self.gpu.stream;
        let d_x = s.clone_htod(&hidden.concat())?;
        let mut d_y = s.clone_htod(&vec![f32::NAN; hidden.len() * self.vocab])?;
        let shape = (hidden.len(), self.vocab, self.hidden);
        dense_product(&self.gpu, &self.head, 0, &d_x, shape, &mut d_y)?;
        let y = s.clone_dtoh(&d_y)?;
        Ok(y.chunks_exact(self.vocab).map(<[f32]>::to_vec).collect())
    }
}

/// `y = W[row0..row0 + n] · x[v]` for `m` vectors of `k`: the dense GEMM from
/// `prefill_gemm::GEMM_ROWS` vectors (a prompt chunk: each weight read once per 64 of them,
/// the vectors rounded to bf16), the GEMV below (each weight read once per vector).
fn dense_product(
    gpu: &Gpu,
    w: &DeviceLinear,
    row0: usize,
    x: &CudaSlice<f32>,
    (m, n, k): (usize, usize, usize),
    y: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    if crate::prefill_gemm::takes_gemm(m) {
        let parts = gpu.dense_gemm_scratch((m, n, k));
        let mut scratch = gpu.stream.alloc_zeros::<f32>(parts.max(1))?;
        return gpu.launch_dense_gemm(w.gemm(), row0, x, (m, n, k), &mut scratch, y);
    }
    gpu.launch_dense_gemv(w.view(), row0, x, (n, k), m, y)
}

/// Keys per split of the attention kernel (a token with more keys gets more splits).
const KEYS_PER_SPLIT: usize = 64;
/// Most splits per (token, head).
const MAX_SPLITS: usize = 32;

impl CudaBackend {
    fn attend_on_device(&self, b: AttendBatch<'_>) -> Result<Vec<Vec<f32>>, KernelError> {
        let packed = compose::pack_attend(&b).map_err(|e| KernelError::Shape(e.0))?;
        let tokens = b.queries.len();
        if tokens == 0 {
            return Ok(Vec::new());
        }
        let longest = b.keys.iter().map(Vec::len).max().unwrap_or(0);
        let shape = AttnShape {
            heads: b.heads,
            dim: b.head_dim,
            splits: longest.div_ceil(KEYS_PER_SPLIT).clamp(1, MAX_SPLITS),
            scale: b.scale,
        };
        let s = &self.gpu.stream;
        let d_q = s.clone_htod(&packed.queries)?;
        let d_pool = s.clone_htod(&non_empty(&packed.pool))?;
        let d_offsets = s.clone_htod(&non_empty(&packed.offsets))?;
        let d_starts = s.clone_htod(&packed.starts)?;
        let d_sinks = s.clone_htod(b.sinks)?;
        let mut scratch = self.gpu.attn_scratch(tokens, shape)?;
        self.gpu.launch_attn_decode(
            &d_q,
            &d_pool,
            &d_offsets,
            &d_starts,
            &d_sinks,
            shape,
            &mut scratch,
        )?;
        let out = s.clone_dtoh(&scratch.out)?;
        let width = b.heads * b.head_dim;
        Ok(out
            .chunks_exact(width)
            .take(tokens)
            .map(<[f32]>::to_vec)
            .collect())
    }

    /// Rows `rows` of an attention linear times each of `xs`.
    fn linear_on_device(
        &self,
        layer: usize,
        which: LinearId,
        rows: Range<usize>,
        xs: &[&[f32]],
    ) -> Result<Vec<Vec<f32>>, KernelError> {
        let (weight, (total, cols)) = self
            .linears
            .get(&(layer, which))
            .ok_or_else(|| KernelError::Shape(format!("layer {layer} has no {which:?}")))?;
        if rows.start > rows.end || rows.end > *total {
            return Err(KernelError::Shape(format!(
                "rows {rows:?} of {which:?} ({total} rows)"
            )));
        }
        if let Some(x) = xs.iter().find(|x| x.len() != *cols) {
            return Err(KernelError::Shape(format!(
                "{which:?} input of {} values, not {cols}",
                x.len()
            )));
        }
        let n = rows.len();
        if xs.is_empty() || n == 0 {
            return Ok(vec![Vec::new(); xs.len()]);
        }
        let s = &self.gpu.stream;
        let d_x = s.clone_htod(&xs.concat())?;
        let mut d_y = s.clone_htod(&vec![f32::NAN; xs.len() * n])?;
        dense_product(
            &self.gpu,
            weight,
            rows.start,
            &d_x,
            (xs.len(), n, *cols),
            &mut d_y,
        )?;
        Ok(s.clone_dtoh(&d_y)?
            .chunks_exact(n)
            .map(<[f32]>::to_vec)
            .collect())
    }

    /// The compositions' device operations for `layer`.
    /// Layer `layer`'s ops for a batch of `tokens` tokens.
    fn layer_ops(&self, layer: usize, tokens: usize) -> Result<LayerOps<'_>, KernelError> {
        // A backend loaded without the routed experts has none in any layer.
        let routed = self.layers.get(layer);
        match self.shared.get(layer) {
            Some(shared) => Ok(LayerOps {
                gpu: &self.gpu,
                routed,
                shared,
                dims: self.dims(routed.map_or(0, |r| r.w1.experts)),
                gemm: crate::prefill_gemm::takes_gemm(tokens),
            }),
            None => Err(KernelError::Shape(format!("no layer {layer}"))),
        }
    }

    fn dims(&self, experts: usize) -> ExpertDims {
        ExpertDims {
            hidden: self.hidden,
            inter: self.inter,
            experts,
            limit: self.limit,
        }
    }
}

/// The device operations of one layer's expert compositions (see [`compose::Ops`]).
#[derive(Debug)]
struct LayerOps<'a> {
    gpu: &'a Gpu,
    /// `None` when the backend was loaded without the routed experts.
    routed: Option<&'a DeviceLayer>,
    shared: &'a DeviceShared,
    dims: ExpertDims,
    /// A prompt chunk's tokens (`prefill_gemm::takes_gemm`): experts as the grouped GEMM.
    gemm: bool,
}

impl Ops for LayerOps<'_> {
    type Error = KernelError;
    type Buf = CudaSlice<f32>;
    type Idx = CudaSlice<i32>;

    fn put(&self, values: &[f32]) -> Result<CudaSlice<f32>, KernelError> {
        Ok(self.gpu.stream.clone_htod(&non_empty(values))?)
    }

    fn put_idx(&self, values: &[i32]) -> Result<CudaSlice<i32>, KernelError> {
        Ok(self.gpu.stream.clone_htod(&non_empty(values))?)
    }

    fn poisoned(&self, len: usize) -> Result<CudaSlice<f32>, KernelError> {
        Ok(self.gpu.stream.clone_htod(&vec![f32::NAN; len.max(1)])?)
    }

    fn get(&self, buf: &CudaSlice<f32>) -> Result<Vec<f32>, KernelError> {
        Ok(self.gpu.stream.clone_dtoh(buf)?)
    }

    fn grouped(
        &self,
        proj: Proj,
        x: &CudaSlice<f32>,
        token: &CudaSlice<i32>,
        expert: &CudaSlice<i32>,
        pairs: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let routed = self.routed.ok_or_else(|| {
            KernelError::Unsupported("the routed experts are not on this device".into())
        })?;
        let stack = match proj {
            Proj::Gate => &routed.w1,
            Proj::Down => &routed.w2,
            Proj::Up => &routed.w3,
        };
        // A prompt chunk's experts as the grouped GEMM: each expert read once per 64 of its
        // pairs (`crate::prefill_gemm`).
        if self.gemm {
            let grouped = super::DeviceStack {
                packed: &stack.packed,
                scales: &stack.scales,
                scale_2: stack.scale_2.as_ref(),
                experts: stack.experts,
                n: stack.rows,
                k: stack.cols,
            };
            let mut grouping = self.gpu.moe_grouping(pairs, stack.experts)?;
            return self
                .gpu
                .launch_grouped_gemm(x, token, expert, &grouped, &mut grouping, y);
        }
        self.gpu
            .launch_grouped_gemv(&stack.view(), x, token, expert, pairs, y)
    }

    fn dense(
        &self,
        proj: Proj,
        x: &CudaSlice<f32>,
        vectors: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let (hidden, inter) = (self.dims.hidden, self.dims.inter);
        let (weight, rows, cols) = match proj {
            Proj::Gate => (&self.shared.w1, inter, hidden),
            Proj::Down => (&self.shared.w2, hidden, inter),
            Proj::Up => (&self.shared.w3, inter, hidden),
        };
        dense_product(self.gpu, weight, 0, x, (vectors, rows, cols), y)
    }

    fn swiglu(
        &self,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        n: usize,
        limit: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        self.gpu.launch_swiglu_clamp(gate, up, n, limit, out)
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn runs(&self, op: Op) -> bool {
        match op {
            Op::RoutedExperts => !self.layers.is_empty(),
            _ => matches!(
                op,
                Op::AttentionLinears | Op::AttentionCore | Op::SharedExpert | Op::OutputHead
            ),
        }
    }

    fn linear(
        &self,
        layer: usize,
        which: LinearId,
        rows: Range<usize>,
        xs: &[&[f32]],
    ) -> Result<Vec<Vec<f32>>, DeviceError> {
        self.linear_on_device(layer, which, rows, xs)
            .map_err(DeviceError::device)
    }

    fn routed_experts(&self, batch: ExpertBatch<'_>) -> Result<Vec<Vec<f32>>, DeviceError> {
        let ops = self
            .layer_ops(batch.layer, batch.xs.len())
            .map_err(DeviceError::device)?;
        compose::routed_experts(&ops, ops.dims, batch.xs, batch.pairs).map_err(DeviceError::device)
    }

    fn output_head(&self, hidden: &[Vec<f32>]) -> Result<Vec<Vec<f32>>, DeviceError> {
        self.logits_of(hidden).map_err(DeviceError::device)
    }

    fn shared_expert(&self, layer: usize, xs: &[Vec<f32>]) -> Result<Vec<Vec<f32>>, DeviceError> {
        let ops = self
            .layer_ops(layer, xs.len())
            .map_err(DeviceError::device)?;
        compose::shared_expert(&ops, ops.dims, xs).map_err(DeviceError::device)
    }

    fn attend(&self, batch: AttendBatch<'_>) -> Result<Vec<Vec<f32>>, DeviceError> {
        self.attend_on_device(batch).map_err(DeviceError::device)
    }
}
