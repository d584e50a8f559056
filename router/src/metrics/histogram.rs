//! A fixed-bucket Prometheus histogram.

use std::fmt::Write as _;

#[derive(Debug)]
pub(super) struct Histogram {
    bounds: &'static [f64],
    /// Per-bucket (non-cumulative) counts; the last is +Inf.
    counts: Vec<u64>,
    sum: f64,
}

impl Histogram {
    pub(super) fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
        }
    }

    pub(super) fn observe(&mut self, x: f64) {
        self.observe_n(x, 1);
    }

    /// Records `n` observations of `x` at once.
    pub(super) fn observe_n(&mut self, x: f64, n: u64) {
        let i = self
            .bounds
            .iter()
            .position(|&b| x <= b)
            .unwrap_or(self.bounds.len());
        self.counts[i] += n;
        self.sum += x * n as f64;
    }

    /// The sum of histograms with the same buckets (`None` when there are none).
    pub(super) fn merged<'a>(all: impl IntoIterator<Item = &'a Self>) -> Option<Self> {
        let mut all = all.into_iter();
        let first = all.next()?;
        let mut out = Self {
            bounds: first.bounds,
            counts: first.counts.clone(),
            sum: first.sum,
        };
        for h in all {
            debug_assert_eq!(
                h.bounds, out.bounds,
                "merged histograms share their buckets"
            );
            for (o, c) in out.counts.iter_mut().zip(&h.counts) {
                *o += c;
            }
            out.sum += h.sum;
        }
        Some(out)
    }

    pub(super) fn render(&self, out: &mut String, name: &str, label: &str) {
        let mut cumulative = 0;
        for (i, count) in self.counts.iter().enumerate() {
            cumulative += count;
            let le = self
                .bounds
                .get(i)
                .map_or_else(|| "+Inf".to_owned(), ToString::to_string);
            let _ = writeln!(out, "{name}_bucket{{{label}le=\"{le}\"}} {cumulative}");
        }
        let braces = if label.is_empty() {
            String::new()
        } else {
            format!("{{{}}}", label.trim_end_matches(','))
        };
        let _ = writeln!(out, "{name}_sum{braces} {}", self.sum);
        let _ = writeln!(out, "{name}_count{braces} {cumulative}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative_and_weighted() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        h.observe(0.0625);
        h.observe_n(0.5, 3);
        h.observe(7.0);
        let mut out = String::new();
        h.render(&mut out, "x", "a=\"b\",");
        assert!(out.contains("x_bucket{a=\"b\",le=\"0.1\"} 1\n"), "{out}");
        assert!(out.contains("x_bucket{a=\"b\",le=\"1\"} 4\n"), "{out}");
        assert!(out.contains("x_bucket{a=\"b\",le=\"+Inf\"} 5\n"), "{out}");
        assert!(out.contains("x_sum{a=\"b\"} 8.5625\n"), "{out}");
        assert!(out.contains("x_count{a=\"b\"} 5\n"), "{out}");
    }
}
