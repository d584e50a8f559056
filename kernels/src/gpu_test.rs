//! What a GPU test does on a machine without a usable GPU. By default it skips, saying so on
//! stderr, so `cargo test` stays green on CPU-only machines. With `PDSERVE_REQUIRE_GPU=1` (set by
//! `gpu-check.sh` on a lent GPU machine) the same situation is a failure: a run meant to exercise
//! the GPU can then never pass without having done so.

/// The variable that makes a missing GPU a test failure.
pub const REQUIRE_GPU: &str = "PDSERVE_REQUIRE_GPU";

/// Whether this process's GPU tests must find a GPU.
pub fn required() -> bool {
    std::env::var(REQUIRE_GPU).as_deref() == Ok("1")
}

/// The verdict for test `test` that found no GPU (`why`): `Ok` to skip (the line to print), or
/// `Err` with the failure message when a GPU is `required`.
pub fn verdict(required: bool, test: &str, why: &str) -> Result<String, String> {
    if required {
        Err(format!(
            "{test}: {why}, but {REQUIRE_GPU}=1 demands a GPU (this run would otherwise pass \
             without testing anything on one)"
        ))
    } else {
        Ok(format!("skipping {test}: {why}"))
    }
}

/// Skips test `test` (prints why) or fails it when a GPU is required.
///
/// # Panics
/// When `PDSERVE_REQUIRE_GPU=1`: that is the failure.
#[expect(clippy::print_stderr, reason = "a skipped test says so on stderr")]
pub fn skip(test: &str, why: &str) {
    match verdict(required(), test, why) {
        Ok(line) => eprintln!("{line}"),
        Err(failure) => panic!("{failure}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_gpu_fails_only_where_one_is_required() {
        assert_eq!(
            verdict(false, "t", "no CUDA driver"),
            Ok("skipping t: no CUDA driver".to_owned())
        );
        let e = verdict(true, "t", "no CUDA driver").unwrap_err();
        assert!(
            e.contains("PDSERVE_REQUIRE_GPU=1") && e.contains("no CUDA driver"),
            "{e}"
        );
    }
}
