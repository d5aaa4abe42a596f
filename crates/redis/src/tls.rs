//! TLS and credentials for the Redis clients, from [`SessionOptions`]: a rustls client
//! config built from PEM files (or the system roots), and the `AUTH` user and password.

use std::path::Path;
use std::sync::Arc;

use dlock_core::{Error, SessionOptions, TlsOptions};
use fred::prelude::Config;
use fred::types::config::{TlsConfig, TlsConnector, TlsHostMapping};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

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

fn tls_err(what: &str, path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Tls(format!("{what} {}: {e}", path.display()))
}

fn tls_config(opts: &TlsOptions) -> Result<TlsConfig, Error> {
    let provider = crypto_provider();
    let mut roots = RootCertStore::empty();
    match &opts.ca {
        Some(path) => {
            let certs = CertificateDer::pem_file_iter(path)
                .map_err(|e| tls_err("reading the CA bundle", path, e))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| tls_err("parsing the CA bundle", path, e))?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(tls_err(
                    "reading the CA bundle",
                    path,
                    "no CA certificate in it",
                ));
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(native.certs);
            if roots.is_empty() {
                return Err(Error::Tls(
                    "no system root certificates found; give the CA with ?ca=PATH".into(),
                ));
            }
        }
    }
    let verifier = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| Error::Tls(format!("building the certificate verifier: {e}")))?;
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Tls(e.to_string()))?;
    let builder = match &opts.server_name {
        Some(name) => {
            let name = ServerName::try_from(name.clone())
                .map_err(|e| Error::Tls(format!("server_name {name:?}: {e}")))?;
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(FixedName {
                    inner: verifier,
                    name,
                }))
        }
        None => builder.with_webpki_verifier(verifier),
    };
    let config = match (&opts.cert, &opts.key) {
        (Some(cert), Some(key)) => {
            let chain = CertificateDer::pem_file_iter(cert)
                .map_err(|e| tls_err("reading the client certificate", cert, e))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| tls_err("parsing the client certificate", cert, e))?;
            let key_der = PrivateKeyDer::from_pem_file(key)
                .map_err(|e| tls_err("reading the client key", key, e))?;
            builder
                .with_client_auth_cert(chain, key_der)
                .map_err(|e| Error::Tls(format!("the client certificate and key: {e}")))?
        }
        _ => builder.with_no_client_auth(),
    };
    Ok(TlsConfig {
        connector: TlsConnector::from(config),
        hostnames: TlsHostMapping::None,
    })
}

/// Verifies the server's certificate against a configured name instead of the host the
/// client dialled (`?server_name=`); everything else is the WebPKI verifier's.
#[derive(Debug)]
struct FixedName {
    inner: Arc<WebPkiServerVerifier>,
    name: ServerName<'static>,
}

impl ServerCertVerifier for FixedName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _dialled: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.inner
            .verify_server_cert(end_entity, intermediates, &self.name, ocsp, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
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
