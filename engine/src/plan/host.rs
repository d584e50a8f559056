//! Whether a worker's state pools fit the host's memory before they are allocated. The pools
//! are allocated zeroed and the operating system maps their pages lazily, so an oversized pool
//! starts fine and the process is killed later, under load, when requests fill it; a worker
//! refuses to start instead, with the numbers. Every rank has its own pools (a rank of a
//! tensor-parallel group keeps a copy of every request's state).

use crate::{config::ModelConfig, paged::layout::StateLayout, scheduler::EngineConfig};

/// Bytes of one rank's pools under `config`: its pages and its request slots.
pub fn pool_bytes(c: &ModelConfig, config: &EngineConfig) -> Result<u64, String> {
    let layout = StateLayout::new(c, config.page_size, config.kv, "").map_err(|e| e.to_string())?;
    let pages = u64::from(config.num_pages) * layout.page_bytes as u64;
    let slots = config.max_running as u64 * layout.slot_bytes as u64;
    Ok(pages + slots)
}

/// `MemAvailable` of `/proc/meminfo` (bytes), the kernel's estimate of what can be allocated
/// without swapping; `None` where it cannot be read (not Linux).
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_available(&text)
}

fn parse_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Ok when `ranks` ranks' pools under `config` fit in `available` bytes; otherwise the numbers
/// and what to change.
pub fn check_pools(
    c: &ModelConfig,
    config: &EngineConfig,
    ranks: usize,
    available: u64,
) -> Result<(), String> {
    let per_rank = pool_bytes(c, config)?;
    let total = per_rank.saturating_mul(ranks as u64);
    if total <= available {
        return Ok(());
    }
    let gb = |b: u64| b as f64 / 1e9;
    Err(format!(
        "the state pools need {:.2} GB ({ranks} rank(s) x {:.2} GB: {} pages and {} request \
         slots each) but {:.2} GB of memory is available: lower engine_num_pages (or \
         max_running, or the ranks)",
        gb(total),
        gb(per_rank),
        config.num_pages,
        config.max_running,
        gb(available)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{config::ExpertFormat, synth::Preset};

    #[test]
    fn meminfo_is_read_in_bytes() {
        let text = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(parse_available(text), Some(20_000_000 * 1024));
        assert_eq!(parse_available("MemTotal: 5 kB\n"), None);
    }

    #[test]
    fn pools_that_do_not_fit_are_refused_with_the_numbers() {
        let c = Preset::Tiny.config(ExpertFormat::Nvfp4);
        let config = EngineConfig {
            page_size: 16,
            num_pages: 1000,
            ..EngineConfig::default()
        };
        let one = pool_bytes(&c, &config).unwrap();
        assert!(one > 0);
        assert_eq!(check_pools(&c, &config, 4, 4 * one), Ok(()));
        let e = check_pools(&c, &config, 4, 4 * one - 1).unwrap_err();
        assert!(e.contains("4 rank(s)") && e.contains("1000 pages"), "{e}");
        assert!(e.contains("engine_num_pages"), "{e}");
    }
}
