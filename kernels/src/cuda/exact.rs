//! Launch wrapper of `exact_gemv.cu`: weight rows times vectors with the engine's dot product
//! definition, in every stored format, so a linear on the device gives the CPU's bits.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

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
            StoredRows::F32(v) => ("exact_gemv_f32", bytes_of(v), Vec::new(), 1.0, v.len() == n),
            StoredRows::Bf16(b) => (
                "exact_gemv_bf16",
                b.to_vec(),
                Vec::new(),
                1.0,
                b.len() == 2 * n,
            ),
            StoredRows::Fp8Block { codes, scales } => (
                "exact_gemv_fp8_block",
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
                "exact_gemv_nvfp4",
                packed.to_vec(),
                scales.to_vec(),
                scale_2,
                cols.is_multiple_of(16) && packed.len() == n / 2 && scales.len() == n / 16,
            ),
            StoredRows::Mxfp4 { packed, scales } => (
                "exact_gemv_mxfp4",
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

impl Gpu {
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
        launch
            .arg(&w.data)
            .arg(&w.scales)
            .arg(&w.scale_2)
            .arg(&cols)
            .arg(&row0_i)
            .arg(&rows_i)
            .arg(x)
            .arg(&vectors_i)
            .arg(y);
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
