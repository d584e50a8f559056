//! The routed experts on the GPU: the clamped SwiGLU kernel's wrappers and [`CudaBackend`],
//! the engine backend that keeps every layer's routed experts on the device in their stored
//! FP4 form and runs a layer's (token, expert) pairs as grouped GEMVs: gate and up, SwiGLU,
//! down. Everything else of the forward pass stays on the CPU reference (hybrid mode), which
//! the engine only accepts when the operator asked for it.

use std::path::Path;

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use engine::{
    backend::{Backend, ExpertBatch, Op},
    config::{ExpertFormat, ModelConfig},
    weights::fp4::{Fp4Stack, for_each_fp4_layer},
};

use super::{DeviceExperts, Gpu, KernelError, non_empty};

/// Threads per block of `swiglu_clamp`.
const SWIGLU_THREADS: u32 = 256;
/// Pairs per grouped launch (the kernels' grid y is at most 65535).
const PAIRS_PER_LAUNCH: usize = 65_535;

impl Gpu {
    /// `silu(min(g, limit)) * clamp(u, -limit, limit)` on the GPU (see `cpu::swiglu_clamp`);
    /// the output is poisoned with NaN before the launch.
    pub fn swiglu_clamp(
        &self,
        gate: &[f32],
        up: &[f32],
        limit: f32,
    ) -> Result<Vec<f32>, KernelError> {
        if gate.len() != up.len() {
            return Err(KernelError::Shape(format!(
                "swiglu: {} gate values, {} up values",
                gate.len(),
                up.len()
            )));
        }
        let d_gate = self.stream.clone_htod(&non_empty(gate))?;
        let d_up = self.stream.clone_htod(&non_empty(up))?;
        let mut d_out = self.stream.clone_htod(&vec![f32::NAN; gate.len().max(1)])?;
        self.launch_swiglu_clamp(&d_gate, &d_up, gate.len(), limit, &mut d_out)?;
        let mut out = self.stream.clone_dtoh(&d_out)?;
        out.truncate(gate.len());
        Ok(out)
    }

    /// Launches the clamped SwiGLU over the first `n` values of device buffers.
    pub fn launch_swiglu_clamp(
        &self,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        n: usize,
        limit: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        if gate.len() < n || up.len() < n || out.len() < n {
            return Err(KernelError::Shape(format!("swiglu over {n} values")));
        }
        if n == 0 {
            return Ok(());
        }
        let f = self.moe_act.load_function("swiglu_clamp")?;
        let n_arg = n as i64;
        let mut launch = self.stream.launch_builder(&f);
        launch.arg(gate).arg(up).arg(&n_arg).arg(&limit).arg(out);
        // A grid-stride loop: enough blocks to fill the device, never more than 65535 x 256.
        let blocks = super::grid_dim(n.div_ceil(SWIGLU_THREADS as usize).min(65_535), "swiglu")?;
        // SAFETY: argument types and order match the kernel; all buffers hold `n` values.
        unsafe {
            launch.launch(LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (SWIGLU_THREADS, 1, 1),
                shared_mem_bytes: 0,
            })?;
        }
        Ok(())
    }
}

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
    fn upload(gpu: &Gpu, stack: &Fp4Stack) -> Result<Self, KernelError> {
        let block = if stack.format == ExpertFormat::Nvfp4 {
            16
        } else {
            32
        };
        let elements = stack.experts * stack.rows * stack.cols;
        if !stack.cols.is_multiple_of(block)
            || stack.packed.len() != elements / 2
            || stack.scales.len() != elements / block
        {
            return Err(KernelError::Shape(format!(
                "{:?} experts {}x{}x{}",
                stack.format, stack.experts, stack.rows, stack.cols
            )));
        }
        Ok(Self {
            packed: gpu.stream.clone_htod(&non_empty(&stack.packed))?,
            scales: gpu.stream.clone_htod(&non_empty(&stack.scales))?,
            scale_2: match stack.format {
                ExpertFormat::Nvfp4 => Some(gpu.stream.clone_htod(&non_empty(&stack.scale_2))?),
                _ => None,
            },
            experts: stack.experts,
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

/// The engine backend for the routed experts on a CUDA device.
#[derive(Debug)]
pub struct CudaBackend {
    gpu: Gpu,
    layers: Vec<DeviceLayer>,
    hidden: usize,
    inter: usize,
    limit: f32,
    /// Bytes of expert weights on the device.
    pub device_bytes: usize,
}

impl CudaBackend {
    /// Opens device 0 and uploads every layer's routed experts from the checkpoint at `dir`
    /// in their stored FP4 form. `Ok(None)` when no CUDA driver or device is present.
    pub fn load(dir: &Path, config: &ModelConfig) -> Result<Option<Self>, KernelError> {
        let Some(gpu) = Gpu::open()? else {
            return Ok(None);
        };
        let mut layers = Vec::with_capacity(config.num_layers());
        let mut device_bytes = 0;
        let mut upload_error = None;
        let fp4 = for_each_fp4_layer(dir, config, &mut |layer| {
            let uploaded = (|| -> Result<DeviceLayer, KernelError> {
                Ok(DeviceLayer {
                    w1: DeviceStack::upload(&gpu, &layer.w1)?,
                    w2: DeviceStack::upload(&gpu, &layer.w2)?,
                    w3: DeviceStack::upload(&gpu, &layer.w3)?,
                })
            })();
            match uploaded {
                Ok(l) => {
                    for s in [&layer.w1, &layer.w2, &layer.w3] {
                        device_bytes += s.packed.len() + s.scales.len() + 4 * s.scale_2.len();
                    }
                    layers.push(l);
                    Ok(())
                }
                Err(e) => {
                    let text = e.to_string();
                    upload_error = Some(e);
                    Err(text)
                }
            }
        });
        if let Some(e) = upload_error {
            return Err(e);
        }
        match fp4 {
            Ok(true) => {}
            Ok(false) => {
                return Err(KernelError::Unsupported(format!(
                    "the CUDA backend runs FP4 routed experts (NVFP4 or MXFP4); this \
                     checkpoint's experts are {:?}",
                    config.expert_format
                )));
            }
            Err(e) => return Err(KernelError::Shape(e.to_string())),
        }
        gpu.stream.synchronize()?;
        Ok(Some(Self {
            gpu,
            layers,
            hidden: config.hidden_size,
            inter: config.moe_intermediate_size,
            limit: config.swiglu_limit,
            device_bytes,
        }))
    }

    /// The expert outputs of one launch group (at most [`PAIRS_PER_LAUNCH`] pairs), flat
    /// `[pairs, hidden]`.
    fn run_pairs(
        &self,
        layer: &DeviceLayer,
        d_x: &CudaSlice<f32>,
        pairs: &[(usize, usize)],
    ) -> Result<Vec<f32>, KernelError> {
        let n = pairs.len();
        let to_i32 =
            |v: usize| i32::try_from(v).map_err(|_| KernelError::Shape(format!("index {v}")));
        let tokens: Vec<i32> = pairs
            .iter()
            .map(|&(t, _)| to_i32(t))
            .collect::<Result<_, _>>()?;
        let experts: Vec<i32> = pairs
            .iter()
            .map(|&(_, e)| to_i32(e))
            .collect::<Result<_, _>>()?;
        let identity: Vec<i32> = (0..n).map(to_i32).collect::<Result<_, _>>()?;
        let s = &self.gpu.stream;
        let d_token = s.clone_htod(&tokens)?;
        let d_expert = s.clone_htod(&experts)?;
        let d_identity = s.clone_htod(&identity)?;
        // Poisoned: a launch that writes nothing cannot pass for a result.
        let mut d_gate = s.clone_htod(&vec![f32::NAN; n * self.inter])?;
        let mut d_up = s.clone_htod(&vec![f32::NAN; n * self.inter])?;
        let mut d_act = s.clone_htod(&vec![f32::NAN; n * self.inter])?;
        let mut d_y = s.clone_htod(&vec![f32::NAN; n * self.hidden])?;
        let gpu = &self.gpu;
        gpu.launch_grouped_gemv(&layer.w1.view(), d_x, &d_token, &d_expert, n, &mut d_gate)?;
        gpu.launch_grouped_gemv(&layer.w3.view(), d_x, &d_token, &d_expert, n, &mut d_up)?;
        gpu.launch_swiglu_clamp(&d_gate, &d_up, n * self.inter, self.limit, &mut d_act)?;
        gpu.launch_grouped_gemv(
            &layer.w2.view(),
            &d_act,
            &d_identity,
            &d_expert,
            n,
            &mut d_y,
        )?;
        Ok(s.clone_dtoh(&d_y)?)
    }

    fn experts_of(&self, batch: ExpertBatch<'_>) -> Result<Vec<Vec<f32>>, KernelError> {
        let layer = self
            .layers
            .get(batch.layer)
            .ok_or_else(|| KernelError::Shape(format!("no layer {}", batch.layer)))?;
        let experts = layer.w1.experts;
        if let Some(&(t, e)) = batch
            .pairs
            .iter()
            .find(|&&(t, e)| t >= batch.xs.len() || e >= experts)
        {
            return Err(KernelError::Shape(format!(
                "pair (token {t}, expert {e}) with {} tokens and {experts} experts",
                batch.xs.len()
            )));
        }
        if batch.pairs.is_empty() {
            return Ok(Vec::new());
        }
        if let Some(x) = batch.xs.iter().find(|x| x.len() != self.hidden) {
            return Err(KernelError::Shape(format!(
                "expert input of {} values, not {}",
                x.len(),
                self.hidden
            )));
        }
        let flat: Vec<f32> = batch.xs.concat();
        let d_x = self.gpu.stream.clone_htod(&flat)?;
        let mut out = Vec::with_capacity(batch.pairs.len());
        for group in batch.pairs.chunks(PAIRS_PER_LAUNCH) {
            let y = self.run_pairs(layer, &d_x, group)?;
            out.extend(y.chunks_exact(self.hidden).map(<[f32]>::to_vec));
        }
        Ok(out)
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn runs(&self, op: Op) -> bool {
        op == Op::RoutedExperts
    }

    fn routed_experts(&self, batch: ExpertBatch<'_>) -> Result<Vec<Vec<f32>>, String> {
        self.experts_of(batch).map_err(|e| e.to_string())
    }
}
