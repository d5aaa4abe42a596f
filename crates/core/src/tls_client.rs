//! The rustls client config of a [`TlsOptions`], built in this one place for every
//! adapter that needs one: Redis hands it to fred; ZooKeeper and etcd make TLS exchanges
//! of their own with it (four-letter words, the handshake diagnosis after a connect that
//! got no session).
//!
//! Behind the `rustls` feature. The core stays sans-I/O: rustls builds a config without
//! any I/O, and the PEM files and the system's roots come from the caller (`read`,
//! `system_roots`), which is where a file is read. The crypto provider is the caller's
//! too, so this module picks none.

use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

use crate::{Error, TlsOptions};

/// Builds the rustls client config `tls` asks for: trusting the CA bundle `tls.ca` (or
/// `system_roots()` without one), verifying the server's certificate against
/// `tls.server_name` when given (else the host the client dials), and presenting the
/// client certificate `tls.cert` with `tls.key` when both are given. `read` reads a file
/// (`std::fs::read`).
///
/// # Errors
/// [`Error::Tls`] naming the file for a CA bundle, certificate or key that cannot be read
/// or parsed, a CA bundle without a certificate, no system roots, an invalid
/// `server_name`, or a certificate that does not go with its key.
pub fn client_config(
    tls: &TlsOptions,
    provider: Arc<CryptoProvider>,
    mut read: impl FnMut(&Path) -> std::io::Result<Vec<u8>>,
    system_roots: impl FnOnce() -> Vec<CertificateDer<'static>>,
) -> Result<ClientConfig, Error> {
    let mut file = |what: &str, path: &Path| {
        read(path).map_err(|e| tls_err(&format!("reading {what}"), path, e))
    };
    let mut roots = RootCertStore::empty();
    match &tls.ca {
        Some(path) => {
            let pem = file("the CA bundle", path)?;
            let certs = CertificateDer::pem_slice_iter(&pem)
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
            roots.add_parsable_certificates(system_roots());
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
    let builder = match &tls.server_name {
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
    match (&tls.cert, &tls.key) {
        (Some(cert), Some(key)) => {
            let chain = CertificateDer::pem_slice_iter(&file("the client certificate", cert)?)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| tls_err("parsing the client certificate", cert, e))?;
            let key_der = PrivateKeyDer::from_pem_slice(&file("the client key", key)?)
                .map_err(|e| tls_err("parsing the client key", key, e))?;
            builder
                .with_client_auth_cert(chain, key_der)
                .map_err(|e| Error::Tls(format!("the client certificate and key: {e}")))
        }
        _ => Ok(builder.with_no_client_auth()),
    }
}

fn tls_err(what: &str, path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Tls(format!("{what} {}: {e}", path.display()))
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

    fn provider() -> Arc<CryptoProvider> {
        Arc::new(rustls::crypto::aws_lc_rs::default_provider())
    }

    #[test]
    fn an_unreadable_ca_is_a_tls_error_naming_the_file() {
        let tls = TlsOptions::new().with_ca("/nonexistent/ca.pem");
        let e = client_config(&tls, provider(), |p| std::fs::read(p), Vec::new);
        assert!(
            matches!(&e, Err(Error::Tls(m)) if m.contains("reading the CA bundle /nonexistent/ca.pem")),
            "{e:?}"
        );
    }

    #[test]
    fn a_ca_bundle_without_a_certificate_is_refused() {
        let tls = TlsOptions::new().with_ca("ca.pem");
        let e = client_config(&tls, provider(), |_| Ok(b"not pem".to_vec()), Vec::new);
        assert!(
            matches!(&e, Err(Error::Tls(m)) if m.contains("no CA certificate")),
            "{e:?}"
        );
    }

    #[test]
    fn no_system_roots_is_refused() {
        let e = client_config(
            &TlsOptions::new(),
            provider(),
            |p| std::fs::read(p),
            Vec::new,
        );
        assert!(
            matches!(&e, Err(Error::Tls(m)) if m.contains("no system root")),
            "{e:?}"
        );
    }
}
