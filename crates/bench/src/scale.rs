//! Scale checks (with `--scale`): server operations per release as the queue on one
//! lock or semaphore grows (S1), and client memory per held lock (S2).

use std::time::{Duration, Instant};

use dlock::Client;
use futures::StreamExt as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use crate::resp::{commandstats_calls, Conn, Reply};

/// Where a backend's server counts the requests it served.
#[derive(Debug, Clone)]
pub enum OpCounter {
    /// ZooKeeper 4lw `mntr`: `zk_packets_received`.
    Zk(String),
    /// Redis `INFO commandstats`: the sum of `calls`.
    Redis(String),
    /// etcd `/metrics`: the sum of `grpc_server_started_total` (one per unary call or stream).
    Etcd(String),
}

impl OpCounter {
    /// The counter now.
    ///
    /// # Errors
    /// I/O or parse errors, as text.
    pub async fn read(&self) -> Result<u64, String> {
        match self {
            OpCounter::Zk(addr) => {
                let text = raw_request(addr, b"mntr").await?;
                text.lines()
                    .find_map(|l| l.strip_prefix("zk_packets_received"))
                    .and_then(|v| v.trim().parse().ok())
                    .ok_or_else(|| {
                        format!("no zk_packets_received in mntr of {addr} (is mntr whitelisted?)")
                    })
            }
            OpCounter::Redis(addr) => {
                let mut c = Conn::connect(addr).await?;
                match c.cmd(&[b"INFO", b"commandstats"]).await? {
                    Reply::Bulk(Some(b)) => Ok(commandstats_calls(&String::from_utf8_lossy(&b))),
                    other => Err(format!("INFO answered {other:?}")),
                }
            }
            OpCounter::Etcd(addr) => {
                let req = format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n");
                let text = raw_request(addr, req.as_bytes()).await?;
                let total: f64 = text
                    .lines()
                    .filter(|l| l.starts_with("grpc_server_started_total{"))
                    .filter_map(|l| l.rsplit(' ').next())
                    .filter_map(|v| v.parse::<f64>().ok())
                    .sum();
                // Prometheus prints counters as floats; they are whole numbers.
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                Ok(total as u64)
            }
        }
    }
}

async fn raw_request(addr: &str, req: &[u8]) -> Result<String, String> {
    let mut s = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect {addr}: {e}"))?;
    s.write_all(req)
        .await
        .map_err(|e| format!("write {addr}: {e}"))?;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .map_err(|_| format!("{addr} did not answer"))?
        .map_err(|e| format!("read {addr}: {e}"))?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// S1: `waiters` tasks queue on one held lock; then every hold is released in turn.
/// Returns (server operations, releases, seconds) of the handoff phase.
///
/// # Errors
/// Backend errors, or a queue that does not fill within two minutes.
pub async fn waiters(
    holder: &Client,
    waiter_client: &Client,
    name: &str,
    waiters: usize,
    counter: &OpCounter,
) -> Result<(u64, u64, f64), String> {
    let m = holder.mutex(name).map_err(|e| e.to_string())?;
    let mut held = m.lock().await.map_err(|e| format!("holder lock: {e}"))?;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..waiters {
        let wm = waiter_client.mutex(name).map_err(|e| e.to_string())?;
        tasks.spawn(async move {
            let mut g = wm.lock().await.map_err(|e| format!("waiter lock: {e}"))?;
            g.release()
                .await
                .map_err(|e| format!("waiter release: {e}"))
        });
    }
    let release = async move {
        held.release()
            .await
            .map_err(|e| format!("holder release: {e}"))
    };
    handoffs(holder, name, 1, tasks, counter, release).await
}

/// S1 for the semaphore (`S1-permits`): one client holds all `permits` permits, `waiters`
/// tasks of another client queue for one each; then the holder gives its permits back
/// at once and every waiter, granted, gives its own back. Herd-free means the server
/// requests per release stay constant as `waiters` grows. Returns (server operations,
/// releases, seconds) of the handoff phase.
///
/// # Errors
/// Backend errors, or a queue that does not fill within two minutes.
pub async fn permit_waiters(
    holder: &Client,
    waiter_client: &Client,
    name: &str,
    permits: u32,
    waiters: usize,
    counter: &OpCounter,
) -> Result<(u64, u64, f64), String> {
    let s = holder.semaphore(name, permits).map_err(|e| e.to_string())?;
    let mut held = Vec::new();
    for _ in 0..permits {
        held.push(
            s.acquire()
                .await
                .map_err(|e| format!("holder acquire: {e}"))?,
        );
    }
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..waiters {
        let ws = waiter_client
            .semaphore(name, permits)
            .map_err(|e| e.to_string())?;
        tasks.spawn(async move {
            let mut g = ws
                .acquire()
                .await
                .map_err(|e| format!("waiter acquire: {e}"))?;
            g.release()
                .await
                .map_err(|e| format!("waiter release: {e}"))
        });
    }
    let release = async move {
        futures::future::try_join_all(held.iter_mut().map(|g| g.release()))
            .await
            .map(drop)
            .map_err(|e| format!("holder release: {e}"))
    };
    handoffs(holder, name, permits as usize, tasks, counter, release).await
}

/// The handoff phase of S1: waits until `holders` + every task's contender are listed
/// and their watches are armed, then runs `release` and waits for every task. Returns
/// (server operations, releases, seconds) from the release on.
async fn handoffs(
    holder: &Client,
    name: &str,
    holders: usize,
    mut tasks: tokio::task::JoinSet<Result<(), String>>,
    counter: &OpCounter,
    release: impl std::future::Future<Output = Result<(), String>>,
) -> Result<(u64, u64, f64), String> {
    let waiters = tasks.len();
    let contenders = holders + waiters;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let n = holder
            .participants(name)
            .await
            .map_err(|e| format!("participants: {e}"))?
            .len();
        if n >= contenders {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!(
                "only {n} of {contenders} contenders queued after 120 s"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    settle(counter, waiters).await?;
    let before = counter.read().await?;
    let t = Instant::now();
    release.await?;
    while let Some(r) = tasks.join_next().await {
        r.map_err(|e| format!("waiter task: {e}"))??;
    }
    let secs = t.elapsed().as_secs_f64();
    let after = counter.read().await?;
    Ok((after.saturating_sub(before), contenders as u64, secs))
}

/// Waits until every queued waiter has armed its watch: a waiter is listed once its
/// entry exists, but may still be subscribing (Redis) or setting its watch, and those
/// requests are not handoff work. Settled = fewer than `waiters / 4 + 20` server requests
/// in half a second (what is left is background: session pings, re-check timers), or 30 s.
async fn settle(counter: &OpCounter, waiters: usize) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = counter.read().await?;
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = counter.read().await?;
        if now.saturating_sub(last) < waiters as u64 / 4 + 20 || Instant::now() > deadline {
            return Ok(());
        }
        last = now;
    }
}

/// This process's resident memory, in KiB (`VmRSS` of `/proc/self/status`).
fn rss_kib() -> Result<u64, String> {
    let status = std::fs::read_to_string("/proc/self/status").map_err(|e| e.to_string())?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| "no VmRSS in /proc/self/status".into())
}

/// S2: one client holds `n` locks at once. Returns (RSS before KiB, RSS held KiB, secs).
///
/// # Errors
/// Backend errors.
pub async fn held_locks(client: &Client, base: &str, n: usize) -> Result<(u64, u64, f64), String> {
    let mutexes = (0..n)
        .map(|i| client.mutex(&format!("{base}/{i}")))
        .collect::<dlock::Result<Vec<_>>>()
        .map_err(|e| e.to_string())?;
    let before = rss_kib()?;
    let t = Instant::now();
    let results: Vec<_> = futures::stream::iter(mutexes.iter().map(|m| m.lock()))
        .buffer_unordered(64)
        .collect()
        .await;
    let secs = t.elapsed().as_secs_f64();
    let held_rss = rss_kib()?;
    let mut guards = Vec::with_capacity(n);
    let mut first_err = None;
    for r in results {
        match r {
            Ok(g) => guards.push(g),
            Err(e) => first_err = first_err.or(Some(format!("lock: {e}"))),
        }
    }
    let released: Vec<_> = futures::stream::iter(guards.iter_mut().map(|g| g.release()))
        .buffer_unordered(64)
        .collect()
        .await;
    if let Some(e) = first_err {
        return Err(e);
    }
    if let Some(Err(e)) = released.into_iter().find(Result::is_err) {
        return Err(format!("release: {e}"));
    }
    Ok((before, held_rss, secs))
}

/// What a run of S3 cost the server, per acquire + release.
#[derive(Debug, Clone, Copy)]
pub struct ServerCost {
    /// `INFO commandstats` usec of the commands the client sent, per op. A script's
    /// usec includes the commands it ran, so those are not added again.
    pub usec_per_op: f64,
    /// Every command's `calls`, those inside scripts included, per op.
    pub calls_per_op: f64,
}

/// `INFO commandstats` as command → (calls, usec), without the `info` calls.
async fn commandstats(addr: &str) -> Result<std::collections::HashMap<String, (u64, u64)>, String> {
    let mut c = Conn::connect(addr).await?;
    let text = match c.cmd(&[b"INFO", b"commandstats"]).await? {
        Reply::Bulk(Some(b)) => String::from_utf8_lossy(&b).into_owned(),
        other => return Err(format!("INFO answered {other:?}")),
    };
    Ok(crate::resp::commandstats_table(&text))
}

/// S3 (Redis): `n` uncontended acquire + release pairs of one name by one worker, in a
/// row, and what they cost the server: the growth of `INFO commandstats` over the run.
/// `top_level` names the commands the worker itself sends (their usec is counted;
/// commands run inside a script are in the script's usec already). Other clients of the
/// server during the run are counted too: run it on a server of its own.
///
/// # Errors
/// Backend or `INFO` errors.
pub async fn server_cost(
    addr: &str,
    top_level: &[&str],
    n: usize,
    worker: &mut dyn crate::harness::Worker,
) -> Result<ServerCost, String> {
    // One pair first, so that script loads and subscriptions are not counted.
    worker.iter().await?;
    let before = commandstats(addr).await?;
    for _ in 0..n {
        worker.iter().await?;
    }
    let after = commandstats(addr).await?;
    let grown = |cmd: &str| {
        let (c0, u0) = before.get(cmd).copied().unwrap_or_default();
        let (c1, u1) = after.get(cmd).copied().unwrap_or_default();
        (c1.saturating_sub(c0), u1.saturating_sub(u0))
    };
    let calls: u64 = after.keys().map(|k| grown(k).0).sum();
    let usec: u64 = top_level.iter().map(|k| grown(k).1).sum();
    Ok(ServerCost {
        usec_per_op: usec as f64 / n as f64,
        calls_per_op: calls as f64 / n as f64,
    })
}
