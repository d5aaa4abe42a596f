//! `cargo xtask bench`: dlock-bench beside the peers, summarised as a markdown table of
//! ratios (dlock/peer, dlock/ceiling) against the targets, JSON under `target/bench/`
//! and an SVG chart.
//!
//! Three sources of result lines:
//! - default: start ZooKeeper 1 + etcd 1 + Redis 5 (testkit), run `dlock-bench` (release)
//!   `--repeats` times, plus `redis-benchmark -c 1 -P 1` as the Redis wire ceiling;
//! - `--peers DIR`: run `DIR/run.sh` (the peer harness: Curator, kazoo, redis-py, rslock,
//!   etcd's lock) with `RUST_BENCH_CMD` set to dlock-bench, so dlock runs interleaved
//!   with the peers against the same servers;
//! - `--from FILE`: re-summarise a saved raw file of result lines.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead as _, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context as _};
use dlock_testkit::ClusterSpec;
use indicatif::{ProgressBar, ProgressStyle};

use crate::flags::BenchArgs;

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
                    .all(|r| r.get("counter_ok").map_or(true, |v| v == "true")),
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

/// Checks the lines of a smoke run: every line parses, nothing failed, no violation,
/// every counter intact, and at least one dlock workload ran. Returns how many ran.
pub(crate) fn check_smoke(lines: &[String]) -> anyhow::Result<usize> {
    let mut ran = 0;
    for l in lines.iter().filter(|l| l.starts_with("peer=")) {
        let row = parse_line(l).with_context(|| format!("unparsable result line: {l}"))?;
        match row.get("status").map(String::as_str) {
            Some("skipped") => continue,
            Some(other) => bail!("{other}: {l}"),
            None => {}
        }
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

/// Builds dlock-bench in release mode and returns its path.
fn build_bench(root: &Path, release: bool) -> anyhow::Result<PathBuf> {
    crate::header(&format!(
        "cargo build{} --bin dlock-bench",
        if release { " --release" } else { "" }
    ));
    let mut cmd = crate::cargo();
    cmd.current_dir(root)
        .args(["build", "-p", "dlock-bench", "--bin", "dlock-bench"]);
    if release {
        cmd.arg("--release");
    }
    let status = cmd.status().context("running cargo build")?;
    if !status.success() {
        bail!("building dlock-bench failed ({status})");
    }
    Ok(crate::target_dir(root)
        .join(if release { "release" } else { "debug" })
        .join("dlock-bench"))
}

/// Runs `cmd`, echoing comment lines to stderr under a progress bar and collecting
/// result lines.
fn run_collect(
    mut cmd: Command,
    bar: &ProgressBar,
    expected_runs: u64,
) -> anyhow::Result<(Vec<String>, bool)> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .context("starting the benchmark")?;
    let mut lines = Vec::new();
    if let Some(out) = child.stdout.take() {
        for line in BufReader::new(out).lines() {
            let line = line.context("reading benchmark output")?;
            if let Some(row) = parse_line(&line) {
                bar.set_message(format!(
                    "{} {} {}",
                    row.get("peer").map(String::as_str).unwrap_or(""),
                    row.get("workload").map(String::as_str).unwrap_or(""),
                    row.get("ops_s")
                        .map(|v| format!("{v} ops/s"))
                        .unwrap_or_default()
                ));
                if !line.starts_with("SUMMARY") {
                    lines.push(line);
                }
            } else if let Some(rest) = line.strip_prefix("# run=") {
                // run.sh: "# run=K PEER loadavg=..." starts the next peer of a repeat.
                if let Some(k) = rest
                    .split_whitespace()
                    .next()
                    .and_then(|k| k.parse::<u64>().ok())
                {
                    bar.set_position(k.saturating_sub(1).min(expected_runs));
                }
                bar.println(line);
            }
        }
    }
    let status = child.wait().context("waiting for the benchmark")?;
    Ok((lines, status.success()))
}

pub(crate) fn run(root: &Path, args: &BenchArgs) -> anyhow::Result<i32> {
    let out_dir = crate::target_dir(root).join("bench");
    std::fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let (lines, ok) = if let Some(from) = &args.from {
        let text =
            std::fs::read_to_string(from).with_context(|| format!("reading {}", from.display()))?;
        (
            text.lines()
                .filter(|l| parse_line(l).is_some() && !l.starts_with("SUMMARY"))
                .map(str::to_owned)
                .collect(),
            true,
        )
    } else {
        let bin = build_bench(root, true)?;
        let bar = ProgressBar::new(u64::from(args.repeats));
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] run {pos}/{len} {wide_msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        bar.enable_steady_tick(Duration::from_millis(200));
        let r = if let Some(peers) = &args.peers {
            run_peers(root, args, &bin, peers, &bar)
        } else {
            run_own(args, &bin, &bar)
        };
        bar.finish_and_clear();
        r?
    };
    let rows: Vec<Row> = lines.iter().filter_map(|l| parse_line(l)).collect();
    let sums = summarise(&rows);
    let md = markdown(&sums);
    println!("{md}");
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
    std::fs::write(out_dir.join("latest.md"), &md)?;
    let svg_path = args
        .svg
        .clone()
        .unwrap_or_else(|| out_dir.join("bench.svg"));
    std::fs::write(&svg_path, svg(&sums, &args.title))?;
    eprintln!(
        "wrote {}, {} and {}",
        json_path.display(),
        out_dir.join("latest.md").display(),
        svg_path.display()
    );
    Ok(if ok { 0 } else { 1 })
}

/// Our own servers: ZooKeeper 1, etcd 1, Redis 5 (Redlock), dlock-bench and redis-benchmark.
fn run_own(args: &BenchArgs, bin: &Path, bar: &ProgressBar) -> anyhow::Result<(Vec<String>, bool)> {
    let mut spec = ClusterSpec {
        zk: 1,
        etcd: 1,
        redis: 5,
        ..ClusterSpec::default()
    };
    spec.port_offset = 1000;
    let cluster = crate::cluster::start_with_progress(&mut spec, (1..40).map(|i| 1000 + i * 50))?;
    let e = cluster.endpoints();
    let mut lines = Vec::new();
    let mut ok = true;
    for r in 1..=args.repeats {
        bar.set_position(u64::from(r - 1));
        let mut cmd = Command::new(bin);
        cmd.args([
            "--duration",
            &args.duration.to_string(),
            "--workers",
            &args.workers.to_string(),
        ])
        .args([
            "--leases",
            &args.leases.to_string(),
            "--prefix",
            &format!("xtask-bench-r{r}"),
        ]);
        for (flag, v) in [
            ("--zk", &e.zk),
            ("--etcd", &e.etcd),
            ("--redis", &e.redis),
            ("--redlock", &e.redlock),
        ] {
            if let Some(v) = v {
                cmd.args([flag, v]);
            }
        }
        if args.scale {
            cmd.arg("--scale");
        }
        let (l, good) = run_collect(cmd, bar, u64::from(args.repeats))?;
        ok &= good;
        lines.extend(l.into_iter().map(|l| format!("run={r} {l}")));
        if let Some(redis) = &e.redis {
            lines.extend(
                redis_benchmark(redis)
                    .into_iter()
                    .map(|l| format!("run={r} {l}")),
            );
        }
    }
    cluster.down().context("tearing the bench cluster down")?;
    Ok((lines, ok))
}

/// `redis-benchmark -c 1 -P 1` of SET NX PX and the release script: the Redis wire ceiling.
fn redis_benchmark(addr: &str) -> Vec<String> {
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Vec::new();
    };
    let lua = "if redis.call('get',KEYS[1])==ARGV[1] then return redis.call('del',KEYS[1]) else return 0 end";
    let tests: [(&str, Vec<&str>); 2] = [
        (
            "SET-NX-PX",
            vec!["SET", "lockbench:rb", "tok", "NX", "PX", "10000"],
        ),
        (
            "EVAL-release",
            vec!["EVAL", lua, "1", "lockbench:rb", "tok"],
        ),
    ];
    let mut out = Vec::new();
    for (label, cmd) in tests {
        let r = Command::new("redis-benchmark")
            .args([
                "-h", host, "-p", port, "-c", "1", "-P", "1", "-n", "20000", "--csv",
            ])
            .args(&cmd)
            .output();
        let Ok(r) = r else { continue };
        // CSV: "test","rps","avg_latency_ms","min","p50","p95","p99","max". The test name
        // (the Lua script) has commas of its own, so the fields are counted from the end.
        for l in String::from_utf8_lossy(&r.stdout).lines().skip(1) {
            let f: Vec<&str> = l.trim().trim_matches('"').split("\",\"").collect();
            if let [.., rps, _avg, _min, p50, _p95, p99, max] = f.as_slice() {
                if rps.parse::<f64>().is_ok() {
                    out.push(format!(
                        "peer=redis-benchmark workload={label} ops_s={rps} p50_ms={p50} p99_ms={p99} max_ms={max} n=20000 note=c1_P1"
                    ));
                }
            }
        }
    }
    out
}

/// The peer harness (`DIR/run.sh`) with dlock-bench as its `rust` peer.
fn run_peers(
    root: &Path,
    args: &BenchArgs,
    bin: &Path,
    peers: &Path,
    bar: &ProgressBar,
) -> anyhow::Result<(Vec<String>, bool)> {
    let run_sh = peers.join("run.sh");
    if !run_sh.exists() {
        bail!("{} not found", run_sh.display());
    }
    let work = crate::target_dir(root).join("bench").join("peers");
    std::fs::create_dir_all(&work)?;
    let rust_cmd = format!(
        "{} --zk \"$ZK_ADDR\" --etcd \"$ETCD_ADDR\" --redis \"$REDIS_ADDR\" --duration \"$DURATION\" \
         --workers \"$WORKERS\" --leases \"$LEASES\" --prefix \"$RUN_PREFIX\"{}",
        bin.display(),
        if args.scale { " --scale" } else { "" }
    );
    eprintln!("RUST_BENCH_CMD={rust_cmd}");
    // The peer folder may be read-only: its venv and rust-peers build go under target/.
    let venv = work.join("venv");
    let rp_target = work.join("rust-target");
    let mut cmd = if args.netns {
        prepare_offline(&venv, &rp_target, peers)?;
        let mut c = Command::new("unshare");
        c.args([
            "-n",
            "sh",
            "-c",
            "ip link set lo up && exec bash \"$0\" \"$@\"",
        ])
        .arg(&run_sh);
        c
    } else {
        let mut c = Command::new("bash");
        c.arg(&run_sh);
        c
    };
    if let Some(list) = &args.peer_list {
        cmd.args(list.split([' ', ',']).filter(|p| !p.is_empty()));
    }
    cmd.env("RUST_BENCH_CMD", &rust_cmd)
        .env("REPEATS", args.repeats.to_string())
        .env("DURATION", args.duration.to_string())
        .env("WORKERS", args.workers.to_string())
        .env("LEASES", args.leases.to_string())
        .env("VENV", &venv)
        .env("VENV_ETCD3", work.join("venv-etcd3"))
        .env("CARGO_TARGET_DIR", &rp_target);
    let (lines, ok) = run_collect(cmd, bar, u64::from(args.repeats))?;
    let raw = work.join("raw-results.txt");
    let mut f = std::fs::File::create(&raw)?;
    for l in &lines {
        writeln!(f, "{l}")?;
    }
    eprintln!("raw result lines: {}", raw.display());
    Ok((lines, ok))
}

/// In a fresh network namespace run.sh has no internet: make its venv and build
/// rust-peers beforehand.
fn prepare_offline(venv: &Path, rp_target: &Path, peers: &Path) -> anyhow::Result<()> {
    let py = venv.join("bin").join("python");
    let has_pkgs = Command::new(&py)
        .args(["-c", "import kazoo, redis"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_pkgs {
        crate::header("python venv for the peers (kazoo==2.11.0 redis==8.1.0)");
        let ok = Command::new("python3")
            .args(["-m", "venv"])
            .arg(venv)
            .status()?
            .success()
            && Command::new(venv.join("bin").join("pip"))
                .args([
                    "install",
                    "-q",
                    "--disable-pip-version-check",
                    "kazoo==2.11.0",
                    "redis==8.1.0",
                ])
                .status()?
                .success();
        if !ok {
            bail!("creating the peers' venv failed");
        }
    }
    let manifest = peers.join("rust-peers").join("Cargo.toml");
    if manifest.exists() {
        crate::header("cargo build --release rust-peers");
        let st = crate::cargo()
            .args([
                "build",
                "--release",
                "--locked",
                "--quiet",
                "--manifest-path",
            ])
            .arg(&manifest)
            .env("CARGO_TARGET_DIR", rp_target)
            .status()?;
        if !st.success() {
            bail!("building rust-peers failed");
        }
    }
    Ok(())
}

/// `cargo xtask ci`'s smoke pass: dlock-bench for a fraction of a second against the
/// integration servers; the lines must parse with no violation. Never a timed assertion.
pub(crate) fn smoke(root: &Path, endpoints: &dlock_testkit::Endpoints) -> anyhow::Result<bool> {
    let bin = build_bench(root, false)?;
    crate::header("dlock-bench smoke pass (--duration 0.2)");
    let mut cmd = Command::new(&bin);
    cmd.args([
        "--duration",
        "0.2",
        "--workers",
        "3",
        "--leases",
        "2",
        "--prefix",
        "xtask-smoke",
    ]);
    // The first node of each cluster is enough; Redlock gets every master.
    let first = |v: &Option<String>| {
        v.as_ref()
            .map(|s| s.split(',').next().unwrap_or(s).to_owned())
    };
    for (flag, v) in [
        ("--zk", first(&endpoints.zk)),
        ("--etcd", first(&endpoints.etcd)),
        ("--redis", first(&endpoints.redis)),
        ("--redlock", endpoints.redlock.clone()),
    ] {
        if let Some(v) = v {
            cmd.args([flag, &v]);
        }
    }
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .context("running dlock-bench")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<String> = text.lines().map(str::to_owned).collect();
    for l in &lines {
        eprintln!("  {l}");
    }
    match check_smoke(&lines) {
        Ok(n) if out.status.success() => {
            eprintln!("dlock-bench smoke: {n} dlock workloads ran, 0 violations");
            Ok(true)
        }
        Ok(_) => {
            eprintln!("dlock-bench smoke: exit status {}", out.status);
            Ok(false)
        }
        Err(e) => {
            eprintln!("dlock-bench smoke failed: {e:#}");
            Ok(false)
        }
    }
}

#[cfg(test)]
mod tests {
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
    }

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
}
