//! [`SharedDeadline`]: the moment a session (or an entry's lease) stops being trusted,
//! moved by the one task that keeps it alive and read by everyone else without a lock.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// A deadline one task moves (the keep-alive, the heartbeat) and any code reads; once
/// seen passed, it stays passed.
///
/// Why it is shared and not only the keeping task's: that task declares the loss when
/// it runs, and a starved runtime (every worker blocked in synchronous code, or a
/// current-thread runtime busy elsewhere) may not run it for a long while after the
/// deadline passed. Code that asks synchronously whether a hold is lost
/// ([`crate::Backend::lost_now`]: a grant, `is_lost`, a re-entry) compares the clock
/// with this instead of trusting a verdict that is late.
///
/// Why it latches: a renewal sent before the deadline can be answered after it, and a
/// keeping task that took that answer would move the deadline on, so a reader that had
/// already been told "lost" would later be told "held". The first look (by a reader or
/// by [`SharedDeadline::extend`]) at or past the deadline marks it lapsed for good, and
/// the keeping task then declares the loss instead of extending.
///
/// Instants are the caller's: pass the same clock to every method (the adapters use
/// tokio's `Instant::into_std`, so that a test on paused time reads the runtime's
/// clock; a reader outside that runtime, say a guard dropped on a plain thread, reads
/// the real clock against it).
#[derive(Debug)]
pub struct SharedDeadline {
    /// Every deadline is stored as its distance from here; none is earlier.
    base: Instant,
    /// Nanoseconds after `base`; [`UNSET`] or [`LAPSED`] otherwise.
    after: AtomicU64,
}

/// No deadline yet: never passed.
const UNSET: u64 = u64::MAX;
/// Seen passed: passed for good.
const LAPSED: u64 = u64::MAX - 1;

impl SharedDeadline {
    /// No deadline yet (never passed); deadlines set later must not be before `base`
    /// (an earlier one counts as `base`).
    pub fn unset(base: Instant) -> Self {
        SharedDeadline {
            base,
            after: AtomicU64::new(UNSET),
        }
    }

    fn nanos(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.base).as_nanos())
            .unwrap_or(LAPSED - 1)
            .min(LAPSED - 1)
    }

    /// Whether `now` is at or past the current deadline (never while none is set); if
    /// it is, the deadline lapses for good.
    pub fn passed(&self, now: Instant) -> bool {
        let now = self.nanos(now);
        let mut cur = self.after.load(Ordering::Acquire);
        loop {
            match cur {
                LAPSED => return true,
                UNSET => return false,
                d if now < d => return false,
                d => match self.after.compare_exchange(
                    d,
                    LAPSED,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => return true,
                    Err(seen) => cur = seen,
                },
            }
        }
    }

    /// Moves the deadline to `at` (a renewal was acknowledged at `now`), unless it has
    /// lapsed or `now` is at or past it: false then, and the keeping task must declare
    /// the session lost.
    pub fn extend(&self, at: Instant, now: Instant) -> bool {
        let (at, now) = (self.nanos(at), self.nanos(now));
        let mut cur = self.after.load(Ordering::Acquire);
        loop {
            let next = match cur {
                LAPSED => return false,
                d if d != UNSET && now >= d => LAPSED,
                _ => at,
            };
            match self
                .after
                .compare_exchange(cur, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return next != LAPSED,
                Err(seen) => cur = seen,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn passes_at_the_deadline_and_stays_passed() {
        let base = Instant::now();
        let s = Duration::from_secs;
        let d = SharedDeadline::unset(base);
        assert!(!d.passed(base + s(1_000_000)), "unset never passes");
        assert!(d.extend(base + s(10), base));
        assert!(!d.passed(base + s(9)));
        // Moved on by a renewal acknowledged in time.
        assert!(d.extend(base + s(20), base + s(9)));
        assert!(!d.passed(base + s(15)));
        // Seen passed once: passed for good, and no later renewal moves it.
        assert!(d.passed(base + s(20)));
        assert!(d.passed(base + s(1)));
        assert!(!d.extend(base + s(40), base + s(1)));
        assert!(d.passed(base + s(1)));
    }

    #[test]
    fn a_renewal_answered_after_the_deadline_lapses_it() {
        let base = Instant::now();
        let s = Duration::from_secs;
        let d = SharedDeadline::unset(base);
        assert!(d.extend(base + s(10), base));
        // Nobody looked in between; the keeping task itself runs late.
        assert!(!d.extend(base + s(30), base + s(11)));
        assert!(d.passed(base + s(12)));
    }
}
