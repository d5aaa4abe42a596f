//! The signals dlock answers while it waits for a lock and while the command runs.
//!
//! Left to their default action, SIGHUP (a closed terminal or ssh session), SIGQUIT
//! (Ctrl-\), SIGTERM and SIGINT would kill dlock alone: the command, in a process group of
//! its own, would go on without the lock once the session ended, and a waiter's entry
//! would sit in the queue until then. So `exec`, `multi` and `elect` take these four
//! signals from the start of their wait ([`Signals::install`]): a signal that comes
//! while waiting ends the wait (the entry is removed, nothing runs, exit 128 + N), and one
//! that comes while the command runs is passed on to the command's group (see
//! [`crate::child`]). SIGKILL cannot be caught: see docs/cli.md.

use std::future::Future;
use std::task::Poll;

use tokio::signal::unix::{signal, Signal, SignalKind};

/// The four signals, each as a stream; the process no longer dies of them once this
/// exists (tokio keeps its handlers for the life of the process).
pub(crate) struct Signals {
    streams: Vec<(libc::c_int, Signal)>,
}

impl Signals {
    /// Takes SIGTERM, SIGINT, SIGHUP and SIGQUIT. A signal whose handler cannot be
    /// installed keeps its default action (reported at debug level): dlock then behaves
    /// for it as it did without this.
    pub(crate) fn install() -> Signals {
        let kinds = [
            (libc::SIGTERM, SignalKind::terminate()),
            (libc::SIGINT, SignalKind::interrupt()),
            (libc::SIGHUP, SignalKind::hangup()),
            (libc::SIGQUIT, SignalKind::quit()),
        ];
        let streams = kinds
            .into_iter()
            .filter_map(|(n, k)| match signal(k) {
                Ok(s) => Some((n, s)),
                Err(e) => {
                    tracing::debug!(signal = n, error = %e, "cannot take the signal");
                    None
                }
            })
            .collect();
        Signals { streams }
    }

    /// The next of the four signals to arrive (its number); pending forever if none does.
    pub(crate) async fn recv(&mut self) -> libc::c_int {
        std::future::poll_fn(|cx| {
            for (n, s) in &mut self.streams {
                if let Poll::Ready(Some(())) = s.poll_recv(cx) {
                    return Poll::Ready(*n);
                }
            }
            Poll::Pending
        })
        .await
    }

    /// Runs `wait` until it ends or a signal arrives; on a signal `wait` is dropped
    /// (an acquire's entry is then removed: the recipes' cancellation safety) and the
    /// signal's number returned.
    pub(crate) async fn or_signal<T>(
        &mut self,
        wait: impl Future<Output = T>,
    ) -> Result<T, libc::c_int> {
        tokio::select! {
            v = wait => Ok(v),
            n = self.recv() => Err(n),
        }
    }
}

/// The exit code of a wait ended by signal `n`: 128 + n, as a shell reports a process
/// killed by it.
pub(crate) fn interrupted_code(n: libc::c_int) -> u8 {
    u8::try_from(128 + n).unwrap_or(1)
}

/// The signal's name for a message (`SIGINT`).
pub(crate) fn name(n: libc::c_int) -> &'static str {
    match n {
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGHUP => "SIGHUP",
        libc::SIGQUIT => "SIGQUIT",
        _ => "a signal",
    }
}
