//! Latency figures: histograms of µs (HdrHistogram) and their read-outs in ms.

use hdrhistogram::Histogram;

/// A histogram of µs from 1 µs to an hour, 3 significant digits; longer values are recorded as
/// an hour by `saturating_record`.
pub fn micros_histogram() -> Histogram<u64> {
    // The bounds are constants that satisfy new_with_bounds' conditions (1 <= low, 2 * low <=
    // high, sigfig <= 5), so it cannot fail.
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
}

/// A quantile of a µs histogram, in ms with µs precision; 0 when it is empty.
pub fn quantile_ms(h: &Histogram<u64>, q: f64) -> f64 {
    if h.is_empty() {
        return 0.0;
    }
    h.value_at_quantile(q) as f64 / 1000.0
}

/// The largest value of a µs histogram, in ms; 0 when it is empty.
pub fn max_ms(h: &Histogram<u64>) -> f64 {
    if h.is_empty() {
        return 0.0;
    }
    h.max() as f64 / 1000.0
}

/// `n` over `seconds`, per second; 0 over no time.
pub fn per_second(n: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        n as f64 / seconds
    } else {
        0.0
    }
}
