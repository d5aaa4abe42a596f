//! The summaries as a markdown table of ratios against the peers, the ceilings and the
//! targets; the JSON under `target/bench/`; the SVG chart.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use super::parse::Summary;
use crate::flags::BenchArgs;

/// A target of the benchmark issue: `peer workload` ops/s at least `factor` times the
/// reference's.
struct Target {
    peer: &'static str,
    workload: &'static str,
    reference: (&'static str, &'static str),
    factor: f64,
}

const TARGETS: &[Target] = &[
    Target {
        peer: "dlock-zk",
        workload: "W1",
        reference: ("ceiling-zk", "W0s-zk-createseq-getchildren-delete"),
        factor: 1.0,
    },
    Target {
        peer: "dlock-zk",
        workload: "W1",
        reference: ("curator", "W1"),
        factor: 1.25,
    },
    Target {
        peer: "dlock-zk",
        workload: "W2",
        reference: ("curator", "W2"),
        factor: 1.5,
    },
    Target {
        peer: "dlock-zk",
        workload: "W3",
        reference: ("curator", "W3"),
        factor: 1.5,
    },
    Target {
        peer: "dlock-zk",
        workload: "W4",
        reference: ("curator", "W4"),
        factor: 2.0,
    },
    Target {
        peer: "dlock-redis",
        workload: "W1",
        reference: ("rslock", "W1"),
        factor: 1.0,
    },
    Target {
        peer: "dlock-redis",
        workload: "W1",
        reference: ("redis-py", "W1"),
        factor: 2.0,
    },
    Target {
        peer: "dlock-redis",
        workload: "W2",
        reference: ("redis-py", "W2"),
        factor: 1.0,
    },
    Target {
        peer: "dlock-etcd",
        workload: "W1",
        reference: ("etcd-client-lock", "W1"),
        factor: 1.2,
    },
    Target {
        peer: "dlock-etcd",
        workload: "W2",
        reference: ("etcd-client-lock", "W2"),
        factor: 5.0,
    },
];

/// One backend's table: title, dlock peer, the peers it is compared with, its ceilings
/// (peer, workload), first found wins.
type BackendRow = (
    &'static str,
    &'static str,
    &'static [&'static str],
    &'static [(&'static str, &'static str)],
);

/// For each dlock peer: the peers it is compared with and its ceiling.
const BACKENDS: &[BackendRow] = &[
    (
        "ZooKeeper",
        "dlock-zk",
        &["curator", "kazoo"],
        &[
            ("ceiling-zk", "W0s-zk-createseq-getchildren-delete"),
            ("curator", "W0s-zk-createseq-getchildren-delete"),
        ],
    ),
    (
        "etcd",
        "dlock-etcd",
        &["etcd-client-lock", "etcd-gateway"],
        &[("ceiling-etcd", "W0-etcd-put-delete")],
    ),
    (
        "Redis",
        "dlock-redis",
        &["rslock", "redis-py"],
        &[("ceiling-redis", "W0-redis-setnx-evalsha")],
    ),
    ("Redlock", "dlock-redlock", &["rslock"], &[]),
    ("Redis Cluster", "dlock-redis-cluster", &[], &[]),
];

const WORKLOADS: &[&str] = &["W1", "W2", "W3", "W4", "W5"];

type Sums = BTreeMap<(String, String), Summary>;

fn get<'a>(s: &'a Sums, peer: &str, wl: &str) -> Option<&'a Summary> {
    s.get(&(peer.to_owned(), wl.to_owned()))
}

fn ops(s: &Sums, peer: &str, wl: &str) -> Option<f64> {
    get(s, peer, wl).and_then(|x| x.fields.get("ops_s").copied())
}

fn fmt_ops(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// The markdown report: one table per backend, then the targets.
pub(crate) fn markdown(s: &Sums) -> String {
    let mut out = String::new();
    for (title, dl, peers, ceilings) in BACKENDS {
        if !WORKLOADS.iter().any(|w| get(s, dl, w).is_some()) {
            if let Some(skip) = get(s, dl, "all").and_then(|x| x.status.as_ref()) {
                let _ = writeln!(out, "### {title}: `{dl}` {skip}\n");
            }
            continue;
        }
        let ceiling = ceilings
            .iter()
            .find_map(|(p, w)| ops(s, p, w).map(|v| (p, v)));
        let _ = writeln!(out, "### {title}\n");
        let mut head =
            "| workload | dlock ops/s | p50 ms | p99 ms | max ms | fair min/max | checks |"
                .to_string();
        let mut rule = "|---|---:|---:|---:|---:|---:|---|".to_string();
        for p in *peers {
            let _ = write!(head, " {p} ops/s | dlock/{p} |");
            rule.push_str("---:|---:|");
        }
        if let Some((cp, _)) = ceiling {
            let _ = write!(head, " dlock/{cp} |");
            rule.push_str("---:|");
        }
        let _ = writeln!(out, "{head}\n{rule}");
        for wl in WORKLOADS {
            let Some(d) = get(s, dl, wl) else { continue };
            let f = |k: &str| d.fields.get(k).copied();
            let Some(dops) = f("ops_s") else {
                let _ = writeln!(
                    out,
                    "| {wl} | {} | | | | | |",
                    d.status.clone().unwrap_or_default()
                );
                continue;
            };
            let fair = match (f("per_worker_min"), f("per_worker_max")) {
                (Some(a), Some(b)) if b > 0.0 => format!("{a:.0}/{b:.0} ({:.2})", a / b),
                _ => String::new(),
            };
            let mut checks = Vec::new();
            if d.fields.contains_key("violations") {
                checks.push(format!("{} violations", d.violations_total));
            }
            if d.fields.contains_key("counter") {
                checks.push(if d.counter_ok_all {
                    "counter ok".into()
                } else {
                    "COUNTER LOST".into()
                });
            }
            if let Some(p) = f("peak_readers") {
                checks.push(format!("peak readers {p:.0}"));
            }
            if let Some(p) = f("max_holders") {
                checks.push(format!("max holders {p:.0}"));
            }
            let _ = write!(
                out,
                "| {wl} | {} | {:.3} | {:.2} | {:.1} | {fair} | {} |",
                fmt_ops(dops),
                f("p50_ms").unwrap_or(f64::NAN),
                f("p99_ms").unwrap_or(f64::NAN),
                f("max_ms").unwrap_or(f64::NAN),
                checks.join(", ")
            );
            for p in *peers {
                match ops(s, p, wl) {
                    Some(po) if po > 0.0 => {
                        let _ = write!(out, " {} | {:.2}x |", fmt_ops(po), dops / po);
                    }
                    _ => out.push_str(" – | – |"),
                }
            }
            if let Some((_, cv)) = ceiling {
                let _ = write!(out, " {:.2}x |", dops / cv);
            }
            out.push('\n');
        }
        if let Some((cp, cv)) = ceiling {
            let _ = writeln!(
                out,
                "\nCeiling `{cp}`: {} ops/s (acquire+release pairs, one connection, no recipe).",
                fmt_ops(cv)
            );
        }
        out.push('\n');
    }
    out.push_str(&failover_table(s));
    let mut t = String::from("### Targets\n\n| target | measured | met |\n|---|---:|---|\n");
    let mut any = false;
    for tg in TARGETS {
        let (Some(d), Some(r)) = (
            ops(s, tg.peer, tg.workload),
            ops(s, tg.reference.0, tg.reference.1),
        ) else {
            continue;
        };
        any = true;
        let ratio = d / r;
        let _ = writeln!(
            t,
            "| {} {} ≥ {}x {} {} | {ratio:.2}x | {} |",
            tg.peer,
            tg.workload,
            tg.factor,
            tg.reference.0,
            tg.reference.1,
            if ratio >= tg.factor { "yes" } else { "**no**" }
        );
    }
    if let Some(d) = get(s, "dlock-redis", "W2") {
        if let (Some(a), Some(b), Some(m)) = (
            d.fields.get("per_worker_min"),
            d.fields.get("per_worker_max"),
            d.fields.get("max_ms"),
        ) {
            any = true;
            let fair = if *b > 0.0 { a / b } else { 0.0 };
            let _ = writeln!(
                t,
                "| dlock-redis W2 fair min/max ≥ 0.8 | {fair:.2} | {} |",
                if fair >= 0.8 { "yes" } else { "**no**" }
            );
            let _ = writeln!(
                t,
                "| dlock-redis W2 max wait < 50 ms | {m:.1} ms | {} |",
                if *m < 50.0 { "yes" } else { "**no**" }
            );
        }
    }
    if any {
        out.push_str(&t);
    }
    out
}

/// W6's rows (leader failover), each backend's dlock beside the election it is compared
/// with: (backend, peer).
const FAILOVER_ROWS: &[(&str, &str)] = &[
    ("ZooKeeper", "dlock-zk"),
    ("ZooKeeper", "curator-leaderlatch"),
    ("etcd", "dlock-etcd"),
    ("etcd", "etcdctl-elect"),
    ("Redis", "dlock-redis"),
    ("Redlock", "dlock-redlock"),
    ("Redis Cluster", "dlock-redis-cluster"),
];

/// The W6 table: SIGKILL of the leader to the next leader's announcement; empty when W6
/// did not run.
fn failover_table(s: &Sums) -> String {
    let mut out = String::new();
    let rows: Vec<_> = FAILOVER_ROWS
        .iter()
        .filter_map(|(b, p)| get(s, p, "W6").map(|x| (b, p, x)))
        .collect();
    if rows.is_empty() {
        return out;
    }
    out.push_str("### Leader failover (W6)\n\n");
    out.push_str("| backend | peer | session s | p50 ms | p99 ms | max ms | p50 − session ms | failovers | violations |\n");
    out.push_str("|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for (b, p, x) in rows {
        let f = |k: &str| x.fields.get(k).copied();
        let Some(p50) = f("p50_ms") else {
            let _ = writeln!(
                out,
                "| {b} | {p} | {} | | | | | | |",
                x.status.clone().unwrap_or_default()
            );
            continue;
        };
        let _ = writeln!(
            out,
            "| {b} | {p} | {:.0} | {p50:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {} |",
            f("session_s").unwrap_or(f64::NAN),
            f("p99_ms").unwrap_or(f64::NAN),
            f("max_ms").unwrap_or(f64::NAN),
            f("excess_p50_ms").unwrap_or(f64::NAN),
            f("n").unwrap_or(f64::NAN),
            x.violations_total,
        );
    }
    out.push('\n');
    out
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A grouped bar chart, ops/s on a log scale: per backend and workload, dlock beside its
/// peers and its ceiling.
pub(crate) fn svg(s: &Sums, title: &str) -> String {
    const COLORS: &[&str] = &[
        "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#7f7f7f",
    ];
    let mut groups: Vec<(String, Vec<(String, f64)>)> = Vec::new();
    for (name, dl, peers, ceilings) in BACKENDS {
        for wl in WORKLOADS {
            let Some(d) = ops(s, dl, wl) else { continue };
            let mut bars = vec![("dlock".to_string(), d)];
            for p in *peers {
                if let Some(v) = ops(s, p, wl) {
                    bars.push(((*p).to_string(), v));
                }
            }
            if let Some((cp, cv)) = ceilings
                .iter()
                .find_map(|(p, w)| ops(s, p, w).map(|v| (p, v)))
            {
                bars.push((format!("{cp} (W0)"), cv));
            }
            groups.push((format!("{name} {wl}"), bars));
        }
    }
    let mut legend: Vec<String> = Vec::new();
    for (_, bars) in &groups {
        for (n, _) in bars {
            if !legend.contains(n) {
                legend.push(n.clone());
            }
        }
    }
    let color = |n: &str| COLORS[legend.iter().position(|l| l == n).unwrap_or(0) % COLORS.len()];
    let max = groups
        .iter()
        .flat_map(|g| g.1.iter().map(|b| b.1))
        .fold(100.0_f64, f64::max);
    let top = 10f64.powf(max.log10().ceil());
    let (left, right, plot_top, plot_h, bar_w, gap) = (70.0, 20.0, 50.0, 300.0, 14.0, 18.0);
    let width: f64 = left
        + right
        + groups
            .iter()
            .map(|g| g.1.len() as f64 * bar_w + gap)
            .sum::<f64>();
    let width = width.max(600.0);
    let legend_y = plot_top + plot_h + 70.0;
    let height = legend_y + 20.0 * ((legend.len() as f64) / 3.0).ceil() + 10.0;
    // Every figure here is above 10 ops/s; starting the axis there keeps the bars apart.
    let bottom = 10.0_f64;
    let y = |v: f64| {
        let f = (v.max(bottom).log10() - bottom.log10()) / (top.log10() - bottom.log10());
        plot_top + plot_h * (1.0 - f)
    };
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(o, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        o,
        r#"<text x="{left}" y="22" font-size="14" font-weight="bold">{}</text>"#,
        esc(title)
    );
    let _ = writeln!(
        o,
        r##"<text x="{left}" y="38" fill="#555">ops/s, log scale, median of runs; higher is better</text>"##
    );
    let mut p = bottom;
    while p <= top {
        let yy = y(p);
        let _ = writeln!(
            o,
            r##"<line x1="{left}" x2="{:.0}" y1="{yy:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{:.0}" y="{:.1}" text-anchor="end" fill="#555">{}</text>"##,
            width - right,
            left - 5.0,
            yy + 4.0,
            fmt_ops(p)
        );
        p *= 10.0;
    }
    let mut x = left + gap / 2.0;
    for (label, bars) in &groups {
        let gx = x;
        for (n, v) in bars {
            let yy = y(*v);
            let _ = writeln!(
                o,
                r#"<rect x="{x:.1}" y="{yy:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{}: {} ops/s</title></rect>"#,
                bar_w - 1.0,
                plot_top + plot_h - yy,
                color(n),
                esc(n),
                fmt_ops(*v)
            );
            x += bar_w;
        }
        let cx = (gx + x) / 2.0;
        let ly = plot_top + plot_h + 12.0;
        let _ = writeln!(
            o,
            r#"<text x="{cx:.1}" y="{ly:.1}" text-anchor="end" transform="rotate(-40 {cx:.1} {ly:.1})">{}</text>"#,
            esc(label)
        );
        x += gap;
    }
    let _ = writeln!(
        o,
        r##"<line x1="{left}" x2="{left}" y1="{plot_top}" y2="{:.0}" stroke="#333"/>"##,
        plot_top + plot_h
    );
    for (i, n) in legend.iter().enumerate() {
        let lx = left + (i % 3) as f64 * 200.0;
        let ly = legend_y + (i / 3) as f64 * 20.0;
        let _ = writeln!(
            o,
            r#"<rect x="{lx:.0}" y="{:.0}" width="12" height="12" fill="{}"/><text x="{:.0}" y="{:.0}">{}</text>"#,
            ly - 10.0,
            color(n),
            lx + 16.0,
            ly,
            esc(n)
        );
    }
    o.push_str("</svg>\n");
    o
}

/// Writes `bench-<unix time>.json`, `latest.json` and `latest.md` under `out_dir`, and the
/// SVG chart (`--svg`, else `out_dir/bench.svg`).
pub(super) fn write_files(
    out_dir: &Path,
    args: &BenchArgs,
    lines: &[String],
    sums: &Sums,
    md: &str,
) -> anyhow::Result<()> {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let json = serde_json::json!({
        "unix_time": stamp,
        "source": args.from.as_ref().map(|p| p.display().to_string())
            .or_else(|| args.peers.as_ref().map(|p| format!("peers:{}", p.display())))
            .unwrap_or_else(|| "dlock-bench".into()),
        "lines": lines,
        "summary": sums.iter().map(|((p, w), s)| serde_json::json!({
            "peer": p, "workload": w, "runs": s.runs, "median": s.fields,
            "violations_total": s.violations_total, "counter_ok_all": s.counter_ok_all, "status": s.status,
        })).collect::<Vec<_>>(),
        "markdown": md,
    });
    let json_path = out_dir.join(format!("bench-{stamp}.json"));
    std::fs::write(&json_path, serde_json::to_string_pretty(&json)?)?;
    std::fs::write(
        out_dir.join("latest.json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    std::fs::write(out_dir.join("latest.md"), md)?;
    let svg_path = args
        .svg
        .clone()
        .unwrap_or_else(|| out_dir.join("bench.svg"));
    std::fs::write(&svg_path, svg(sums, &args.title))?;
    eprintln!(
        "wrote {}, {} and {}",
        json_path.display(),
        out_dir.join("latest.md").display(),
        svg_path.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::parse::{parse_line, summarise, Row};
    use super::*;

    const RAW: &str = "\
run=1 peer=curator workload=W2 ops_s=600.0 p50_ms=9.8 p99_ms=44 max_ms=63 n=1800 secs=3.00 workers=8 per_worker_min=221 per_worker_max=222 violations=0 counter=1800 counter_ok=true
run=1 peer=dlock-zk workload=W2 ops_s=1000.0 p50_ms=5 p99_ms=20 max_ms=30 n=3000 secs=3.00 workers=8 per_worker_min=370 per_worker_max=380 violations=0 counter=3000 counter_ok=true
run=2 peer=dlock-zk workload=W2 ops_s=800.0 p50_ms=5 p99_ms=20 max_ms=30 n=2400 secs=3.00 workers=8 per_worker_min=300 per_worker_max=302 violations=0 counter=2400 counter_ok=true
# run=2 rust loadavg=1,2,3
peer=dlock-etcd workload=all status=skipped reason=no_feature";

    #[test]
    fn parses_summarises_and_reports_ratios() {
        let rows: Vec<Row> = RAW.lines().filter_map(parse_line).collect();
        assert_eq!(rows.len(), 4);
        let s = summarise(&rows);
        let d = get(&s, "dlock-zk", "W2").expect("dlock-zk W2");
        assert_eq!(d.runs, 2);
        assert_eq!(d.fields.get("ops_s"), Some(&900.0));
        let md = markdown(&s);
        assert!(md.contains("| W2 | 900 |"), "{md}");
        assert!(md.contains("1.50x"), "{md}");
        assert!(
            md.contains("dlock-zk W2 ≥ 1.5x curator W2 | 1.50x | yes"),
            "{md}"
        );
        assert!(
            md.contains("status=skipped") || md.contains("skipped"),
            "{md}"
        );
        let chart = svg(&s, "t");
        assert!(chart.starts_with("<svg") && chart.contains("ZooKeeper W2"));
        assert!(!md.contains("W6"), "no W6 table without W6 lines: {md}");
    }

    #[test]
    fn failover_rows_sit_beside_their_peers() {
        let raw = "\
run=1 peer=dlock-etcd workload=W6 p50_ms=2100 p99_ms=2600 max_ms=2600 n=10 session_s=2.0 excess_p50_ms=100 violations=0 note=sigkill_to_next_leader
run=1 peer=etcdctl-elect workload=W6 p50_ms=60300 p99_ms=60900 max_ms=60900 n=3 session_s=60.0 excess_p50_ms=300 violations=0 note=sigkill_to_next_leader
run=1 peer=curator-leaderlatch workload=W6 status=failed reason=x";
        let rows: Vec<Row> = raw.lines().filter_map(parse_line).collect();
        let md = markdown(&summarise(&rows));
        assert!(md.contains("### Leader failover (W6)"), "{md}");
        assert!(
            md.contains("| etcd | dlock-etcd | 2 | 2100 | 2600 | 2600 | 100 | 10 | 0 |"),
            "{md}"
        );
        assert!(md.contains("| etcd | etcdctl-elect | 60 | 60300 |"), "{md}");
        assert!(
            md.contains("| ZooKeeper | curator-leaderlatch | failed |"),
            "{md}"
        );
        let zk = md.find("curator-leaderlatch").unwrap_or(usize::MAX);
        assert!(
            zk < md.find("dlock-etcd").unwrap_or(0),
            "ZooKeeper rows first: {md}"
        );
    }
}
