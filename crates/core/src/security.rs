//! What a backend needs to reach a secured server: TLS settings and credentials.
//!
//! These are plain data; no file is read and no connection made here. An adapter turns
//! them into its client's TLS and auth options (reading the PEM files then) and maps a
//! refusal to [`crate::Error::Unauthenticated`], [`crate::Error::PermissionDenied`] or
//! [`crate::Error::Tls`].
//!
//! The design decision: a password is a [`Secret`], whose `Debug` and `Display` print
//! `***`, so no log line, error or `{:?}` of options can show it by accident; the only
//! way to the text is [`Secret::expose`], called where the client takes it.

use std::fmt;
use std::path::PathBuf;

/// A password or other secret: printed as `***` by `Debug` and `Display`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps `value`.
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The secret's text, for the one call that hands it to a client.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Self {
        Secret(value)
    }
}

impl From<&str> for Secret {
    fn from(value: &str) -> Self {
        Secret(value.to_owned())
    }
}

/// Who the client says it is: a user and a password.
///
/// Each backend reads them its own way: Redis `AUTH [user] password` (no user: the
/// `default` user, as `requirepass` wants), etcd's user/password authentication (its
/// token refreshed as needed), ZooKeeper `digest` authentication as `user:password`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Credentials {
    /// The user name; `None` is Redis' `default` user (a password-only `AUTH`).
    pub user: Option<String>,
    /// The password.
    pub password: Secret,
}

impl Credentials {
    /// A user and its password.
    pub fn new(user: impl Into<String>, password: impl Into<Secret>) -> Self {
        Credentials {
            user: Some(user.into()),
            password: password.into(),
        }
    }

    /// A password without a user (Redis `requirepass`).
    pub fn password_only(password: impl Into<Secret>) -> Self {
        Credentials {
            user: None,
            password: password.into(),
        }
    }
}

/// TLS to the servers. An empty value still means TLS, verified against the system's
/// root certificates.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TlsOptions {
    /// A PEM bundle of CA certificates to trust instead of the system roots.
    pub ca: Option<PathBuf>,
    /// A PEM client certificate (chain) for mutual TLS; needs [`TlsOptions::key`].
    pub cert: Option<PathBuf>,
    /// The PEM private key of [`TlsOptions::cert`].
    pub key: Option<PathBuf>,
    /// The name to verify the server's certificate against, when it is not the host the
    /// client connects to.
    pub server_name: Option<String>,
}

impl TlsOptions {
    /// TLS verified against the system roots, no client certificate.
    pub fn new() -> Self {
        TlsOptions::default()
    }

    /// Trusts the CA certificates in the PEM file at `path` instead of the system roots.
    pub fn with_ca(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca = Some(path.into());
        self
    }

    /// Presents the client certificate and key in the PEM files at `cert` and `key`.
    pub fn with_client_cert(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.cert = Some(cert.into());
        self.key = Some(key.into());
        self
    }

    /// Verifies the server's certificate against `name` instead of the host.
    pub fn with_server_name(mut self, name: impl Into<String>) -> Self {
        self.server_name = Some(name.into());
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_never_print() {
        let c = Credentials::new("app", "hunter2");
        assert_eq!(c.password.expose(), "hunter2");
        let shown = format!("{c:?} {} {:?}", c.password, c.password);
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("***"), "{shown}");
    }
}
