//! Reading a [`LoadProgress`]: the figures derived from its counters (percent, rate, ETA) and
//! the one-line text every tool prints for it. The wire carries only counters, so the worker,
//! the router and `pdctl` derive the same figures the same way.

use std::{fmt, time::Duration};

use crate::v1::LoadProgress;

impl LoadProgress {
    /// Since the load began (the whole load's duration once done).
    pub fn elapsed(&self) -> Duration {
        Duration::from_millis(self.elapsed_ms)
    }

    /// Done as a whole percentage of the total (0 while the total is not known).
    pub fn percent(&self) -> u64 {
        if self.bytes_total == 0 {
            return 0;
        }
        (u128::from(self.bytes_done) * 100 / u128::from(self.bytes_total)) as u64
    }

    /// Bytes per second so far; `None` before anything was done.
    pub fn bytes_per_s(&self) -> Option<f64> {
        let secs = self.elapsed().as_secs_f64();
        (self.bytes_done > 0 && secs > 0.0).then(|| self.bytes_done as f64 / secs)
    }

    /// Time left at the rate so far; `None` until there is a rate.
    pub fn eta(&self) -> Option<Duration> {
        let left = self.bytes_total.saturating_sub(self.bytes_done);
        if left == 0 && self.bytes_total > 0 {
            return Some(Duration::ZERO);
        }
        let rate = self.bytes_per_s()?;
        Some(Duration::from_secs_f64(left as f64 / rate))
    }
}

impl fmt::Display for LoadProgress {
    /// `42% (67.2 of 160.0 GB, 1.20 GB/s, ETA 1m21s), 19 of 46 shards`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}% ({}, {}/s, ETA {}), {} of {} shards",
            self.percent(),
            bytes_of(self.bytes_done, self.bytes_total),
            self.bytes_per_s()
                .map_or_else(|| "?".to_owned(), |r| bytes(r as u64)),
            self.eta().map_or_else(|| "?".to_owned(), eta),
            self.shards_done,
            self.shards_total
        )
    }
}

/// `3.52 GB`, `12.3 MB`, `5 KB`, `17 B` (decimal units, as disk sizes are quoted).
pub fn bytes(n: u64) -> String {
    let x = n as f64;
    if x >= 1e9 {
        format!("{:.2} GB", x / 1e9)
    } else if x >= 1e6 {
        format!("{:.1} MB", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.0} KB", x / 1e3)
    } else {
        format!("{n} B")
    }
}

/// `10.6 of 160.0 GB`: both in the unit the total is best read in.
pub fn bytes_of(done: u64, total: u64) -> String {
    let (scale, unit) = match total {
        t if t >= 1_000_000_000 => (1e9, "GB"),
        t if t >= 1_000_000 => (1e6, "MB"),
        t if t >= 1_000 => (1e3, "KB"),
        _ => (1.0, "B"),
    };
    format!(
        "{:.1} of {:.1} {unit}",
        done as f64 / scale,
        total as f64 / scale
    )
}

/// `1h02m`, `1m32s`, `45s` (whole seconds, rounded up so that 0s means done).
pub fn eta(d: Duration) -> String {
    let s = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    match s {
        s if s >= 3600 => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
        s if s >= 60 => format!("{}m{:02}s", s / 60, s % 60),
        s => format!("{s}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_and_eta_read_as_written() {
        assert_eq!(bytes(3_520_000_000), "3.52 GB");
        assert_eq!(bytes(12_345_678), "12.3 MB");
        assert_eq!(bytes(5_400), "5 KB");
        assert_eq!(bytes(17), "17 B");
        assert_eq!(
            bytes_of(10_600_000_000, 160_000_000_000),
            "10.6 of 160.0 GB"
        );
        assert_eq!(bytes_of(1_500, 3_000_000), "0.0 of 3.0 MB");
        assert_eq!(eta(Duration::from_secs(92)), "1m32s");
        assert_eq!(eta(Duration::from_millis(44_100)), "45s");
        assert_eq!(eta(Duration::from_secs(3720)), "1h02m");
        assert_eq!(eta(Duration::ZERO), "0s");
    }

    #[test]
    fn rate_eta_percent_and_text() {
        let p = LoadProgress {
            bytes_done: 40_000_000_000,
            bytes_total: 160_000_000_000,
            shards_done: 10,
            shards_total: 46,
            elapsed_ms: 20_000,
            done: false,
        };
        assert_eq!(p.bytes_per_s(), Some(2e9));
        assert_eq!(p.eta(), Some(Duration::from_secs(60)));
        assert_eq!(p.percent(), 25);
        assert_eq!(
            p.to_string(),
            "25% (40.0 of 160.0 GB, 2.00 GB/s, ETA 1m00s), 10 of 46 shards"
        );
        // Nothing known yet: no rate, no ETA, no division by zero.
        let fresh = LoadProgress::default();
        assert_eq!(fresh.bytes_per_s(), None);
        assert_eq!(fresh.eta(), None);
        assert_eq!(fresh.percent(), 0);
        assert_eq!(
            fresh.to_string(),
            "0% (0.0 of 0.0 B, ?/s, ETA ?), 0 of 0 shards"
        );
        let finished = LoadProgress {
            bytes_done: p.bytes_total,
            ..p
        };
        assert_eq!(finished.eta(), Some(Duration::ZERO));
        assert_eq!(finished.percent(), 100);
    }
}
