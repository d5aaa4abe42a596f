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
//!
//! Job control needs the same care. Left alone, Ctrl-Z (SIGTSTP) stops dlock but not the
//! command, which is not in the terminal's foreground group: dlock stops renewing its
//! session while the command runs on, and once the session ends another holder starts
//! beside it. So dlock takes SIGTSTP and SIGTTIN too ([`is_stop`]): while it waits it
//! simply stops itself ([`stop_self`]), as the default action would; while the command
//! runs it first stops the command's group, and once continued it lets the group go on
//! only if the hold was not lost meanwhile ([`crate::child`]). A SIGCONT that came after
//! the stop, before dlock acted on it, cancels it ([`stop_cancelled`]). SIGTTOU, which a terminal
//! with `tostop` sends to a background process that writes to it, is ignored: a handler
//! would make the write restart and raise it again without end, and dlock's few lines on
//! stderr are no reason to stop renewing. The command gets SIGTTOU back as dlock got it
//! ([`restore_in_child`]). A signal dlock was started with ignored stays ignored.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::Poll;

use tokio::signal::unix::{signal, Signal, SignalKind};

/// The four signals and the two job-control stops, each as a stream; the process no
/// longer dies of (or stops on) them once this exists (tokio keeps its handlers for the
/// life of the process).
pub(crate) struct Signals {
    streams: Vec<(libc::c_int, Signal)>,
}

impl Signals {
    /// Takes SIGTERM, SIGINT, SIGHUP and SIGQUIT, and SIGTSTP and SIGTTIN ([`is_stop`]),
    /// and ignores SIGTTOU. A signal whose handler cannot be installed is reported at
    /// debug level and keeps its default action (a stop's arrival is recorded through the
    /// same registry as tokio's handler, by [`record_order`], so a stop it could record is
    /// one tokio can take).
    pub(crate) fn install() -> Signals {
        ignore_ttou();
        // Before tokio's handlers, so that a stop's arrival is on record by the time its
        // stream yields it (the registry runs a signal's actions in registration order).
        record_order(
            &[libc::SIGTSTP, libc::SIGTTIN]
                .into_iter()
                .filter(|n| !inherited_ignored(*n))
                .collect::<Vec<_>>(),
        );
        let kinds = [
            (libc::SIGTERM, SignalKind::terminate()),
            (libc::SIGINT, SignalKind::interrupt()),
            (libc::SIGHUP, SignalKind::hangup()),
            (libc::SIGQUIT, SignalKind::quit()),
            (libc::SIGTSTP, SignalKind::from_raw(libc::SIGTSTP)),
            (libc::SIGTTIN, SignalKind::from_raw(libc::SIGTTIN)),
        ];
        let streams = kinds
            .into_iter()
            // A signal dlock was started with ignored (a script's background job gets
            // SIGINT and SIGQUIT so) stays ignored, as the one who started it meant: a
            // handler would take it, and exec would give it to the command at its default.
            .filter(|(n, _)| !inherited_ignored(*n))
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

    /// The next of the six signals to arrive (its number); pending forever if none does.
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

    /// Runs `wait` until it ends or one of the four ending signals arrives; on one,
    /// `wait` is dropped (an acquire's entry is then removed: the recipes' cancellation
    /// safety) and the signal's number returned. A job-control stop ([`is_stop`]) stops
    /// dlock where it is, as the default action would have, and the wait goes on once
    /// it is continued: nothing runs under a lock yet, so there is nothing to stop first.
    pub(crate) async fn or_signal<T>(
        &mut self,
        wait: impl Future<Output = T>,
    ) -> Result<T, libc::c_int> {
        tokio::pin!(wait);
        loop {
            tokio::select! {
                v = &mut wait => return Ok(v),
                n = self.recv() => {
                    if is_stop(n) {
                        // Returns at once if a SIGCONT cancelled the stop.
                        stop_self(n);
                    } else {
                        return Err(n);
                    }
                }
            }
        }
    }
}

/// True for the job-control stops dlock takes (SIGTSTP: Ctrl-Z or `kill -TSTP`;
/// SIGTTIN): their default action would stop dlock alone, leaving the command running
/// while nothing renews the session.
pub(crate) fn is_stop(n: libc::c_int) -> bool {
    n == libc::SIGTSTP || n == libc::SIGTTIN
}

/// Stops dlock as the job-control stop `n` (SIGTSTP or SIGTTIN) would have by its default
/// action, and returns once it is continued: the shell sees the job stopped, and `fg`
/// or `bg` (SIGCONT) continues it. The kernel decides, as it would have without dlock's
/// handler: `n` is raised on this thread with its default action for the moment, which
/// stops every thread of the process, unless dlock's process group is orphaned (nobody
/// could continue it), where the kernel discards the stop and this returns at once.
///
/// A SIGCONT that came after the stop cancels it, as the kernel discards a pending stop
/// when SIGCONT is sent: this then returns without stopping ([`stop_cancelled`], asked
/// once more just before the raise). A SIGCONT in the few instructions between that look
/// and the raise is missed (dlock then stays stopped until the next SIGCONT), and so is
/// one whose order [`stop_cancelled`] gets wrong.
#[allow(unsafe_code)]
pub(crate) fn stop_self(n: libc::c_int) {
    // SAFETY: sigaction(2) and raise(3) with plain values and a zeroed `sigaction` that is
    // filled in before use; the disposition dlock's handler had is put back unchanged.
    // raise(3) delivers `n` to this thread before it returns (it is not blocked here), so
    // the default action has run, or been discarded, when the handler comes back.
    unsafe {
        let mut saved: libc::sigaction = std::mem::zeroed();
        let mut default: libc::sigaction = std::mem::zeroed();
        default.sa_sigaction = libc::SIG_DFL;
        if libc::sigaction(n, &default, &mut saved) != 0 {
            return;
        }
        if !stop_cancelled() {
            libc::raise(n);
        }
        libc::sigaction(n, &saved, std::ptr::null_mut());
    }
}

/// Counts the arrivals of the job-control stops and of SIGCONT, in the order the
/// handlers ran; [`LAST_STOP`] and [`LAST_CONT`] hold the count at the latest of each.
static ARRIVALS: AtomicU64 = AtomicU64::new(0);
/// [`ARRIVALS`] at the latest SIGTSTP or SIGTTIN dlock's handler took (0: none yet).
static LAST_STOP: AtomicU64 = AtomicU64::new(0);
/// [`ARRIVALS`] at the latest SIGCONT (0: none yet).
static LAST_CONT: AtomicU64 = AtomicU64::new(0);
/// Whether the arrivals above are recorded for every stop dlock takes and for SIGCONT;
/// if not, no stop is ever taken as cancelled.
static ORDER_KNOWN: AtomicBool = AtomicBool::new(false);

/// True when a SIGCONT came after the latest job-control stop: the stop is then
/// cancelled, as the kernel cancels a pending stop on SIGCONT (a `kill -TSTP` followed at
/// once by `kill -CONT`, or `fg` right after Ctrl-Z, before dlock acted on the stop). The
/// stop's stream only says that a stop came, not when: this order says whether a
/// continue came after it.
///
/// The order is the order in which dlock's handlers ran, which can differ from the order
/// the signals were sent when the two come within a microsecond or two (a handler may be
/// interrupted by the other signal's before it records): a SIGCONT just after a stop may
/// then leave dlock stopped, and a stop just after a SIGCONT may be taken as cancelled.
/// The kernel alone orders them exactly; this narrows the gap from "until dlock's runtime
/// acts on the stop" to that.
pub(crate) fn stop_cancelled() -> bool {
    let yes = cancelled(
        ORDER_KNOWN.load(Ordering::SeqCst),
        LAST_STOP.load(Ordering::SeqCst),
        LAST_CONT.load(Ordering::SeqCst),
    );
    if yes {
        tracing::debug!("a SIGCONT came after the stop: not stopping");
    }
    yes
}

/// The rule of [`stop_cancelled`]: with the order `known`, a stop is cancelled when the
/// latest SIGCONT's arrival (`cont`) is after the latest stop's (`stop`).
fn cancelled(known: bool, stop: u64, cont: u64) -> bool {
    known && cont > stop
}

/// Notes one arrival in `last` (run in a signal handler: lock-free atomics only).
fn arrived(last: &AtomicU64) {
    let n = ARRIVALS.fetch_add(1, Ordering::SeqCst) + 1;
    last.fetch_max(n, Ordering::SeqCst);
}

/// Records the arrival order of `stops` and of SIGCONT beside any other handler, once per
/// process. Recording SIGCONT does not change what it does (the kernel continues a
/// stopped process before any handler runs; exec gives the command the default action),
/// but it now runs a handler: a SIGCONT interrupts a blocking call of whichever thread
/// takes it, which tokio's threads restart.
/// If one of them cannot be recorded, none is, and [`stop_cancelled`] stays false: dlock
/// then stops on every stop, as before. SIGCONT inherited ignored stays so, unrecorded.
#[allow(unsafe_code)]
fn record_order(stops: &[libc::c_int]) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if inherited_ignored(libc::SIGCONT) {
            return;
        }
        let wanted = stops
            .iter()
            .map(|n| (*n, &LAST_STOP))
            .chain([(libc::SIGCONT, &LAST_CONT)]);
        let mut ids = Vec::new();
        for (n, last) in wanted {
            // SAFETY: the action does only lock-free atomic operations on statics, which
            // are async-signal-safe; none of these signals is one the registry forbids.
            match unsafe { signal_hook_registry::register(n, move || arrived(last)) } {
                Ok(id) => ids.push(id),
                Err(e) => {
                    tracing::debug!(signal = n, error = %e, "cannot record the signal's arrival");
                    for id in ids {
                        signal_hook_registry::unregister(id);
                    }
                    return;
                }
            }
        }
        ORDER_KNOWN.store(true, Ordering::SeqCst);
    });
}

/// Whether signal `n` was ignored when dlock started (before any handler of its own).
#[allow(unsafe_code)]
fn inherited_ignored(n: libc::c_int) -> bool {
    // SAFETY: sigaction(2) with a null new action only reads the disposition into a
    // zeroed struct.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        libc::sigaction(n, std::ptr::null(), &mut old) == 0 && old.sa_sigaction == libc::SIG_IGN
    }
}

/// SIGTTOU's disposition as dlock got it from its parent (a `sighandler_t`), which the
/// command gets back; `SIG_DFL` until [`ignore_ttou`] has run.
static TTOU_INHERITED: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(libc::SIG_DFL);

/// Sets SIGTTOU to be ignored (see the module's docs), once per process, keeping the
/// disposition it had for the command. Failing leaves it as it was.
#[allow(unsafe_code)]
fn ignore_ttou() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: signal(2) with SIG_IGN installs no handler code; nothing else in dlock
        // sets a disposition for SIGTTOU.
        let old = unsafe { libc::signal(libc::SIGTTOU, libc::SIG_IGN) };
        if old != libc::SIG_ERR {
            TTOU_INHERITED.store(old, std::sync::atomic::Ordering::Relaxed);
        }
    });
}

/// Gives the command SIGTTOU back as dlock inherited it (an ignored signal stays ignored
/// across exec; the caught ones are reset by exec itself). Called in the forked child
/// before exec, so it only reads an atomic and makes an async-signal-safe call.
#[allow(unsafe_code)]
pub(crate) fn restore_in_child() -> std::io::Result<()> {
    let inherited = TTOU_INHERITED.load(std::sync::atomic::Ordering::Relaxed);
    // SAFETY: signal(2) is async-signal-safe and touches only this (child) process; the
    // disposition is SIG_DFL or SIG_IGN (dlock installs no SIGTTOU handler of its own
    // before it stores one, so no handler address of the parent reaches the child).
    unsafe {
        libc::signal(libc::SIGTTOU, inherited);
    }
    Ok(())
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
        libc::SIGTSTP => "SIGTSTP",
        libc::SIGTTIN => "SIGTTIN",
        _ => "a signal",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rule alone (the statics are shared with the tests that install the handlers):
    /// a stop is cancelled only by a SIGCONT after it, and only with the order recorded.
    #[test]
    fn a_stop_is_cancelled_only_by_a_later_continue() {
        assert!(
            !cancelled(false, 1, 2),
            "an order not recorded cancels nothing"
        );
        assert!(!cancelled(true, 0, 0), "nothing arrived");
        assert!(!cancelled(true, 2, 1), "a SIGCONT before the stop");
        assert!(cancelled(true, 1, 2), "a SIGCONT after the stop");
        assert!(cancelled(true, 0, 1), "a SIGCONT and no stop yet");
    }

    /// Arrivals are numbered in order, each kind keeping its latest.
    #[test]
    fn arrivals_are_numbered_in_order() {
        static STOP: AtomicU64 = AtomicU64::new(0);
        static CONT: AtomicU64 = AtomicU64::new(0);
        arrived(&STOP);
        arrived(&CONT);
        assert!(cancelled(
            true,
            STOP.load(Ordering::SeqCst),
            CONT.load(Ordering::SeqCst)
        ));
        arrived(&STOP);
        assert!(!cancelled(
            true,
            STOP.load(Ordering::SeqCst),
            CONT.load(Ordering::SeqCst)
        ));
    }
}
