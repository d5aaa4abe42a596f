//! TLS and credentials for the Redis clients, from [`SessionOptions`]: the rustls client
//! config (built by `dlock_core::tls_client` from the PEM files, or the system roots
//! `rustls-native-certs` finds), and the `AUTH` user and password.

use std::sync::Arc;

use dlock_core::{Error, SessionOptions, TlsOptions};
use fred::prelude::Config;
use fred::types::config::{TlsConfig, TlsConnector, TlsHostMapping};

/// How every client of one backend reaches its servers: TLS, user and password.
///
/// `Debug` never shows the password.
#[derive(Clone, Default)]
pub(crate) struct Access {
    tls: Option<TlsConfig>,
    username: Option<String>,
    password: Option<String>,
}

impl std::fmt::Debug for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Access")
            .field("tls", &self.tls.is_some())
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .finish()
    }
}

impl Access {
    /// Reads the TLS files of `opts` and takes its credentials.
    ///
    /// # Errors
    /// [`Error::Tls`] for a CA, certificate or key that cannot be read or parsed.
    pub fn new(opts: &SessionOptions) -> Result<Access, Error> {
        let tls = opts.tls.as_ref().map(tls_config).transpose()?;
        let (username, password) = match &opts.credentials {
            Some(c) => (c.user.clone(), Some(c.password.expose().to_owned())),
            None => (None, None),
        };
        Ok(Access {
            tls,
            username,
            password,
        })
    }

    /// Sets TLS and credentials on a client's config.
    pub fn apply(&self, config: &mut Config) {
        config.tls = self.tls.clone();
        config.username = self.username.clone();
        config.password = self.password.clone();
    }
}

/// Installs aws-lc-rs as the process's rustls provider unless one is installed: a crate
/// that builds its config with `ClientConfig::builder()` (zookeeper-client does) needs a
/// process default once more than one provider is compiled in.
pub(crate) fn crypto_provider() -> Arc<rustls::crypto::CryptoProvider> {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    rustls::crypto::CryptoProvider::get_default()
        .cloned()
        .unwrap_or_else(|| Arc::new(rustls::crypto::aws_lc_rs::default_provider()))
}

fn tls_config(opts: &TlsOptions) -> Result<TlsConfig, Error> {
    let config = dlock_core::tls_client::client_config(
        opts,
        crypto_provider(),
        |p| std::fs::read(p),
        || rustls_native_certs::load_native_certs().certs,
    )?;
    Ok(TlsConfig {
        connector: TlsConnector::from(config),
        hostnames: TlsHostMapping::None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unreadable_tls_files_are_typed_errors() {
        let opts = SessionOptions::default()
            .with_tls(TlsOptions::new().with_ca("/nonexistent/dlock-ca.pem"));
        match Access::new(&opts) {
            Err(Error::Tls(m)) => assert!(m.contains("/nonexistent/dlock-ca.pem"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn access_debug_hides_the_password() {
        let opts = SessionOptions::default()
            .with_credentials(dlock_core::Credentials::new("app", "hunter2"));
        let shown = format!("{:?}", Access::new(&opts).expect("no files to read"));
        assert!(!shown.contains("hunter2"), "{shown}");
    }
}
