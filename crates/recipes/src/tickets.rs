//! Where a client's tickets come from: the one place the recipes draw randomness.

use std::fmt;
use std::sync::Arc;

use dlock_core::Ticket;

/// Draws the 16 random bytes of every new [`Ticket`] a [`crate::Client`] queues with.
/// [`crate::Client::new`] uses the operating system's generator; a simulation or a test
/// seeds its own ([`TicketSource::from_fn`]) so that one seed makes the same entry names
/// on every run.
///
/// Tickets must not repeat within a lock: two contenders with one ticket would share one
/// entry. A source that is not random must make distinct bytes on every call.
#[derive(Clone)]
pub struct TicketSource(Arc<dyn Fn() -> [u8; 16] + Send + Sync>);

impl TicketSource {
    /// A cryptographically secure generator seeded (and reseeded) from the operating
    /// system's, as Curator draws its uuids from `SecureRandom`: `rand`'s thread-local
    /// generator, which spares the `getrandom` system call a uuid v4 of its own makes on
    /// every acquire.
    pub fn os() -> Self {
        TicketSource(Arc::new(|| {
            use rand::RngCore as _;
            let mut b = [0u8; 16];
            rand::thread_rng().fill_bytes(&mut b);
            b
        }))
    }

    /// `draw` supplies the bytes of each ticket.
    pub fn from_fn(draw: impl Fn() -> [u8; 16] + Send + Sync + 'static) -> Self {
        TicketSource(Arc::new(draw))
    }

    /// A new ticket.
    pub fn ticket(&self) -> Ticket {
        Ticket::from_random_bytes((self.0)())
    }
}

impl fmt::Debug for TicketSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TicketSource")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn os_tickets_differ_and_a_source_of_fixed_bytes_repeats() {
        let os = TicketSource::os();
        assert_ne!(os.ticket(), os.ticket());
        let fixed = TicketSource::from_fn(|| [3; 16]);
        assert_eq!(fixed.ticket(), fixed.ticket());
    }
}
