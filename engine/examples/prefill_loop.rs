//! Runs one prompt's prefill again and again, for a profiler (`perf record`):
//! `cargo run --release -p engine --example prefill_loop -- DIR [TOKENS] [RUNS]`.
//! Prints the fastest run; `pdctl bench-engine` is the benchmark.

use engine::model::{Logits, Model};

#[expect(clippy::print_stdout, reason = "example output")]
#[expect(
    clippy::expect_used,
    reason = "a profiling harness: any failure ends it"
)]
fn main() {
    let mut args = std::env::args().skip(1);
    let dir = args
        .next()
        .expect("usage: prefill_loop DIR [TOKENS] [RUNS]");
    let tokens: u32 = args.next().map_or(512, |a| a.parse().expect("TOKENS"));
    let runs: usize = args.next().map_or(20, |a| a.parse().expect("RUNS"));
    let model = Model::load(std::path::Path::new(&dir)).expect("load");
    let prompt: Vec<u32> = (0..tokens).map(|i| (i * 7919 + 13) % 100_000).collect();
    let mut best = f64::MAX;
    for _ in 0..runs {
        let mut state = model.new_state();
        let started = std::time::Instant::now();
        model
            .forward(&mut state, &prompt, Logits::Last)
            .expect("forward");
        best = best.min(started.elapsed().as_secs_f64());
    }
    println!(
        "prefill {tokens} tokens: fastest of {runs} runs {:.1} ms, {:.1} tok/s",
        best * 1e3,
        f64::from(tokens) / best
    );
}
