//! dlock's metrics in Prometheus, and a readiness check: what an operator scrapes.
//!
//! dlock records through the `metrics` facade and ships no exporter; the application
//! installs one. Here `metrics-exporter-prometheus` serves `/metrics` over HTTP; a few
//! workers contend for one lock (granted, would-block and timed-out acquires, holds of
//! known length), then the example scrapes its own endpoint as Prometheus would and checks
//! that every acquire it made is there. `Client::health` is the readiness probe.
//!
//! ```sh
//! cargo run -p dlock-examples --bin metrics -- --url zk://127.0.0.1:2181
//! # meanwhile: curl -s http://127.0.0.1:9898/metrics | grep dlock_
//! ```

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use dlock_examples::{join_all, run_id, Common, Report};
use metrics_exporter_prometheus::PrometheusBuilder;

#[derive(Debug, Parser)]
#[command(about = "dlock's metrics served to Prometheus, and the readiness check")]
struct Args {
    #[command(flatten)]
    common: Common,
    /// Where to serve `/metrics` (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Workers, each its own session.
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// Critical sections per worker.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
}

/// A free port for the exporter when `--listen` asks for any.
fn resolve(listen: SocketAddr) -> std::io::Result<SocketAddr> {
    if listen.port() != 0 {
        return Ok(listen);
    }
    TcpListener::bind(listen)?.local_addr()
}

/// `GET /metrics` as a scraper sends it; the body.
fn scrape(addr: SocketAddr) -> std::io::Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or(out))
}

/// The value of the series `name{labels...}` in a Prometheus text page (the labels as
/// written there, in order), if present.
fn series(page: &str, name: &str, labels: &str) -> Option<f64> {
    let prefix = format!("{name}{{{labels}}} ");
    page.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
}

async fn scenario(url: String, args: Args) -> Result<Report, dlock::Error> {
    let mut r = Report::new();
    let addr = resolve(args.listen).map_err(|e| dlock::Error::backend("choosing a port", e))?;
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .install()
        .map_err(|e| dlock::Error::backend("starting the Prometheus exporter", e))?;
    r.note(format!("serving http://{addr}/metrics"));

    let name = format!("examples/{}/metrics/job", run_id());
    let mut clients = Vec::new();
    let mut workers = Vec::new();
    for _ in 0..args.workers {
        let c = dlock::connect(&url).await?;
        // The readiness probe: the session is live and the servers answer.
        c.health().await?;
        let m = c.mutex(&name)?;
        let rounds = args.rounds;
        workers.push(tokio::spawn(async move {
            for _ in 0..rounds {
                let mut g = m.lock().await?;
                tokio::time::sleep(Duration::from_millis(10)).await;
                g.release().await?;
            }
            Ok::<_, dlock::Error>(())
        }));
        clients.push(c);
    }
    join_all(workers).await?;
    // One refused try and one timeout, against a holder.
    let mut g = clients[0].mutex(&name)?.lock().await?;
    let other = clients[1 % clients.len()].mutex(&name)?;
    let try_refused = matches!(other.try_lock().await, Err(dlock::Error::WouldBlock));
    let timed_out = matches!(
        other.lock_timeout(Duration::from_millis(200)).await,
        Err(dlock::Error::Timeout(_))
    );
    g.release().await?;
    r.check(
        try_refused && timed_out,
        "a held lock refuses a try and times out a wait",
    );

    let page = tokio::task::spawn_blocking(move || scrape(addr))
        .await
        .map_err(|e| dlock::Error::backend("scraping", e))?
        .map_err(|e| dlock::Error::backend("scraping", e))?;
    let backend = dlock::BackendUrl::parse(&url)?;
    let label = match backend.servers {
        dlock::Servers::ZooKeeper { .. } => "zk",
        dlock::Servers::Etcd { .. } => "etcd",
        dlock::Servers::Redlock { .. } => "redlock",
        dlock::Servers::RedisCluster { .. } => "redis-cluster",
        _ => "redis",
    };
    let at = |outcome: &str| {
        series(
            &page,
            "dlock_acquires_total",
            &format!("backend=\"{label}\",kind=\"lock\",outcome=\"{outcome}\""),
        )
        .unwrap_or(0.0)
    };
    let granted = at("granted");
    let expected = (args.workers * args.rounds + 1) as f64;
    r.note(format!(
        "scraped: {granted} granted, {} would-block, {} timeouts",
        at("would_block"),
        at("timeout")
    ));
    r.check(
        granted == expected,
        format!("dlock_acquires_total granted = {granted}, {expected} made"),
    );
    r.check(
        at("would_block") >= 1.0 && at("timeout") >= 1.0,
        "the refused try and the timeout are counted",
    );
    r.check(
        page.contains("dlock_hold_seconds"),
        "hold times are exported (dlock_hold_seconds)",
    );
    for c in clients {
        c.close().await?;
    }
    Ok(r)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let common = args.common.clone();
    dlock_examples::run("metrics", &common, |url| scenario(url, args)).await
}
