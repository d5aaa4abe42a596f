//! [`SharedDeadline`]: the moment a session (or an entry's lease) stops being trusted,
//! moved by the one task that keeps it alive and read by everyone else without a lock.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A deadline one task moves (the keep-alive, the heartbeat) and any code reads.
///
/// Why it is shared and not only the keeping task's: that task declares the loss when
/// it runs, and a starved runtime (every worker blocked in synchronous code, or a
/// current-thread runtime busy elsewhere) may not run it for a long while after the
/// deadline passed. Code that asks synchronously whether a hold is lost
/// ([`crate::Backend::lost_now`]: a grant, `is_lost`, a re-entry) compares the clock
/// with this instead of trusting a verdict that is late.
///
/// Instants are the caller's: pass the same clock to [`SharedDeadline::set`] and
/// [`SharedDeadline::passed`] (tokio's `Instant::into_std`, so paused test time works).
#[derive(Debug)]
pub struct SharedDeadline {
    /// Every deadline is stored as its distance from here; none is earlier.
    base: Instant,
    /// Nanoseconds after `base`; `u64::MAX`: none set (never passes).
    after: AtomicU64,
}

impl SharedDeadline {
    /// No deadline yet (never passed); deadlines set later must not be before `base`
    /// (an earlier one counts as `base`).
    pub fn unset(base: Instant) -> Self {
        SharedDeadline {
            base,
            after: AtomicU64::new(u64::MAX),
        }
    }

    /// The deadline is now `at`.
    pub fn set(&self, at: Instant) {
        let after = u64::try_from(at.saturating_duration_since(self.base).as_nanos())
            .unwrap_or(u64::MAX - 1)
            .min(u64::MAX - 1);
        self.after.store(after, Ordering::Release);
    }

    /// Whether `now` is at or past the deadline (never, while none is set).
    pub fn passed(&self, now: Instant) -> bool {
        let after = self.after.load(Ordering::Acquire);
        after != u64::MAX && now.saturating_duration_since(self.base) >= Duration::from_nanos(after)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_at_the_deadline_set_last_and_never_while_unset() {
        let base = Instant::now();
        let d = SharedDeadline::unset(base);
        assert!(!d.passed(base + Duration::from_secs(1_000_000)));
        d.set(base + Duration::from_secs(10));
        assert!(!d.passed(base + Duration::from_secs(9)));
        assert!(d.passed(base + Duration::from_secs(10)));
        // Moved on by a renewal; moved back too (the keeping task decides).
        d.set(base + Duration::from_secs(20));
        assert!(!d.passed(base + Duration::from_secs(15)));
        d.set(base + Duration::from_secs(5));
        assert!(d.passed(base + Duration::from_secs(6)));
        // A deadline before the base counts as the base.
        d.set(base.checked_sub(Duration::from_secs(1)).unwrap_or(base));
        assert!(d.passed(base));
    }
}
