//! The memory-bandwidth roofline `bench-engine` compares decode with: the read bandwidth this
//! machine reaches with the engine's threads, measured in the same run.

use std::time::Instant;

/// Bytes the probe reads per pass: far larger than any last-level cache.
const PROBE_BYTES: usize = 1 << 30;

/// Best read bandwidth in GB/s over `passes` passes of a 1 GiB buffer, summed by every rayon
/// thread over its own contiguous part (integer adds: the loop vectorizes and is bound by
/// memory, not by a dependency chain).
pub fn read_bandwidth_gbs(passes: u32) -> f64 {
    use rayon::prelude::*;
    let words = PROBE_BYTES / 8;
    let buffer: Vec<u64> = (0..words as u64).collect();
    let threads = rayon::current_num_threads().max(1);
    let part = words.div_ceil(threads);
    let mut best = 0.0f64;
    let mut sink = 0u64;
    for _ in 0..passes.max(1) {
        let started = Instant::now();
        let sum: u64 = buffer
            .par_chunks(part)
            .map(|c| c.iter().fold(0u64, |a, &w| a.wrapping_add(w)))
            .reduce(|| 0, u64::wrapping_add);
        let secs = started.elapsed().as_secs_f64();
        sink ^= sum;
        best = best.max(PROBE_BYTES as f64 / secs / 1e9);
    }
    std::hint::black_box(sink);
    best
}
