//! The one error type every dlock layer speaks.
//!
//! Adapters map their client's errors into [`Error`] at their boundary, so a caller can
//! always tell "the lock is gone" ([`Error::LockLost`]) from "the server is unreachable"
//! ([`Error::Unreachable`]) from "you asked for something invalid".

use std::time::Duration;

/// A boxed error from a backend client, kept as the source of [`Error::Backend`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a lock name was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NameError {
    /// The name is empty (or only slashes).
    #[error("lock name is empty")]
    Empty,
    /// The name contains a NUL or another control character.
    #[error("lock name contains a control character at byte {0}")]
    ControlChar(usize),
    /// A path segment is empty (`a//b`), `.` or `..`.
    #[error("lock name has an empty, `.` or `..` segment")]
    BadSegment,
    /// A path segment after the first has the form of a queue entry's name
    /// (`lock-0000000001`, `release-42`): the lock named by the path above it would list
    /// it among its own entries (on ZooKeeper the sub-lock's node is a child of that
    /// lock's node), a phantom entry that nobody removes.
    #[error("lock name segment `{0}` has the form of a queue entry's name, which the lock above it would take for one of its entries")]
    EntryLike(String),
    /// The name starts with a segment the backend reserves (ZooKeeper's `/zookeeper`).
    #[error("lock name uses the reserved prefix `{0}`")]
    Reserved(&'static str),
    /// The name is longer than the backend allows.
    #[error("lock name is {len} bytes, longer than the {max} the backend allows")]
    TooLong {
        /// Length of the name in bytes.
        len: usize,
        /// The backend's limit in bytes.
        max: usize,
    },
    /// The name contains a character the backend cannot store in a key.
    #[error("lock name contains the character {0:?}, which this backend does not allow")]
    BadChar(char),
}

/// Everything that can go wrong taking, holding or releasing a dlock lock.
///
/// The enum is `#[non_exhaustive]` and has the same variants under every feature, so a
/// `match` in one crate cannot be broken by another crate turning a feature on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The lock could not be acquired within the given time. Nothing is left behind: the
    /// waiter's entry has been removed (or is being removed in the background).
    #[error("timed out after {0:?} waiting for the lock")]
    Timeout(Duration),
    /// `try_lock` found the lock held by someone else. The attempt's entry was removed.
    #[error("the lock is held by someone else")]
    WouldBlock,
    /// The session (ZooKeeper session, etcd lease, Redis watchdog lease) that kept the entry
    /// alive is gone: the lock may now be held by someone else.
    #[error("lock lost: {0}")]
    LockLost(String),
    /// Release (or another holder-only operation) was called on something not held.
    #[error("lock not held: {0}")]
    NotHeld(String),
    /// The lock name is not valid for this backend.
    #[error("invalid lock name {name:?}: {reason}")]
    InvalidName {
        /// The name as given.
        name: String,
        /// What is wrong with it.
        #[source]
        reason: NameError,
    },
    /// The backend URL could not be understood.
    #[error("invalid URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A permit count of zero, or more permits than the semaphore has.
    #[error("invalid permits: {0}")]
    InvalidPermits(String),
    /// A request that could only deadlock: re-acquiring a non-reentrant lock from its
    /// owner, upgrading a read lock to a write lock, a multi-lock naming a lock twice.
    #[error("would deadlock: {0}")]
    WouldDeadlock(String),
    /// No server of the backend could be reached within the connection timeout.
    #[error("backend unreachable: {0}")]
    Unreachable(String),
    /// The backend answered with an error dlock does not map to a more specific variant.
    #[error("backend error: {context}")]
    Backend {
        /// What dlock was doing.
        context: String,
        /// The client's error.
        #[source]
        source: BoxError,
    },
    /// The backend does not have an ability the operation needs (revocation, a shared
    /// value: see [`crate::Capability`]). Checked before anything is written, so nothing
    /// is left behind.
    #[error("the {backend} backend does not support {capability}")]
    Unsupported {
        /// The backend's label ([`crate::Backend::kind`]).
        backend: &'static str,
        /// What it lacks.
        capability: crate::backend::Capability,
    },
    /// The client was closed (or its runtime shut down) while the operation was running.
    #[error("client closed")]
    Closed,
    /// The server refused the credentials: a wrong or missing password, an unknown user.
    /// The message never contains the password.
    #[error("authentication failed: {0}")]
    Unauthenticated(String),
    /// The server knows who the client is but does not allow the operation (a Redis ACL
    /// without dlock's keys, an etcd role without the lock's prefix, a ZooKeeper node
    /// whose ACL leaves this identity out). Nothing is left behind.
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    /// TLS could not be set up: a CA, certificate or key that cannot be read or parsed,
    /// or a server certificate that fails verification.
    #[error("TLS: {0}")]
    Tls(String),
}

impl Error {
    /// Wraps a client error with what dlock was doing when it happened.
    pub fn backend(context: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Error::Backend {
            context: context.into(),
            source: source.into(),
        }
    }

    /// A short, stable name of the variant (`timeout`, `lock_lost`, `unreachable`, ...):
    /// a metrics label or a log field that does not carry the message.
    pub fn label(&self) -> &'static str {
        match self {
            Error::Timeout(_) => "timeout",
            Error::WouldBlock => "would_block",
            Error::LockLost(_) => "lock_lost",
            Error::NotHeld(_) => "not_held",
            Error::InvalidName { .. } => "invalid_name",
            Error::InvalidUrl { .. } => "invalid_url",
            Error::InvalidPermits(_) => "invalid_permits",
            Error::WouldDeadlock(_) => "would_deadlock",
            Error::Unreachable(_) => "unreachable",
            Error::Backend { .. } => "backend",
            Error::Unsupported { .. } => "unsupported",
            Error::Closed => "closed",
            Error::Unauthenticated(_) => "unauthenticated",
            Error::PermissionDenied(_) => "permission_denied",
            Error::Tls(_) => "tls",
        }
    }

    /// True for a refusal by the server's security: credentials ([`Error::Unauthenticated`]),
    /// permissions ([`Error::PermissionDenied`]) or TLS ([`Error::Tls`]). Retrying, or
    /// another server of the same deployment, does not change the answer.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            Error::Unauthenticated(_) | Error::PermissionDenied(_) | Error::Tls(_)
        )
    }

    /// True for errors after which the lock must be considered gone.
    pub fn is_lost(&self) -> bool {
        matches!(self, Error::LockLost(_) | Error::Closed)
    }
}

/// `e` and each of its sources, joined by `: `: where a client crate buries the cause
/// (a failed TLS handshake under a transport error) that an adapter has to read.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// The result type of every fallible dlock operation.
pub type Result<T, E = Error> = std::result::Result<T, E>;

const _: () = {
    const fn assert_send_sync<T: Send + Sync + 'static>() {}
    assert_send_sync::<Error>();
};
