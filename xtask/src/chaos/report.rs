//! The scenario x backend table: markdown for humans and docs, `summary.json` for tools.

use std::path::Path;

use anyhow::Context as _;

use super::history::Verdict;
use super::store::StoreStats;

/// One scenario run on one backend.
#[derive(Debug, Clone)]
pub(crate) struct Row {
    pub(crate) scenario: String,
    pub(crate) backend: String,
    pub(crate) fenced: bool,
    /// A paused holder's late write must reach the store: rejected when fenced, accepted
    /// when not. Without it the run did not exercise what fencing is for.
    pub(crate) expects_stale_write: bool,
    pub(crate) verdict: Verdict,
    pub(crate) store: StoreStats,
    /// Entries left under the lock after every client had gone.
    pub(crate) leaked: usize,
    pub(crate) faults: usize,
    pub(crate) seconds: u64,
    pub(crate) notes: Vec<String>,
}

impl Row {
    /// What this row shows that must not happen, as messages (empty when fine).
    ///
    /// Overlaps are reported, not failed: a paused or cut-off holder, or a Redis that
    /// forgot its keys, cannot be stopped by any lock service; that is what the fenced
    /// store is for, and it must never accept a stale write.
    pub(crate) fn failures(&self) -> Vec<String> {
        let id = format!("{} on {}", self.scenario, self.backend);
        let mut f = Vec::new();
        if self.fenced && self.store.stale_accepted > 0 {
            f.push(format!(
                "{id}: the fenced store accepted {} stale write(s)",
                self.store.stale_accepted
            ));
        }
        if self.expects_stale_write {
            let seen = if self.fenced {
                self.store.stale_rejected
            } else {
                self.store.stale_accepted
            };
            if seen == 0 {
                f.push(format!(
                    "{id}: no paused holder's late write reached the store; the pause was not exercised"
                ));
            }
        }
        if self.leaked > 0 {
            f.push(format!(
                "{id}: {} entr(ies) left under the lock after every client had gone",
                self.leaked
            ));
        }
        if self.verdict.sections == 0 {
            f.push(format!("{id}: no critical section ran"));
        }
        if self.faults > 0 && self.verdict.worst_recovery_ms().is_none() {
            f.push(format!(
                "{id}: the lock did not serve another worker after a fault"
            ));
        }
        f.extend(self.notes.iter().map(|n| format!("{id}: {n}")));
        f
    }

    /// The JSON object of the `summary.json` contract: exactly these keys.
    fn summary(&self) -> serde_json::Value {
        serde_json::json!({
            "scenario": self.scenario,
            "backend": self.backend,
            "sections": self.verdict.sections,
            "overlaps": self.verdict.overlaps,
            "stale_writes_accepted": self.store.stale_accepted,
            "lost_signals": self.verdict.lost_signals,
            "recovery_ms": self.verdict.worst_recovery_ms(),
        })
    }
}

fn ms_list(v: &[Option<u64>]) -> String {
    if v.is_empty() {
        return "-".into();
    }
    v.iter()
        .map(|x| x.map(|ms| ms.to_string()).unwrap_or_else(|| "-".into()))
        .collect::<Vec<_>>()
        .join(" / ")
}

/// A one-line summary for the progress log.
pub(crate) fn row_line(r: &Row) -> String {
    format!(
        "  {} on {}: {} sections, {} overlaps, {} stale writes accepted ({} rejected), {} lost signals, recovery {} ms, {} token order violations, {} leaked",
        r.scenario,
        r.backend,
        r.verdict.sections,
        r.verdict.overlaps,
        r.store.stale_accepted,
        r.store.stale_rejected,
        r.verdict.lost_signals,
        ms_list(&r.verdict.recovery_ms),
        r.verdict.token_violations,
        r.leaked
    )
}

/// The results as markdown: the contract table, then the details.
pub(crate) fn markdown(rows: &[Row], notes: &[String]) -> String {
    let mut s = String::new();
    s.push_str("| scenario | backend | sections | overlaps | stale writes accepted | lost signals | recovery (ms) |\n");
    s.push_str("|---|---|---:|---:|---:|---:|---:|\n");
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} |\n",
            r.scenario,
            r.backend,
            r.verdict.sections,
            r.verdict.overlaps,
            r.store.stale_accepted,
            r.verdict.lost_signals,
            r.verdict
                .worst_recovery_ms()
                .map(|m| m.to_string())
                .unwrap_or_else(|| "-".into()),
        ));
    }
    s.push_str("\nDetails (per fault, in injection order):\n\n");
    s.push_str("| scenario | backend | store | faults | recovery per fault (ms) | lost-signal latency (ms) | stale writes rejected | token order violations | unfinished sections | entries left | run (s) |\n");
    s.push_str("|---|---|---|---:|---|---|---:|---:|---:|---:|---:|\n");
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.scenario,
            r.backend,
            if r.fenced { "fenced" } else { "unfenced" },
            r.faults,
            ms_list(&r.verdict.recovery_ms),
            ms_list(&r.verdict.lost_latency_ms),
            r.store.stale_rejected,
            r.verdict.token_violations,
            r.verdict.unfinished,
            r.leaked,
            r.seconds,
        ));
    }
    let all_notes: Vec<String> = notes
        .iter()
        .cloned()
        .chain(rows.iter().flat_map(|r| {
            r.notes
                .iter()
                .map(move |n| format!("{} on {}: {n}", r.scenario, r.backend))
        }))
        .collect();
    if !all_notes.is_empty() {
        s.push_str("\nNotes:\n\n");
        for n in all_notes {
            s.push_str(&format!("- {n}\n"));
        }
    }
    s
}

/// Writes `summary.json`: a list of objects with exactly the keys scenario, backend,
/// sections, overlaps, stale_writes_accepted, lost_signals, recovery_ms.
pub(crate) fn write_summary(path: &Path, rows: &[Row]) -> anyhow::Result<()> {
    let list: Vec<serde_json::Value> = rows.iter().map(Row::summary).collect();
    let text = serde_json::to_string_pretty(&list).context("encoding the summary")?;
    std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
}

const BEGIN: &str =
    "<!-- chaos:begin (generated by `cargo xtask chaos`; edit outside the markers) -->";
const END: &str = "<!-- chaos:end -->";

/// Replaces the generated part of `docs/safety.md` (between the markers), keeping every
/// word outside them; creates the section if the file or the markers are missing.
pub(crate) fn update_doc(path: &Path, markdown: &str) -> anyhow::Result<()> {
    let old = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let generated = format!("{BEGIN}\n{}{END}", markdown.trim_end().to_string() + "\n");
    let new = splice(&old, &generated);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(path, new).with_context(|| format!("writing {}", path.display()))
}

fn splice(old: &str, generated: &str) -> String {
    match (old.find(BEGIN), old.find(END)) {
        (Some(b), Some(e)) if b < e => {
            format!("{}{generated}{}", &old[..b], &old[e + END.len()..])
        }
        _ => {
            let mut s = old.trim_end().to_string();
            if !s.is_empty() {
                s.push_str("\n\n");
            }
            s.push_str("## Measured: faults and safety (`cargo xtask chaos`)\n\n");
            s.push_str(generated);
            s.push('\n');
            s
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(fenced: bool, stale: u64) -> Row {
        Row {
            scenario: "holder-pause".into(),
            backend: "zookeeper".into(),
            fenced,
            expects_stale_write: true,
            verdict: Verdict {
                sections: 10,
                overlaps: 2,
                lost_signals: 1,
                recovery_ms: vec![Some(2100), Some(2300)],
                lost_latency_ms: vec![Some(5), None],
                ..Verdict::default()
            },
            store: StoreStats {
                accepted: 9,
                stale_accepted: stale,
                stale_rejected: 1,
            },
            leaked: 0,
            faults: 2,
            seconds: 30,
            notes: Vec::new(),
        }
    }

    #[test]
    fn summary_has_exactly_the_contract_keys() {
        let v = row(true, 0).summary();
        let mut keys: Vec<&str> = v
            .as_object()
            .expect("object")
            .keys()
            .map(String::as_str)
            .collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "backend",
                "lost_signals",
                "overlaps",
                "recovery_ms",
                "scenario",
                "sections",
                "stale_writes_accepted"
            ]
        );
        assert_eq!(v["recovery_ms"], 2300);
    }

    #[test]
    fn a_stale_write_through_a_fenced_store_fails_the_run() {
        assert!(row(true, 0).failures().is_empty());
        assert_eq!(row(true, 1).failures().len(), 1);
        assert!(
            row(false, 3).failures().is_empty(),
            "unfenced: reported only"
        );
        let md = markdown(&[row(false, 3)], &["etcd: not run".into()]);
        assert!(
            md.contains("| holder-pause | zookeeper | 10 | 2 | 3 | 1 | 2300 |"),
            "{md}"
        );
        assert!(md.contains("- etcd: not run"));
    }

    #[test]
    fn doc_splice_keeps_text_outside_the_markers() {
        let first = splice("# Safety\n\nby hand\n", &format!("{BEGIN}\nA\n{END}"));
        assert!(first.starts_with("# Safety\n\nby hand\n\n## Measured"));
        let second = splice(&format!("{first}\nafter\n"), &format!("{BEGIN}\nB\n{END}"));
        assert!(second.contains("by hand") && second.contains("\nB\n") && second.contains("after"));
        assert!(!second.contains("\nA\n"));
    }
}
