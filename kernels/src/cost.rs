//! What a kernel launch must move and compute at the least: the bytes every operand and result
//! takes once (weights in their stored format, rows, inputs, outputs) and the multiply-adds of
//! the math (2 FLOPs each). `kernel-bench` prints these for every case it runs, with or without
//! a GPU; on a GPU it divides them by the measured time, so a kernel that reads a byte twice
//! shows as a lower fraction of the copy bandwidth rather than as more traffic.

/// Bytes and FLOPs of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cost {
    pub bytes: u64,
    pub flops: u64,
}

fn n(v: usize) -> u64 {
    v as u64
}

/// A device-to-device copy of `bytes`: each byte read and written.
pub fn device_copy(bytes: usize) -> Cost {
    Cost {
        bytes: 2 * n(bytes),
        flops: 0,
    }
}

/// `y = W x` with NVFP4 `W` `[rows, cols]`: packed codes, e4m3 scales per 16, one f32 global
/// scale; f32 `x` and `y`.
pub fn nvfp4_gemv(rows: usize, cols: usize) -> Cost {
    let weights = n(rows) * n(cols) / 2 + n(rows) * n(cols) / 16 + 4;
    Cost {
        bytes: weights + 4 * (n(cols) + n(rows)),
        flops: 2 * n(rows) * n(cols),
    }
}

/// `C = bf16(A) Wᵀ`: f32 `A` `[m, k]`, NVFP4 `W` `[n, k]`, f32 `C` `[m, n]`.
pub fn nvfp4_gemm(m: usize, nn: usize, k: usize) -> Cost {
    let weights = n(nn) * n(k) / 2 + n(nn) * n(k) / 16 + 4;
    Cost {
        bytes: 4 * n(m) * n(k) + weights + 4 * n(m) * n(nn),
        flops: 2 * n(m) * n(nn) * n(k),
    }
}

/// The routed experts of a decode step: `pairs` (token, expert) products with MXFP4 experts of
/// `[rows, cols]` (codes, e8m0 scales per 32), each pair's expert read once, `tokens` f32
/// inputs, f32 outputs and two i32 indices per pair.
pub fn mxfp4_grouped_gemv(pairs: usize, tokens: usize, rows: usize, cols: usize) -> Cost {
    let expert = n(rows) * n(cols) / 2 + n(rows) * n(cols) / 32;
    Cost {
        bytes: n(pairs) * expert + 4 * n(tokens) * n(cols) + 4 * n(pairs) * n(rows) + 8 * n(pairs),
        flops: 2 * n(pairs) * n(rows) * n(cols),
    }
}

/// `y = W x` for `vectors` f32 inputs with a bf16 `W` `[rows, cols]`.
pub fn bf16_gemv(rows: usize, cols: usize, vectors: usize) -> Cost {
    Cost {
        bytes: 2 * n(rows) * n(cols) + 4 * n(vectors) * (n(cols) + n(rows)),
        flops: 2 * n(rows) * n(cols) * n(vectors),
    }
}

/// `C = bf16(A) Wᵀ` for a dense weight `[n, k]` read once: bf16 (2 bytes a value) or FP8
/// (1 byte a value and an f32 scale per 128 x 128 tile); f32 `A` `[m, k]` and `C` `[m, n]`.
pub fn dense_gemm(m: usize, nn: usize, k: usize, fp8: bool) -> Cost {
    let weight = if fp8 {
        n(nn) * n(k) + 4 * n(nn.div_ceil(128)) * n(k.div_ceil(128))
    } else {
        2 * n(nn) * n(k)
    };
    Cost {
        bytes: weight + 4 * n(m) * (n(k) + n(nn)),
        flops: 2 * n(m) * n(nn) * n(k),
    }
}

/// Decode attention (K = V): `batch` requests of `heads` query heads over `rows` rows each of
/// `row_bytes` bytes and `dim` values: every row read once for all heads (the minimum; a kernel
/// that reads it once per head moves `heads` times more), its 8-byte offset, f32 queries and
/// outputs; `q·k` and `p·v` per head and row.
pub fn attn_decode(batch: usize, heads: usize, dim: usize, rows: usize, row_bytes: usize) -> Cost {
    let kv = n(batch) * n(rows) * (n(row_bytes) + 8);
    Cost {
        bytes: kv + 2 * 4 * n(batch) * n(heads) * n(dim),
        flops: 4 * n(batch) * n(heads) * n(rows) * n(dim),
    }
}

/// The grouped routed-expert GEMM of a prefill chunk: `pairs` (token, expert) products over
/// `experts` NVFP4 experts of `[n, k]` that the routing used (each read once), `tokens` f32
/// inputs, f32 outputs and two i32 indices per pair.
pub fn grouped_gemm(pairs: usize, tokens: usize, experts: usize, nn: usize, k: usize) -> Cost {
    let expert = n(nn) * n(k) / 2 + n(nn) * n(k) / 16 + 4;
    Cost {
        bytes: n(experts) * expert + 4 * n(tokens) * n(k) + 4 * n(pairs) * n(nn) + 8 * n(pairs),
        flops: 2 * n(pairs) * n(nn) * n(k),
    }
}

/// Lightning-indexer scores and top-k for one query over `keys` f32 keys of `dim`.
pub fn indexer(keys: usize, heads: usize, dim: usize, top_k: usize) -> Cost {
    Cost {
        bytes: 4 * n(keys) * n(dim) + 4 * n(heads) * (n(dim) + 1) + 4 * n(top_k),
        flops: 2 * n(keys) * n(heads) * n(dim),
    }
}

/// The indexer's scores of `tokens` queries, each over its own `keys` f32 keys of `dim` with
/// `heads` heads (queries and weights read, one f32 score written per key).
pub fn indexer_scores(tokens: usize, keys: usize, heads: usize, dim: usize) -> Cost {
    Cost {
        bytes: n(tokens) * (4 * n(keys) * (n(dim) + 1) + 4 * n(heads) * (n(dim) + 1)),
        flops: 2 * n(tokens) * n(keys) * n(heads) * n(dim),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn costs_count_each_operand_once() {
        // 16384 x 7168 NVFP4: 58.7 MB of codes, 7.3 MB of scales, the vectors, the global scale.
        assert_eq!(
            nvfp4_gemv(16_384, 7168),
            Cost {
                bytes: 58_720_256 + 7_340_032 + 4 + 4 * (7168 + 16_384),
                flops: 2 * 16_384 * 7168,
            }
        );
        assert_eq!(device_copy(1 << 30).bytes, 2 << 30);
        // Attention: 4096 rows of 584 bytes read once however many heads read them.
        let one = attn_decode(1, 1, 512, 4096, 584);
        let many = attn_decode(1, 64, 512, 4096, 584);
        assert_eq!(many.bytes - one.bytes, 2 * 4 * 63 * 512);
        assert_eq!(many.flops, 64 * one.flops);
        // 8 pairs of one token: 8 experts read, one input.
        let g = mxfp4_grouped_gemv(8, 1, 2048, 7168);
        assert_eq!(g.flops, 2 * 8 * 2048 * 7168);
        assert!(g.bytes > 8 * 2048 * 7168 / 2);
        assert_eq!(bf16_gemv(10, 20, 3).bytes, 400 + 4 * 3 * 30);
        assert_eq!(nvfp4_gemm(2, 4, 32).flops, 2 * 2 * 4 * 32);
        // The weight once for every row of A: 256 x 256 FP8 is 64 KiB and four tile scales.
        assert_eq!(
            dense_gemm(3, 256, 256, true).bytes,
            65_536 + 16 + 4 * 3 * 512
        );
        assert_eq!(
            dense_gemm(64, 256, 256, false).bytes - dense_gemm(32, 256, 256, false).bytes,
            4 * 32 * 512
        );
        assert_eq!(indexer(100, 8, 16, 4).flops, 2 * 100 * 8 * 16);
        // Each expert once however many pairs use it.
        let g = grouped_gemm(600, 100, 4, 64, 32);
        assert_eq!(g.flops, 2 * 600 * 64 * 32);
        assert_eq!(
            grouped_gemm(1200, 100, 4, 64, 32).bytes - g.bytes,
            600 * (4 * 64 + 8)
        );
    }
}
