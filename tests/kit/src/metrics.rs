//! Reading a binary's Prometheus `/metrics` page.

/// Fetches a Prometheus text page and sums the samples of `metric` whose labels contain all of
/// `labels` (each `name="value"`).
pub async fn scrape_sum(addr: &str, metric: &str, labels: &[&str]) -> anyhow::Result<f64> {
    Ok(metric_sum(&scrape(addr).await?, metric, labels))
}

/// Waits (up to `timeout`) until exactly one of the relays whose metrics endpoints are `relays`
/// reports itself active; returns its index.
pub async fn one_active_relay(
    relays: &[&str],
    timeout: std::time::Duration,
) -> anyhow::Result<usize> {
    crate::wait_until("one relay active", timeout, || async {
        let mut active = Vec::new();
        for (i, addr) in relays.iter().enumerate() {
            if scrape_sum(addr, "relay_active", &[]).await? as i64 == 1 {
                active.push(i);
            }
        }
        Ok(match active.as_slice() {
            [one] => Some(*one),
            _ => None,
        })
    })
    .await
}

/// The text of the `/metrics` page at `addr`.
pub async fn scrape(addr: &str) -> anyhow::Result<String> {
    Ok(reqwest::get(format!("http://{addr}/metrics"))
        .await?
        .text()
        .await?)
}

/// Sum of the series of `metric` in a scraped `body` whose labels contain all of `labels`.
pub fn metric_sum(body: &str, metric: &str, labels: &[&str]) -> f64 {
    let mut total = 0.0;
    for line in body.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let name = series.split('{').next().unwrap_or(series);
        if name == metric && labels.iter().all(|l| series.contains(l)) {
            total += value.parse::<f64>().unwrap_or(0.0);
        }
    }
    total
}
