//! Launch wrapper of `exact_gemv.cu`: weight rows times vectors with the engine's dot product
//! definition, in every stored format, so a linear on the device gives the CPU's bits.

use crate::cuda::kernel;
use cudarc::driver::{CudaSlice, LaunchConfig};

use super::{Gpu, KernelError, grid_dim, non_empty};

/// A stored weight on the host, `[rows, cols]`, in the engine's forms (`WeightForm`).
#[derive(Debug, Clone, Copy)]
pub enum StoredRows<'a> {
    F32(&'a [f32]),
    /// bf16 bits, little-endian.
    Bf16(&'a [u8]),
    /// e4m3 codes and the f32 scale of each 128 x 128 tile.
    Fp8Block {
        codes: &'a [u8],
        scales: &'a [f32],
    },
    Nvfp4 {
        packed: &'a [u8],
        scales: &'a [u8],
        scale_2: f32,
    },
    Mxfp4 {
        packed: &'a [u8],
        scales: &'a [u8],
    },
}

impl<'a> StoredRows<'a> {
    /// The stored form of an engine weight, as it is in the checkpoint's mapping.
    pub fn of(w: &'a engine::tensor::Weight) -> Self {
        use engine::tensor::WeightForm;
        match w.form() {
            WeightForm::F32(v) => StoredRows::F32(v),
            WeightForm::Bf16(b) => StoredRows::Bf16(b.as_slice()),
            WeightForm::Fp8Block { codes, scales } => StoredRows::Fp8Block {
                codes: codes.as_slice(),
                scales,
            },
            WeightForm::Nvfp4 {
                packed,
                scales,
                scale_2,
            } => StoredRows::Nvfp4 {
                packed: packed.as_slice(),
                scales: scales.as_slice(),
                scale_2: *scale_2,
            },
            WeightForm::Mxfp4 { packed, scales } => StoredRows::Mxfp4 {
                packed: packed.as_slice(),
                scales: scales.as_slice(),
            },
        }
    }
}

/// The same weight on the device: its bytes and scale bytes, its format.
#[derive(Debug)]
pub struct DeviceRows {
    kernel: &'static str,
    data: CudaSlice<u8>,
    scales: CudaSlice<u8>,
    scale_2: f32,
    pub rows: usize,
    pub cols: usize,
}

/// A stored weight's kernel, bytes, scale bytes and global scale, ready to upload.
struct Parts {
    kernel: &'static str,
    data: Vec<u8>,
    scales: Vec<u8>,
    scale_2: f32,
}

fn bytes_of(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

impl StoredRows<'_> {
    /// The upload of this weight, checked against `[rows, cols]`.
    fn parts(&self, rows: usize, cols: usize) -> Result<Parts, String> {
        let n = rows * cols;
        let tiles = rows.div_ceil(128) * cols.div_ceil(128);
        let (kernel, data, scales, scale_2, ok) = match *self {
            StoredRows::F32(v) => (
                kernel::exact_gemv_f32::NAME,
                bytes_of(v),
                Vec::new(),
                1.0,
                v.len() == n,
            ),
            StoredRows::Bf16(b) => (
                kernel::exact_gemv_bf16::NAME,
                b.to_vec(),
                Vec::new(),
                1.0,
                b.len() == 2 * n,
            ),
            StoredRows::Fp8Block { codes, scales } => (
                kernel::exact_gemv_fp8_block::NAME,
                codes.to_vec(),
                bytes_of(scales),
                1.0,
                codes.len() == n && scales.len() == tiles,
            ),
            StoredRows::Nvfp4 {
                packed,
                scales,
                scale_2,
            } => (
                kernel::exact_gemv_nvfp4::NAME,
                packed.to_vec(),
                scales.to_vec(),
                scale_2,
                cols.is_multiple_of(16) && packed.len() == n / 2 && scales.len() == n / 16,
            ),
            StoredRows::Mxfp4 { packed, scales } => (
                kernel::exact_gemv_mxfp4::NAME,
                packed.to_vec(),
                scales.to_vec(),
                1.0,
                cols.is_multiple_of(32) && packed.len() == n / 2 && scales.len() == n / 32,
            ),
        };
        if !ok || cols == 0 {
            return Err(format!(
                "exact gemv: the stored bytes are not a [{rows}, {cols}] weight"
            ));
        }
        Ok(Parts {
            kernel,
            data,
            scales,
            scale_2,
        })
    }
}

impl DeviceRows {
    /// The same bytes as the dense GEMM reads them, for bf16 and FP8-block weights (the
    /// f32 and FP4 forms have none).
    pub fn gemm_weight(&self) -> Option<super::GemmWeight<'_>> {
        match self.kernel {
            k if k == kernel::exact_gemv_bf16::NAME => Some(super::GemmWeight::Bf16(&self.data)),
            k if k == kernel::exact_gemv_fp8_block::NAME => Some(super::GemmWeight::Fp8Block {
                codes: &self.data,
                scales: &self.scales,
            }),
            _ => None,
        }
    }
}

impl Gpu {
    /// [`Self::launch_exact_gemv`]'s product by the dense GEMM (bf16 and FP8-block weights
    /// only): `y` `[n, rows]` within `dense_gemm::bound`; `scratch` holds
    /// [`Self::dense_gemm_scratch`] values.
    pub fn launch_fast_linear(
        &self,
        w: &DeviceRows,
        (row0, rows): (usize, usize),
        x: &CudaSlice<f32>,
        n: usize,
        scratch: &mut CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let weight = w.gemm_weight().ok_or_else(|| {
            KernelError::Shape("the fast linear takes bf16 and FP8-block weights only".into())
        })?;
        self.launch_dense_gemm(weight, row0, x, (n, rows, w.cols), scratch, y)
    }

    /// Uploads a stored weight for [`Self::launch_exact_gemv`].
    pub fn upload_rows(
        &self,
        w: StoredRows<'_>,
        rows: usize,
        cols: usize,
    ) -> Result<DeviceRows, KernelError> {
        let Parts {
            kernel,
            data,
            scales,
            scale_2,
        } = w.parts(rows, cols)?;
        Ok(DeviceRows {
            kernel,
            data: self.stream.clone_htod(&non_empty(&data))?,
            scales: self.stream.clone_htod(&non_empty(&scales))?,
            scale_2,
            rows,
            cols,
        })
    }

    /// Rows `row0..row0 + rows` of `w` times each of the `vectors` vectors in `x`
    /// (`[vectors, cols]`), vector-major `[vectors, rows]`: the engine's `dots_source` bits.
    pub fn exact_gemv(
        &self,
        w: StoredRows<'_>,
        (total_rows, cols): (usize, usize),
        (row0, rows): (usize, usize),
        x: &[f32],
        vectors: usize,
    ) -> Result<Vec<f32>, KernelError> {
        if x.len() != vectors * cols || row0 + rows > total_rows {
            return Err(KernelError::Shape(format!(
                "exact gemv: {} values for {vectors} vectors of {cols}; rows {row0}+{rows} of \
                 {total_rows}",
                x.len()
            )));
        }
        let dev = self.upload_rows(w, total_rows, cols)?;
        let d_x = self.stream.clone_htod(&non_empty(x))?;
        let mut d_y = self
            .stream
            .clone_htod(&vec![f32::NAN; (vectors * rows).max(1)])?;
        self.launch_exact_gemv(&dev, (row0, rows), &d_x, vectors, &mut d_y)?;
        let mut y = self.stream.clone_dtoh(&d_y)?;
        y.truncate(vectors * rows);
        Ok(y)
    }

    /// [`Self::exact_gemv`] on device buffers.
    pub fn launch_exact_gemv(
        &self,
        w: &DeviceRows,
        (row0, rows): (usize, usize),
        x: &CudaSlice<f32>,
        vectors: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        if row0 + rows > w.rows || x.len() < vectors * w.cols || y.len() < vectors * rows {
            return Err(KernelError::Shape("exact gemv buffers".into()));
        }
        if rows == 0 || vectors == 0 {
            return Ok(());
        }
        let f = self.exact.load_function(w.kernel)?;
        let (cols, row0_i, rows_i) = (w.cols as i64, row0 as i64, rows as i64);
        let vectors_i = i32::try_from(vectors).map_err(|_| KernelError::Shape("vectors".into()))?;
        let mut launch = self.stream.launch_builder(&f);
        kernel::exact_gemv::args(
            &mut launch,
            &w.data,
            &w.scales,
            &w.scale_2,
            &cols,
            &row0_i,
            &rows_i,
            x,
            &vectors_i,
            y,
        );
        // SAFETY: the parameters of every `exact_gemv_*` in order; the weight's bytes were
        // checked against its shape at upload, the vectors and outputs just above.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (grid_dim(rows.div_ceil(32), "rows")?, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })?;
        }
        Ok(())
    }
}

/// Stacked FP4 experts on the host, `[experts, rows, cols]` each in its stored bytes.
#[derive(Debug, Clone, Copy)]
pub enum StoredExperts<'a> {
    Nvfp4 {
        packed: &'a [u8],
        scales: &'a [u8],
        /// One per expert.
        scale_2: &'a [f32],
    },
    Mxfp4 {
        packed: &'a [u8],
        scales: &'a [u8],
    },
}

impl Gpu {
    /// Each pair's expert rows times its token's vector with the engine's bits (the routed
    /// experts' projections, `Weight::apply` per pair): `x` is `[tokens, cols]`, the result
    /// `[pairs, rows]`; a pair whose expert is outside the stack gets a NaN row.
    pub fn exact_pairs(
        &self,
        stack: StoredExperts<'_>,
        (experts, rows, cols): (usize, usize, usize),
        pair_token: &[i32],
        pair_expert: &[i32],
        x: &[f32],
        tokens: usize,
    ) -> Result<Vec<f32>, KernelError> {
        let per = rows * cols;
        let (kernel, packed, scales, scale_2, ok) = match stack {
            StoredExperts::Nvfp4 {
                packed,
                scales,
                scale_2,
            } => (
                kernel::exact_pairs_nvfp4::NAME,
                packed,
                scales,
                scale_2.to_vec(),
                cols.is_multiple_of(16)
                    && scales.len() == experts * per / 16
                    && scale_2.len() == experts,
            ),
            StoredExperts::Mxfp4 { packed, scales } => (
                kernel::exact_pairs_mxfp4::NAME,
                packed,
                scales,
                vec![1.0; experts],
                cols.is_multiple_of(32) && scales.len() == experts * per / 32,
            ),
        };
        let pairs = pair_token.len();
        if !ok
            || packed.len() != experts * per / 2
            || pair_expert.len() != pairs
            || x.len() != tokens * cols
            || pair_token.iter().any(|&t| t < 0 || t as usize >= tokens)
            || pairs > 65_535
        {
            return Err(KernelError::Shape(format!(
                "exact pairs: {pairs} pairs over {experts} experts of [{rows}, {cols}] and {tokens} \
                 tokens (at most 65535 pairs a launch)"
            )));
        }
        let mut d_y = self
            .stream
            .clone_htod(&vec![f32::NAN; (pairs * rows).max(1)])?;
        if pairs > 0 && rows > 0 {
            let d_packed = self.stream.clone_htod(&non_empty(packed))?;
            let d_scales = self.stream.clone_htod(&non_empty(scales))?;
            let d_s2 = self.stream.clone_htod(&non_empty(&scale_2))?;
            let d_token = self.stream.clone_htod(pair_token)?;
            let d_expert = self.stream.clone_htod(pair_expert)?;
            let d_x = self.stream.clone_htod(&non_empty(x))?;
            let stack = PairStackRef {
                kernel,
                packed: &d_packed,
                scales: &d_scales,
                scale_2: &d_s2,
                shape: (experts, rows, cols),
            };
            self.launch_exact_pairs(&stack, (&d_token, &d_expert), &d_x, pairs, &mut d_y)?;
        }
        let mut y = self.stream.clone_dtoh(&d_y)?;
        y.truncate(pairs * rows);
        Ok(y)
    }

    /// The MoE output of every token with the engine's bits: `ys` `[tokens * k, hidden]` (slot
    /// outputs, token-major), `weights` `[tokens, k]`, `shared` `[tokens, hidden]`.
    pub fn moe_combine(
        &self,
        ys: &[f32],
        weights: &[f32],
        shared: &[f32],
        k: usize,
    ) -> Result<Vec<f32>, KernelError> {
        let tokens = weights.len().checked_div(k).unwrap_or(0);
        let hidden = shared.len().checked_div(tokens).unwrap_or(0);
        if k == 0 || weights.len() != tokens * k || ys.len() != tokens * k * hidden {
            return Err(KernelError::Shape("moe_combine shapes".into()));
        }
        let mut d_out = self
            .stream
            .clone_htod(&vec![f32::NAN; shared.len().max(1)])?;
        if tokens > 0 && hidden > 0 {
            let d_ys = self.stream.clone_htod(ys)?;
            let d_w = self.stream.clone_htod(weights)?;
            let d_shared = self.stream.clone_htod(shared)?;
            self.launch_moe_combine((&d_ys, &d_w, &d_shared), (tokens, k, hidden), &mut d_out)?;
        }
        let mut out = self.stream.clone_dtoh(&d_out)?;
        out.truncate(shared.len());
        Ok(out)
    }
}

/// How a MoE layer routes (`engine::weights::MoeWeights`'s gate parts).
#[derive(Debug, Clone, Copy)]
pub struct Routing<'a> {
    pub experts: usize,
    /// Experts a token goes to.
    pub k: usize,
    /// Top-k layers' selection bias (`None`: the scores alone).
    pub bias: Option<&'a [f32]>,
    /// Hash layers' table `[vocab, k]` (takes precedence over the bias).
    pub tid2eid: Option<&'a [u32]>,
    pub scaling: f32,
}

impl Gpu {
    /// `moe::route_logits` of every token with the engine's bits: `logits` `[tokens, experts]`;
    /// the chosen experts `[tokens, k]` in slot order and their weights. A token outside the
    /// hash table gets experts -1 and NaN weights.
    pub fn moe_route(
        &self,
        logits: &[f32],
        token_ids: &[u32],
        r: &Routing<'_>,
    ) -> Result<(Vec<i32>, Vec<f32>), KernelError> {
        let tokens = token_ids.len();
        if r.k == 0
            || r.k > r.experts
            || logits.len() != tokens * r.experts
            || r.bias.is_some_and(|b| b.len() != r.experts)
            || r.tid2eid.is_some_and(|t| !t.len().is_multiple_of(r.k))
            || i32::try_from(r.experts).is_err()
        {
            return Err(KernelError::Shape(format!(
                "moe_route: {} logits for {tokens} tokens of {} experts, top {}",
                logits.len(),
                r.experts,
                r.k
            )));
        }
        let s = &self.stream;
        let ids: Vec<i32> = token_ids
            .iter()
            .map(|&t| i32::try_from(t).unwrap_or(-1))
            .collect();
        let d_logits = s.clone_htod(&non_empty(logits))?;
        let d_ids = s.clone_htod(&non_empty(&ids))?;
        let d_bias = s.clone_htod(&non_empty(r.bias.unwrap_or(&[])))?;
        let d_table = s.clone_htod(&non_empty(r.tid2eid.unwrap_or(&[])))?;
        let mut d_scores = s.alloc_zeros::<f32>((tokens * r.experts).max(1))?;
        let mut d_chosen = s.alloc_zeros::<i32>((tokens * r.k).max(1))?;
        let mut d_weights = s.alloc_zeros::<f32>((tokens * r.k).max(1))?;
        if tokens > 0 {
            let table_rows = r.tid2eid.map_or(0, |t| t.len() / r.k);
            self.launch_moe_route(
                (&d_logits, &d_ids),
                (r.bias.map(|_| &d_bias), r.tid2eid.map(|_| &d_table)),
                (tokens, r.experts, r.k, table_rows, r.scaling),
                &mut d_scores,
                (&mut d_chosen, &mut d_weights),
            )?;
        }
        let mut chosen = s.clone_dtoh(&d_chosen)?;
        let mut weights = s.clone_dtoh(&d_weights)?;
        chosen.truncate(tokens * r.k);
        weights.truncate(tokens * r.k);
        Ok((chosen, weights))
    }
}

/// A stack of every routed expert's projection on the device, as `exact_pairs_*` reads it.
#[derive(Debug, Clone, Copy)]
pub struct PairStackRef<'a> {
    /// `exact_pairs_nvfp4` or `exact_pairs_mxfp4`.
    pub kernel: &'static str,
    pub packed: &'a CudaSlice<u8>,
    pub scales: &'a CudaSlice<u8>,
    /// One per expert (1 for MXFP4).
    pub scale_2: &'a CudaSlice<f32>,
    /// (experts, rows, cols).
    pub shape: (usize, usize, usize),
}

impl Gpu {
    /// [`Self::exact_pairs`] on device buffers: pair p's expert `pair_expert[p]` times row
    /// `pair_token[p]` of `x` into `y` `[pairs, rows]` (at most 65535 pairs a launch).
    pub fn launch_exact_pairs(
        &self,
        stack: &PairStackRef<'_>,
        (pair_token, pair_expert): (&CudaSlice<i32>, &CudaSlice<i32>),
        x: &CudaSlice<f32>,
        pairs: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let (experts, rows, cols) = stack.shape;
        if pairs > 65_535
            || pair_token.len() < pairs
            || pair_expert.len() < pairs
            || y.len() < pairs * rows
        {
            return Err(KernelError::Shape(format!("exact pairs: {pairs} pairs")));
        }
        if pairs == 0 || rows == 0 {
            return Ok(());
        }
        let (experts_i, rows_i, cols_i) = (experts as i32, rows as i64, cols as i64);
        let f = self.exact.load_function(stack.kernel)?;
        let mut launch = self.stream.launch_builder(&f);
        kernel::exact_pairs::args(
            &mut launch,
            stack.packed,
            stack.scales,
            stack.scale_2,
            &experts_i,
            &rows_i,
            &cols_i,
            pair_token,
            pair_expert,
            x,
            y,
        );
        // SAFETY: `exact_pairs_*`'s parameters in order; the stack holds `experts` experts of
        // [rows, cols] (its uploader checked the bytes), the pairs' tokens inside `x` (the
        // caller's check); an expert outside the stack gives a NaN row.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (grid_dim(rows.div_ceil(32), "rows")?, pairs as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })?;
        }
        Ok(())
    }

    /// [`Self::moe_combine`] on device buffers: `n` tokens of `k` slots of `hidden`.
    pub fn launch_moe_combine(
        &self,
        (ys, weights, shared): (&CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<f32>),
        (n, k, hidden): (usize, usize, usize),
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        if k == 0
            || ys.len() < n * k * hidden
            || weights.len() < n * k
            || shared.len() < n * hidden
            || out.len() < n * hidden
        {
            return Err(KernelError::Shape("moe_combine buffers".into()));
        }
        if n == 0 || hidden == 0 {
            return Ok(());
        }
        let (k_i, hidden_i) = (k as i32, hidden as i64);
        let f = self.exact.load_function(kernel::moe_combine::NAME)?;
        let mut launch = self.stream.launch_builder(&f);
        kernel::moe_combine::args(&mut launch, ys, weights, shared, &k_i, &hidden_i, out);
        // SAFETY: `moe_combine`'s parameters in order; shapes checked above; a block a token.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (grid_dim(n, "tokens")?, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })?;
        }
        Ok(())
    }

    /// [`Self::moe_route`] on device buffers: (logits, token ids), the layer's (bias, hash
    /// table) where it has them, (tokens, experts, k, table rows, scaling), a scratch of
    /// `tokens * experts` scores, and the (experts, weights) out, `[tokens, k]` each.
    pub fn launch_moe_route(
        &self,
        (logits, token_ids): (&CudaSlice<f32>, &CudaSlice<i32>),
        (bias, table): (Option<&CudaSlice<f32>>, Option<&CudaSlice<u32>>),
        (tokens, experts, k, table_rows, scaling): (usize, usize, usize, usize, f32),
        scores: &mut CudaSlice<f32>,
        (chosen, weights): (&mut CudaSlice<i32>, &mut CudaSlice<f32>),
    ) -> Result<(), KernelError> {
        if k == 0
            || k > experts
            || logits.len() < tokens * experts
            || token_ids.len() < tokens
            || scores.len() < tokens * experts
            || chosen.len() < tokens * k
            || weights.len() < tokens * k
            || bias.is_some_and(|b| b.len() < experts)
            || table.is_some_and(|t| t.len() < table_rows * k)
            || i32::try_from(experts).is_err()
        {
            return Err(KernelError::Shape(format!(
                "moe_route: {tokens} tokens of {experts} experts, top {k}"
            )));
        }
        if tokens == 0 {
            return Ok(());
        }
        let (tokens_i, experts_i, k_i) = (tokens as i32, experts as i32, k as i32);
        let table_rows = table_rows as i64;
        let f = self.exact.load_function(kernel::moe_route::NAME)?;
        let mut launch = self.stream.launch_builder(&f);
        // Null device pointers (`None`) select the other routing modes.
        kernel::moe_route::args(
            &mut launch,
            logits,
            &tokens_i,
            &experts_i,
            &k_i,
            &bias,
            &table,
            &table_rows,
            token_ids,
            &scaling,
            scores,
            chosen,
            weights,
        );
        // SAFETY: `moe_route`'s parameters in order (a null pointer where a mode is off); the
        // buffers hold `tokens` rows (checked above).
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (grid_dim(tokens.div_ceil(128), "tokens")?, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            })?;
        }
        Ok(())
    }
}
