//! Prometheus histograms read from a process's `/metrics` page: the buckets of one metric at one
//! moment, the difference between two such readings (what was observed in between), and its
//! quantiles, interpolated within a bucket as PromQL's `histogram_quantile` does.

use serde::Serialize;

use crate::procstat::round1;

/// Cumulative bucket counts of one histogram metric, summed over the series whose labels match.
#[derive(Debug, Clone, Default)]
pub struct Buckets {
    /// (upper bound in the metric's unit, observations at or below it), ascending; the last
    /// bound is +Inf.
    cumulative: Vec<(f64, f64)>,
    sum: f64,
    count: f64,
}

impl Buckets {
    /// The buckets of `metric` (without `_bucket`) in a scraped `page`, over the series whose
    /// labels contain all of `labels`.
    pub fn read(page: &str, metric: &str, labels: &[&str]) -> Buckets {
        let bucket = format!("{metric}_bucket");
        let (sum_name, count_name) = (format!("{metric}_sum"), format!("{metric}_count"));
        let mut b = Buckets::default();
        for line in page.lines().filter(|l| !l.starts_with('#')) {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let name = series.split('{').next().unwrap_or(series);
            if !labels.iter().all(|l| series.contains(l)) {
                continue;
            }
            if name == sum_name {
                b.sum += value;
            } else if name == count_name {
                b.count += value;
            } else if name == bucket {
                if let Some(le) = le_of(series) {
                    match b.cumulative.iter_mut().find(|(bound, _)| *bound == le) {
                        Some((_, n)) => *n += value,
                        None => b.cumulative.push((le, value)),
                    }
                }
            }
        }
        b.cumulative.sort_by(|a, b| a.0.total_cmp(&b.0));
        b
    }

    /// What was observed between `earlier` and this reading (of the same process).
    #[must_use]
    pub fn since(&self, earlier: &Buckets) -> Buckets {
        let before = |le: f64| {
            earlier
                .cumulative
                .iter()
                .find(|(bound, _)| *bound == le)
                .map_or(0.0, |(_, n)| *n)
        };
        Buckets {
            cumulative: self
                .cumulative
                .iter()
                .map(|&(le, n)| (le, (n - before(le)).max(0.0)))
                .collect(),
            sum: (self.sum - earlier.sum).max(0.0),
            count: (self.count - earlier.count).max(0.0),
        }
    }

    /// The `q` quantile, interpolated linearly within its bucket; a quantile in the +Inf bucket
    /// is the highest finite bound. `None` without observations.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.cumulative.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let mut lower = (0.0, 0.0);
        for &(le, n) in &self.cumulative {
            if n >= rank {
                if le.is_infinite() {
                    return Some(lower.0);
                }
                let width = n - lower.1;
                let within = if width > 0.0 {
                    (rank - lower.1) / width
                } else {
                    1.0
                };
                return Some(lower.0 + (le - lower.0) * within);
            }
            lower = (le, n);
        }
        Some(lower.0)
    }

    /// Figures in milliseconds of a histogram of seconds.
    pub fn seconds_as_ms(&self) -> HistogramFigures {
        let ms = |s: Option<f64>| s.map(|s| round1(s * 1000.0));
        HistogramFigures {
            count: self.count,
            mean_ms: (self.count > 0.0).then(|| round1(self.sum / self.count * 1000.0)),
            p50_ms: ms(self.quantile(0.5)),
            p99_ms: ms(self.quantile(0.99)),
        }
    }
}

/// The `le` label's value of a bucket series.
fn le_of(series: &str) -> Option<f64> {
    let start = series.find("le=\"")? + 4;
    let rest = &series[start..];
    let value = &rest[..rest.find('"')?];
    match value {
        "+Inf" => Some(f64::INFINITY),
        v => v.parse().ok(),
    }
}

/// A histogram's observations over an interval, in ms (p50 and p99 interpolated within the
/// buckets, so as fine as the buckets are).
#[derive(Debug, Clone, Default, Serialize)]
pub struct HistogramFigures {
    pub count: f64,
    pub mean_ms: Option<f64>,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = r#"# HELP x_seconds A histogram
x_seconds_bucket{group="a",le="0.001"} 10
x_seconds_bucket{group="a",le="0.002"} 60
x_seconds_bucket{group="a",le="0.004"} 100
x_seconds_bucket{group="a",le="+Inf"} 100
x_seconds_sum{group="a"} 0.2
x_seconds_count{group="a"} 100
x_seconds_bucket{group="b",le="0.001"} 0
x_seconds_bucket{group="b",le="0.002"} 0
x_seconds_bucket{group="b",le="0.004"} 0
x_seconds_bucket{group="b",le="+Inf"} 100
x_seconds_sum{group="b"} 100
x_seconds_count{group="b"} 100
"#;

    #[test]
    fn quantiles_interpolate_within_the_bucket() {
        let a = Buckets::read(PAGE, "x_seconds", &["group=\"a\""]);
        // Rank 50 of 100 lies 40/50 of the way through the (1 ms, 2 ms] bucket.
        let p50 = a.quantile(0.5).expect("observations");
        assert!((p50 - 0.0018).abs() < 1e-9, "{p50}");
        let f = a.seconds_as_ms();
        assert_eq!(f.mean_ms, Some(2.0));
        assert_eq!(f.p99_ms, Some(4.0));
    }

    #[test]
    fn series_are_summed_and_the_inf_bucket_gives_the_highest_bound() {
        let both = Buckets::read(PAGE, "x_seconds", &[]);
        assert_eq!(both.count, 200.0);
        assert_eq!(both.quantile(0.99), Some(0.004));
    }

    #[test]
    fn a_difference_holds_only_what_was_observed_in_between() {
        let later = Buckets::read(PAGE, "x_seconds", &["group=\"a\""]);
        let earlier = Buckets::read(
            &PAGE
                .replace("} 100\n", "} 50\n")
                .replace("} 60\n", "} 50\n"),
            "x_seconds",
            &["group=\"a\""],
        );
        let d = later.since(&earlier);
        assert_eq!(d.count, 50.0);
        // 10 of the 50 observed in between fell in (1 ms, 2 ms], 40 in (2 ms, 4 ms].
        let p50 = d.quantile(0.5).expect("observations");
        assert!(p50 > 0.002 && p50 <= 0.004, "{p50}");
        assert!(Buckets::default().quantile(0.5).is_none());
    }
}
