//! The fenced resource: a tiny storage service on loopback that accepts a write only with
//! a token at least as high as the highest it has accepted — the storage side of
//! Kleppmann's fencing, with `dlock::FenceGate` as the check.
//!
//! Protocol, one request per connection: the client sends `W <token> <worker>\n`, the
//! store answers `OK\n` or `STALE\n`. An unfenced store accepts every write and only
//! counts the ones a fenced store would have refused.

use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context as _;
use dlock::{FenceGate, FencingToken};

use super::history::WriteOutcome;

const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// What the store saw, for the report.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct StoreStats {
    /// Writes accepted.
    pub(crate) accepted: u64,
    /// Writes accepted although their token was below one accepted before (only an
    /// unfenced store does this).
    pub(crate) stale_accepted: u64,
    /// Writes refused for a stale token.
    pub(crate) stale_rejected: u64,
}

#[derive(Debug)]
struct Inner {
    fenced: bool,
    gate: FenceGate,
    highest: Option<u64>,
    stats: StoreStats,
}

impl Inner {
    /// The store's decision for one write, counted.
    fn write(&mut self, token: u64) -> bool {
        let stale = self.highest.is_some_and(|h| token < h);
        let accept = if self.fenced {
            self.gate.admit(FencingToken::new(token))
        } else {
            true
        };
        if accept {
            self.stats.accepted += 1;
            if stale {
                self.stats.stale_accepted += 1;
            }
            self.highest = self.highest.max(Some(token));
        } else {
            self.stats.stale_rejected += 1;
        }
        accept
    }
}

/// A running store; dropping it stops the service.
pub(crate) struct Store {
    addr: SocketAddr,
    inner: Arc<Mutex<Inner>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Store {
    /// Starts a store on an ephemeral loopback port.
    pub(crate) fn start(fenced: bool) -> anyhow::Result<Store> {
        let listener = TcpListener::bind("127.0.0.1:0").context("binding the fenced store")?;
        let addr = listener.local_addr().context("store address")?;
        let inner = Arc::new(Mutex::new(Inner {
            fenced,
            gate: FenceGate::new(),
            highest: None,
            stats: StoreStats::default(),
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let inner = Arc::clone(&inner);
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                for conn in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let inner = Arc::clone(&inner);
                    std::thread::spawn(move || {
                        let _ = serve(conn, &inner);
                    });
                }
            })
        };
        Ok(Store {
            addr,
            inner,
            stop,
            thread: Some(thread),
        })
    }

    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub(crate) fn stats(&self) -> StoreStats {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .stats
            .clone()
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(conn: TcpStream, inner: &Mutex<Inner>) -> std::io::Result<()> {
    conn.set_read_timeout(Some(IO_TIMEOUT))?;
    conn.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut line = String::new();
    BufReader::new(&conn).read_line(&mut line)?;
    let mut words = line.split_whitespace();
    let reply = match (
        words.next(),
        words.next().and_then(|t| t.parse::<u64>().ok()),
    ) {
        (Some("W"), Some(token)) => {
            let accepted = inner.lock().unwrap_or_else(|p| p.into_inner()).write(token);
            if accepted {
                "OK\n"
            } else {
                "STALE\n"
            }
        }
        _ => "ERR\n",
    };
    (&conn).write_all(reply.as_bytes())
}

/// One write to the store at `addr` with `token`, from a worker process.
pub(crate) fn write(addr: &str, token: u64, worker: u32) -> WriteOutcome {
    let attempt = || -> std::io::Result<String> {
        let addr: SocketAddr = addr
            .parse()
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let conn = TcpStream::connect_timeout(&addr, IO_TIMEOUT)?;
        conn.set_read_timeout(Some(IO_TIMEOUT))?;
        conn.set_write_timeout(Some(IO_TIMEOUT))?;
        (&conn).write_all(format!("W {token} {worker}\n").as_bytes())?;
        let mut reply = String::new();
        BufReader::new(&conn).read_line(&mut reply)?;
        Ok(reply)
    };
    match attempt().as_deref().map(str::trim) {
        Ok("OK") => WriteOutcome::Accepted,
        Ok("STALE") => WriteOutcome::Rejected,
        _ => WriteOutcome::Failed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fenced_store_refuses_older_tokens_over_tcp() {
        let store = Store::start(true).expect("store");
        let addr = store.addr().to_string();
        assert_eq!(write(&addr, 5, 1), WriteOutcome::Accepted);
        assert_eq!(
            write(&addr, 5, 1),
            WriteOutcome::Accepted,
            "same holder again"
        );
        assert_eq!(write(&addr, 9, 2), WriteOutcome::Accepted);
        assert_eq!(write(&addr, 7, 1), WriteOutcome::Rejected);
        assert_eq!(
            store.stats(),
            StoreStats {
                accepted: 3,
                stale_accepted: 0,
                stale_rejected: 1
            }
        );
    }

    #[test]
    fn unfenced_store_accepts_and_counts_stale_writes() {
        let store = Store::start(false).expect("store");
        let addr = store.addr().to_string();
        assert_eq!(write(&addr, 9, 2), WriteOutcome::Accepted);
        assert_eq!(write(&addr, 7, 1), WriteOutcome::Accepted);
        assert_eq!(store.stats().stale_accepted, 1);
        assert_eq!(write("127.0.0.1:1", 1, 1), WriteOutcome::Failed);
    }
}
