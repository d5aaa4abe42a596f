//! The backend x scenario x recipe table: markdown for humans and docs, `summary.json`
//! for tools.

use std::path::Path;

use anyhow::Context as _;

use super::history::Verdict;
use super::store::StoreStats;

/// One recipe under one scenario on one backend, summed over the rounds that ran it.
#[derive(Debug, Clone)]
pub(crate) struct Row {
    pub(crate) scenario: String,
    pub(crate) backend: String,
    pub(crate) recipe: String,
    /// Whether the backend promises mutual exclusion under this fault. Only where it
    /// does not (one Redis server that forgets its keys: a restart without persistence,
    /// a promoted replica that never saw the lock; see docs/safety.md) are overlaps and
    /// token-order violations reported instead of failing the run.
    pub(crate) guaranteed: bool,
    /// A paused library holder was inside a section that writes: its late write must
    /// reach the fenced store. Without it the run did not exercise what fencing is for.
    pub(crate) expects_stale_write: bool,
    pub(crate) verdict: Verdict,
    pub(crate) store: StoreStats,
    /// Entries left under the lock after every client had gone.
    pub(crate) leaked: usize,
    pub(crate) faults: usize,
    pub(crate) seconds: u64,
    /// The seeds of the rounds summed here.
    pub(crate) seeds: Vec<u64>,
    pub(crate) notes: Vec<String>,
}

impl Row {
    fn key(&self) -> (&str, &str, &str) {
        (&self.backend, &self.scenario, &self.recipe)
    }

    /// What this row shows that must not happen, as messages (empty when fine): any
    /// overlap of two holders, any token-order violation, any stale write the fenced
    /// store accepted, any entry left, a run that never ran a section or never recovered.
    pub(crate) fn failures(&self) -> Vec<String> {
        let id = format!("{} / {} on {}", self.scenario, self.recipe, self.backend);
        let mut f = Vec::new();
        if self.guaranteed && self.verdict.overlaps > 0 {
            f.push(format!(
                "{id}: {} section(s) began while another holder held the lock",
                self.verdict.overlaps
            ));
        }
        if self.guaranteed && self.verdict.token_violations > 0 {
            f.push(format!(
                "{id}: {} section(s) held a token not above an earlier holder's",
                self.verdict.token_violations
            ));
        }
        if self.store.stale_accepted > 0 {
            f.push(format!(
                "{id}: the fenced store accepted {} stale write(s)",
                self.store.stale_accepted
            ));
        }
        if self.expects_stale_write && self.store.stale_rejected == 0 {
            f.push(format!(
                "{id}: no paused holder's late write reached the store; the pause was not exercised"
            ));
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

    /// The JSON object of the `summary.json` contract.
    fn summary(&self) -> serde_json::Value {
        serde_json::json!({
            "backend": self.backend,
            "scenario": self.scenario,
            "recipe": self.recipe,
            "guaranteed": self.guaranteed,
            "sections": self.verdict.sections,
            "overlaps": self.verdict.overlaps,
            "token_order_violations": self.verdict.token_violations,
            "stale_writes_accepted": self.store.stale_accepted,
            "stale_writes_rejected": self.store.stale_rejected,
            "entries_left": self.leaked,
            "lost_margin_ms_min": self.verdict.lost_margin_ms_min(),
            "lost_signals": self.verdict.lost_signals,
            "recovery_ms": self.verdict.worst_recovery_ms(),
            "faults": self.faults,
            "seeds": self.seeds,
        })
    }
}

/// Adds `row` to `rows`: summed into the row of the same backend, scenario and recipe
/// if a round ran it before.
pub(crate) fn merge(rows: &mut Vec<Row>, row: Row) {
    let Some(r) = rows.iter_mut().find(|r| r.key() == row.key()) else {
        rows.push(row);
        return;
    };
    let (v, w) = (&mut r.verdict, row.verdict);
    v.sections += w.sections;
    v.unfinished += w.unfinished;
    v.overlaps += w.overlaps;
    v.token_violations += w.token_violations;
    v.lost_signals += w.lost_signals;
    v.lost_latency_ms.extend(w.lost_latency_ms);
    v.recovery_ms.extend(w.recovery_ms);
    v.lost_margin_ms.extend(w.lost_margin_ms);
    r.store.accepted += row.store.accepted;
    r.store.stale_accepted += row.store.stale_accepted;
    r.store.stale_rejected += row.store.stale_rejected;
    r.expects_stale_write |= row.expects_stale_write;
    r.leaked += row.leaked;
    r.faults += row.faults;
    r.seconds += row.seconds;
    r.seeds.extend(row.seeds);
    r.notes.extend(row.notes);
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

fn opt<T: ToString>(x: Option<T>) -> String {
    x.map(|v| v.to_string()).unwrap_or_else(|| "-".into())
}

/// A one-line summary for the progress log.
pub(crate) fn row_line(r: &Row) -> String {
    format!(
        "  {} / {} on {}: {} sections, {} overlaps, {} token order violations, {} stale writes accepted ({} rejected), {} left, lost margin min {} ms, {} lost signals, recovery {} ms",
        r.scenario,
        r.recipe,
        r.backend,
        r.verdict.sections,
        r.verdict.overlaps,
        r.verdict.token_violations,
        r.store.stale_accepted,
        r.store.stale_rejected,
        r.leaked,
        opt(r.verdict.lost_margin_ms_min()),
        r.verdict.lost_signals,
        ms_list(&r.verdict.recovery_ms),
    )
}

/// The results as markdown: the contract table, then the details.
pub(crate) fn markdown(rows: &[Row], notes: &[String], seed: u64, rounds: usize) -> String {
    let mut s = format!("Seed {seed}, {rounds} round(s).\n\n");
    s.push_str("| backend | scenario | recipe | exclusion promised | sections | overlaps | token order violations | stale writes accepted | entries left | lost margin min (ms) |\n");
    s.push_str("|---|---|---|---|---:|---:|---:|---:|---:|---:|\n");
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.backend,
            r.scenario,
            r.recipe,
            if r.guaranteed { "yes" } else { "no" },
            r.verdict.sections,
            r.verdict.overlaps,
            r.verdict.token_violations,
            r.store.stale_accepted,
            r.leaked,
            opt(r.verdict.lost_margin_ms_min()),
        ));
    }
    s.push_str("\nDetails (per fault, in injection order):\n\n");
    s.push_str("| backend | scenario | recipe | faults | recovery per fault (ms) | lost-signal latency (ms) | lost signals | stale writes rejected | unfinished sections | run (s) |\n");
    s.push_str("|---|---|---|---:|---|---|---:|---:|---:|---:|\n");
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.backend,
            r.scenario,
            r.recipe,
            r.faults,
            ms_list(&r.verdict.recovery_ms),
            ms_list(&r.verdict.lost_latency_ms),
            r.verdict.lost_signals,
            r.store.stale_rejected,
            r.verdict.unfinished,
            r.seconds,
        ));
    }
    let all_notes: Vec<String> = notes
        .iter()
        .cloned()
        .chain(rows.iter().flat_map(|r| {
            r.notes
                .iter()
                .map(move |n| format!("{} / {} on {}: {n}", r.scenario, r.recipe, r.backend))
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

/// Writes `summary.json`: a list of objects, one per backend x scenario x recipe, with at
/// least the keys backend, scenario, recipe, sections, overlaps, token_order_violations,
/// stale_writes_accepted, entries_left, lost_margin_ms_min.
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

    fn row(overlaps: u64, stale: u64) -> Row {
        Row {
            scenario: "holder-pause".into(),
            backend: "zookeeper".into(),
            recipe: "rwlock".into(),
            guaranteed: true,
            expects_stale_write: true,
            verdict: Verdict {
                sections: 10,
                overlaps,
                lost_signals: 1,
                recovery_ms: vec![Some(2100), Some(2300)],
                lost_latency_ms: vec![Some(5), None],
                lost_margin_ms: vec![250, 180],
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
            seeds: vec![7],
            notes: Vec::new(),
        }
    }

    #[test]
    fn summary_has_the_contract_keys() {
        let v = row(0, 0).summary();
        let obj = v.as_object().expect("object");
        for key in [
            "backend",
            "scenario",
            "recipe",
            "sections",
            "overlaps",
            "token_order_violations",
            "stale_writes_accepted",
            "entries_left",
            "lost_margin_ms_min",
        ] {
            assert!(obj.contains_key(key), "{key} missing from {v}");
        }
        assert_eq!(v["lost_margin_ms_min"], 180);
        assert_eq!(v["recipe"], "rwlock");
    }

    #[test]
    fn an_overlap_or_a_stale_write_fails_the_run() {
        assert!(row(0, 0).failures().is_empty());
        assert_eq!(row(1, 0).failures().len(), 1);
        assert_eq!(row(0, 1).failures().len(), 1);
        let mut unpromised = row(3, 0);
        unpromised.guaranteed = false;
        assert!(unpromised.failures().is_empty(), "reported, not failed");
        let mut unexercised = row(0, 0);
        unexercised.store.stale_rejected = 0;
        assert_eq!(unexercised.failures().len(), 1);
        let md = markdown(&[row(2, 3)], &["etcd: not run".into()], 7, 1);
        assert!(
            md.contains("| zookeeper | holder-pause | rwlock | yes | 10 | 2 | 0 | 3 | 0 | 180 |"),
            "{md}"
        );
        assert!(md.contains("- etcd: not run"));
    }

    #[test]
    fn rounds_of_one_row_are_summed() {
        let mut rows = vec![row(0, 0)];
        let mut other = row(1, 0);
        other.recipe = "mutex".into();
        merge(&mut rows, other);
        merge(&mut rows, row(2, 0));
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].verdict.sections, 20);
        assert_eq!(rows[0].verdict.overlaps, 2);
        assert_eq!(rows[0].seeds, vec![7, 7]);
        assert_eq!(rows[0].verdict.lost_margin_ms_min(), Some(180));
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
