//! What the recipes report through the [`metrics`] facade: no exporter here, the
//! application installs one (Prometheus, StatsD, ...) and these appear in it. Without a
//! recorder every call is a no-op.
//!
//! | name | type | labels | what |
//! |---|---|---|---|
//! | `dlock_acquires_total` | counter | `backend`, `kind`, `outcome` | acquire attempts by how they ended: `granted`, `timeout`, `would_block`, `lost`, `error` |
//! | `dlock_acquire_wait_seconds` | histogram | `backend`, `kind`, `outcome` | time from the call to its end (the grant, or the failure) |
//! | `dlock_hold_seconds` | histogram | `backend`, `kind` | time from the grant to the release of a hold (its last guard) |
//! | `dlock_holds_lost_total` | counter | `backend`, `kind` | holds whose lost signal had fired when they ended |
//! | `dlock_errors_total` | counter | `backend`, `kind`, `error` | failed acquires by error ([`Error::label`]) |
//!
//! `backend` is the backend's label (`zk`, `etcd`, `redis`, `redlock`, `mem`); `kind` is
//! what was asked for: `lock` (a mutex or semaphore-mutex), `read`, `write`, `lease` (a
//! semaphore permit). Lock names are not a label: they are unbounded, and a metrics
//! backend keeps one series per label value.

use std::time::Duration;

use dlock_core::Error;

/// Records one acquire that ended after `waited` with `result`.
pub(crate) fn acquire<T>(
    backend: &'static str,
    kind: &'static str,
    waited: Duration,
    result: &Result<T, Error>,
) {
    let outcome = match result {
        Ok(_) => "granted",
        Err(Error::Timeout(_)) => "timeout",
        Err(Error::WouldBlock) => "would_block",
        Err(e) if e.is_lost() => "lost",
        Err(_) => "error",
    };
    let labels = [("backend", backend), ("kind", kind), ("outcome", outcome)];
    metrics::counter!("dlock_acquires_total", &labels).increment(1);
    metrics::histogram!("dlock_acquire_wait_seconds", &labels).record(waited.as_secs_f64());
    if let Err(e) = result {
        if !matches!(e, Error::Timeout(_) | Error::WouldBlock) {
            let labels = [("backend", backend), ("kind", kind), ("error", e.label())];
            metrics::counter!("dlock_errors_total", &labels).increment(1);
        }
    }
}

/// Records the end of a hold that lasted `held` (its last guard released or dropped).
pub(crate) fn hold_ended(backend: &'static str, kind: &'static str, held: Duration, lost: bool) {
    let labels = [("backend", backend), ("kind", kind)];
    metrics::histogram!("dlock_hold_seconds", &labels).record(held.as_secs_f64());
    if lost {
        metrics::counter!("dlock_holds_lost_total", &labels).increment(1);
    }
}
