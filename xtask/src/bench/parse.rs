//! Result lines (`peer=P workload=W key=value ...`, from dlock-bench or the peer harness)
//! into rows, the median of each (peer, workload), and the smoke pass's check of them.

use std::collections::BTreeMap;

use anyhow::{bail, Context as _};

/// One result line: `peer=P workload=W key=value ...` (with `run=K` from run.sh).
pub(crate) type Row = BTreeMap<String, String>;

/// Parses a result line; `None` for comments and anything without `peer=` and `workload=`.
pub(crate) fn parse_line(line: &str) -> Option<Row> {
    let line = line.trim();
    let start = line.find("peer=")?;
    if !(line.starts_with("peer=") || line.starts_with("run=") || line.starts_with("SUMMARY")) {
        return None;
    }
    let mut row = Row::new();
    for tok in line[start..].split_whitespace() {
        let (k, v) = tok.split_once('=')?;
        row.insert(k.to_owned(), v.to_owned());
    }
    if let Some(run) = line.strip_prefix("run=") {
        if let Some(k) = run.split_whitespace().next() {
            row.insert("run".into(), k.to_owned());
        }
    }
    row.contains_key("workload").then_some(row)
}

fn num(row: &Row, k: &str) -> Option<f64> {
    row.get(k).and_then(|v| v.parse::<f64>().ok())
}

/// Median of every numeric field over the runs of one (peer, workload).
#[derive(Debug, Clone, Default)]
pub(crate) struct Summary {
    pub(crate) runs: usize,
    pub(crate) fields: BTreeMap<String, f64>,
    pub(crate) violations_total: u64,
    pub(crate) counter_ok_all: bool,
    pub(crate) status: Option<String>,
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

pub(crate) fn summarise(rows: &[Row]) -> BTreeMap<(String, String), Summary> {
    let mut groups: BTreeMap<(String, String), Vec<&Row>> = BTreeMap::new();
    for r in rows {
        if let (Some(p), Some(w)) = (r.get("peer"), r.get("workload")) {
            groups.entry((p.clone(), w.clone())).or_default().push(r);
        }
    }
    groups
        .into_iter()
        .map(|(key, rs)| {
            let mut s = Summary {
                runs: rs.len(),
                counter_ok_all: rs
                    .iter()
                    .all(|r| r.get("counter_ok").is_none_or(|v| v == "true")),
                status: rs.iter().find_map(|r| r.get("status").cloned()),
                ..Summary::default()
            };
            let mut keys: Vec<&String> = rs.iter().flat_map(|r| r.keys()).collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                if k == "run" {
                    continue;
                }
                if let Some(m) = median(rs.iter().filter_map(|r| num(r, k)).collect()) {
                    s.fields.insert(k.clone(), m);
                }
            }
            s.violations_total = rs
                .iter()
                .filter_map(|r| r.get("violations").and_then(|v| v.parse::<u64>().ok()))
                .sum();
            (key, s)
        })
        .collect()
}

/// The result lines among `lines` with their rows, skipped workloads left out; an error
/// for a line that does not parse or a workload that failed.
fn measured(lines: &[String]) -> anyhow::Result<Vec<(&String, Row)>> {
    let mut out = Vec::new();
    for l in lines.iter().filter(|l| l.starts_with("peer=")) {
        let row = parse_line(l).with_context(|| format!("unparsable result line: {l}"))?;
        match row.get("status").map(String::as_str) {
            Some("skipped") => continue,
            Some(other) => bail!("{other}: {l}"),
            None => out.push((l, row)),
        }
    }
    Ok(out)
}

/// Checks the lines of a smoke run: every line parses, nothing failed, no violation,
/// every counter intact, and at least one dlock workload ran. Returns how many ran.
pub(crate) fn check_smoke(lines: &[String]) -> anyhow::Result<usize> {
    let mut ran = 0;
    for (l, row) in measured(lines)? {
        if num(&row, "ops_s").is_none() || num(&row, "n").is_none() {
            bail!("no ops_s/n in: {l}");
        }
        if row.get("violations").is_some_and(|v| v != "0") {
            bail!("violations in: {l}");
        }
        if row.get("counter_ok").is_some_and(|v| v != "true") {
            bail!("lost counter updates in: {l}");
        }
        if row.get("peer").is_some_and(|p| p.starts_with("dlock-")) {
            ran += 1;
        }
    }
    if ran == 0 {
        bail!("no dlock workload ran");
    }
    Ok(ran)
}

/// How much a release may cost the longest queue of a herd check, per release, over the
/// shortest: a handoff's requests do not depend on how many wait behind it, but the
/// shortest queue's average is diluted by its first handoffs (a holder's release that
/// wakes nobody new, the last waiter's release with nobody behind), so a little growth
/// is allowed. A herd (every waiter woken per release) or a waiter's work growing with
/// what is ahead of it multiplies the figure by the queue's growth, ten here.
const HERD_GROWTH: f64 = 1.5;

/// Checks the lines of an `S1` run with two queue lengths: nothing failed, and for every
/// (peer, workload) that ran, the server requests per release at the longest queue are
/// at most [`HERD_GROWTH`] times those at the shortest, plus one. Returns how many
/// (peer, workload) pairs were checked.
pub(crate) fn check_herd(lines: &[String]) -> anyhow::Result<usize> {
    let mut by: BTreeMap<(String, String), Vec<(f64, f64)>> = BTreeMap::new();
    for (l, row) in measured(lines)? {
        let (Some(p), Some(w)) = (row.get("peer"), row.get("workload")) else {
            continue;
        };
        let (Some(n), Some(per)) = (num(&row, "waiters"), num(&row, "server_ops_per_release"))
        else {
            bail!("no waiters/server_ops_per_release in: {l}");
        };
        by.entry((p.clone(), w.clone())).or_default().push((n, per));
    }
    let mut checked = 0;
    for ((peer, workload), mut points) in by {
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (Some(&(short_n, short)), Some(&(long_n, long))) = (points.first(), points.last())
        else {
            continue;
        };
        if long_n <= short_n {
            continue;
        }
        if long > short * HERD_GROWTH + 1.0 {
            bail!(
                "{peer} {workload}: {long:.2} server requests per release with {long_n} waiters \
                 against {short:.2} with {short_n}: the cost of a handoff grows with the queue"
            );
        }
        checked += 1;
    }
    if checked == 0 {
        bail!("no queue was measured at two lengths");
    }
    Ok(checked)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smoke_check_rejects_violations_and_failures() {
        let good = vec![
            "peer=dlock-zk workload=W2 ops_s=10.0 p50_ms=1 p99_ms=1 max_ms=1 n=3 violations=0 counter_ok=true".to_string(),
            "peer=dlock-redis workload=all status=skipped reason=x".to_string(),
        ];
        assert_eq!(check_smoke(&good).expect("good"), 1);
        let bad = vec!["peer=dlock-zk workload=W2 ops_s=10.0 n=3 violations=1".to_string()];
        assert!(check_smoke(&bad).is_err());
        let failed = vec!["peer=dlock-zk workload=W2 status=failed reason=x".to_string()];
        assert!(check_smoke(&failed).is_err());
        assert!(check_smoke(&[]).is_err());
    }

    #[test]
    fn herd_check_rejects_a_cost_growing_with_the_queue() {
        let line = |w: &str, n: u32, per: f64| {
            format!(
                "peer=dlock-etcd workload={w} waiters={n} releases={} server_ops=0 \
                 server_ops_per_release={per} secs=1 handoffs_s=1",
                n + 1
            )
        };
        // Flat as measured, and the ranked semaphore's herd before `permit_next`.
        let flat = vec![
            line("S1-waiters", 20, 1.9),
            line("S1-waiters", 200, 2.0),
            line("S1-permits", 20, 1.5),
            line("S1-permits", 200, 1.95),
            "peer=dlock-redlock workload=all status=skipped reason=x".to_string(),
        ];
        assert_eq!(check_herd(&flat).expect("flat"), 2);
        let herd = vec![line("S1-permits", 10, 1.85), line("S1-permits", 100, 82.0)];
        assert!(check_herd(&herd).is_err());
        let failed = vec!["peer=dlock-zk workload=S1-waiters status=failed reason=x".to_string()];
        assert!(check_herd(&failed).is_err());
        assert!(
            check_herd(&[line("S1-waiters", 20, 2.0)]).is_err(),
            "one length only"
        );
    }
}
