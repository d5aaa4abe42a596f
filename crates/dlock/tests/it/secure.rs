//! Secured servers (TLS, credentials, access control): refusals are typed, leave nothing
//! on the server, never show a password, and a ZooKeeper outsider cannot break a lock.
//!
//! Each test takes the backend's kind and the URL of the secured variant of its server
//! (`DLOCK_TEST_SECURE_*`: TLS, the `dlock-app` user, its password, the test CA). The
//! URLs of the refused clients are made from it: another password, another user, another
//! CA.

use std::time::Duration;

use dlock::Error;

use crate::support::{client, eventually, leftovers, unique, Kind};

/// `url` with its userinfo replaced by `user:password` (percent-encoded as needed).
pub fn with_credentials(url: &str, user: &str, password: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("scheme");
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let hosts = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let enc = |s: &str| {
        percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
    };
    format!("{scheme}://{}:{}@{hosts}{tail}", enc(user), enc(password))
}

/// `url` with query parameter `key` set to `value` (added or replaced).
pub fn with_param(url: &str, key: &str, value: &str) -> String {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut pairs: Vec<String> = query
        .split('&')
        .filter(|p| !p.is_empty() && p.split('=').next() != Some(key))
        .map(str::to_owned)
        .collect();
    let enc = percent_encoding::utf8_percent_encode(value, percent_encoding::NON_ALPHANUMERIC);
    pairs.push(format!("{key}={enc}"));
    format!("{base}?{}", pairs.join("&"))
}

/// `url` without query parameter `key`.
pub fn without_param(url: &str, key: &str) -> String {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let pairs: Vec<&str> = query
        .split('&')
        .filter(|p| !p.is_empty() && p.split('=').next() != Some(key))
        .collect();
    if pairs.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", pairs.join("&"))
    }
}

/// The test PKI's unrelated CA, found beside the CA `url` trusts.
fn other_ca(url: &str) -> std::path::PathBuf {
    let tls = dlock::BackendUrl::parse(url)
        .expect("parses")
        .tls
        .expect("TLS");
    let ca = tls.ca.expect("the test CA");
    dlock_testkit::secure::Pki::in_dir(ca.parent().expect("the PKI directory")).other_ca
}

/// The user's name and password in `url`.
fn credentials(url: &str) -> (String, String) {
    let c = dlock::BackendUrl::parse(url)
        .expect("secure URL parses")
        .credentials
        .expect("secure URL has credentials");
    (
        c.user.clone().expect("a user"),
        c.password.expose().to_owned(),
    )
}

/// Connects and takes `name`: the first refusal, at connect or at the lock.
async fn refusal(url: &str, name: &str) -> Error {
    let opts = dlock::SessionOptions::default()
        .with_session_timeout(crate::support::SESSION_TIMEOUT)
        .with_connect_timeout(Duration::from_secs(5));
    let c = match dlock::connect_with(url, opts).await {
        Ok(c) => c,
        Err(e) => return e,
    };
    let r = c
        .mutex(name)
        .expect("name")
        .lock_timeout(Duration::from_secs(10))
        .await;
    let _ = c.close().await;
    match r {
        Ok(_) => panic!("a refused client took {name}"),
        Err(e) => e,
    }
}

/// Nothing of `name` is on the server, as the allowed user sees it.
async fn nothing_left(url: &str, name: &str) {
    let c = client(url).await;
    assert!(
        eventually(Duration::from_secs(20), || async {
            leftovers(&c, name).await == 0
        })
        .await,
        "{name} has entries left"
    );
    let _ = c.close().await;
}

/// A wrong password: `Unauthenticated` on Redis and etcd. ZooKeeper's digest scheme
/// cannot refuse a password (a wrong one is another identity), so there the ACL of the
/// chroot the right user made refuses it: `PermissionDenied`. Either way nothing is left,
/// and the password appears in no message.
pub async fn wrong_password_is_refused_and_leaves_nothing(kind: Kind, url: &str) {
    // The allowed user first: on ZooKeeper it creates the chroot with its ACL.
    let app = client(url).await;
    let name = unique("secure-wrong-password");
    let (user, _) = credentials(url);
    let secret = "not-the-password-7d1e";
    let bad = with_credentials(url, &user, secret);
    let e = refusal(&bad, &name).await;
    match kind {
        Kind::Zk => assert!(matches!(e, Error::PermissionDenied(_)), "{e:?}"),
        _ => assert!(matches!(e, Error::Unauthenticated(_)), "{e:?}"),
    }
    let shown = format!("{e} {e:?}");
    assert!(!shown.contains(secret), "the password leaked: {shown}");
    assert_eq!(dlock::exit_code(&e), 77);
    nothing_left(url, &name).await;
    let _ = app.close().await;
}

/// An authenticated user without access to dlock's keys: `PermissionDenied`, nothing
/// left.
pub async fn user_without_permission_is_refused_and_leaves_nothing(_kind: Kind, url: &str) {
    let app = client(url).await;
    let name = unique("secure-no-permission");
    let (user, password) = (
        dlock_testkit::secure::NOBODY_USER,
        dlock_testkit::secure::NOBODY_PASSWORD,
    );
    let nobody = with_credentials(url, user, password);
    // Its connection is fine: the health check needs no permission on any lock.
    if let Ok(c) = dlock::connect(&nobody).await {
        c.health()
            .await
            .expect("a user without lock permissions is still healthy");
        let _ = c.close().await;
    }
    let e = refusal(&nobody, &name).await;
    assert!(matches!(e, Error::PermissionDenied(_)), "{e:?}");
    assert!(!format!("{e} {e:?}").contains(password));
    assert_eq!(dlock::exit_code(&e), 77);
    nothing_left(url, &name).await;
    let _ = app.close().await;
}

/// A server certificate signed by a CA the client does not trust: `Tls`, exit 78.
pub async fn untrusted_server_certificate_is_a_tls_error(_kind: Kind, url: &str) {
    let other_ca = other_ca(url);
    let name = unique("secure-other-ca");
    let e = refusal(
        &with_param(url, "ca", &other_ca.display().to_string()),
        &name,
    )
    .await;
    assert!(matches!(e, Error::Tls(_)), "{e:?}");
    assert_eq!(dlock::exit_code(&e), 78);
    nothing_left(url, &name).await;
}

/// etcd requires a client certificate (`--client-cert-auth`): a client that presents
/// none is refused in the TLS handshake, which is a setting to fix (`Tls`, exit 78), not
/// a server to wait for (`Unreachable`, exit 69), from the library and the CLI alike.
/// (ZooKeeper and Redis in the test cluster only ask for one, so this is etcd's.)
#[cfg(feature = "etcd")]
pub async fn etcd_missing_client_certificate_is_a_tls_error(url: &str) {
    let no_cert = without_param(&without_param(url, "cert"), "key");
    let name = unique("secure-no-client-cert");
    let e = refusal(&no_cert, &name).await;
    assert!(matches!(e, Error::Tls(_)), "{e:?}");
    assert_eq!(dlock::exit_code(&e), 78);
    let out = crate::support::dlock()
        .env("DLOCK_URL", &no_cert)
        .args(["exec", &name, "--timeout", "10s", "--", "true"])
        .output()
        .expect("dlock runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{stderr}");
    nothing_left(url, &name).await;
}

/// The CLI against the secured server: it runs a command under the lock; a wrong
/// password and a user without permission exit 77, an untrusted certificate 78; the
/// password is passed through `DLOCK_PASSWORD` as documented and never printed.
pub async fn cli_on_secured_servers(_kind: Kind, url: &str) {
    let (user, password) = credentials(url);
    let name = unique("secure-cli");
    // The password from the environment, not the URL.
    let no_password = with_credentials(url, &user, "").replacen(":@", "@", 1);
    let out = crate::support::dlock()
        .env("DLOCK_URL", &no_password)
        .env("DLOCK_PASSWORD", &password)
        .args([
            "exec",
            &name,
            "--timeout",
            "20s",
            "--",
            "sh",
            "-c",
            "echo held:$DLOCK_NAME",
        ])
        .output()
        .expect("dlock runs");
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("held:{name}")));
    // `status` with the whole URL in the environment prints no password.
    let out = crate::support::dlock()
        .env("DLOCK_URL", url)
        .args(["status", &name])
        .output()
        .expect("dlock runs");
    let shown = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(3), "free: {shown}");
    assert!(!shown.contains(&password), "the password leaked: {shown}");
    // `list` is allowed to the application's user (on Redis, the documented ACL lets it
    // SCAN) and names the lock it holds.
    let holder = crate::support::client(url).await;
    let mut held = holder
        .mutex(&name)
        .expect("name")
        .lock()
        .await
        .expect("lock");
    let out = crate::support::dlock()
        .env("DLOCK_URL", url)
        .args(["list", &name, "--json"])
        .output()
        .expect("dlock runs");
    let listed = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(listed.contains(&format!("\"{name}\"")), "{listed}");
    assert!(!listed.contains(&password), "the password leaked: {listed}");
    held.release().await.expect("release");
    holder.close().await.expect("close");
    let help = crate::support::dlock()
        .env("DLOCK_URL", url)
        .arg("--help")
        .output()
        .expect("dlock runs");
    assert!(
        !String::from_utf8_lossy(&help.stdout).contains(&password),
        "--help shows DLOCK_URL's value"
    );

    let secret = "wrong-secret-5c2a";
    let (nobody, nobody_password) = (
        dlock_testkit::secure::NOBODY_USER,
        dlock_testkit::secure::NOBODY_PASSWORD,
    );
    let other_ca = other_ca(url);
    for (bad, expected, secret) in [
        (with_credentials(url, &user, secret), 77, secret),
        (
            with_credentials(url, nobody, nobody_password),
            77,
            nobody_password,
        ),
        (
            with_param(url, "ca", &other_ca.display().to_string()),
            78,
            password.as_str(),
        ),
    ] {
        let out = crate::support::dlock()
            .env("DLOCK_URL", &bad)
            .args(["exec", &name, "--timeout", "10s", "--", "true"])
            .output()
            .expect("dlock runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(expected), "{stderr}");
        assert!(!stderr.contains(secret), "the password leaked: {stderr}");
    }
    nothing_left(url, &name).await;
}

/// ZooKeeper: a client without the credentials (an outside zookeeper-client session over
/// the same TLS) can read the queue but cannot delete the holder's node: `NoAuth`. The
/// holder keeps the lock.
#[cfg(feature = "zookeeper")]
pub async fn zk_outsider_cannot_delete_a_holders_node(url: &str) {
    use zookeeper_client as zk;

    let app = client(url).await;
    let name = unique("secure-outsider");
    let mut guard = app.mutex(&name).expect("n").lock().await.expect("lock");
    let (_q, entry) = crate::support::holder_entry(&app, &name).await;

    let parsed = dlock::BackendUrl::parse(url).expect("parses");
    let dlock::Servers::ZooKeeper { hosts, chroot } = parsed.servers else {
        panic!("not a ZooKeeper URL: {url}")
    };
    let tls = parsed.tls.expect("a secured URL");
    let ca = std::fs::read_to_string(tls.ca.as_ref().expect("the test CA")).expect("CA");
    let mut options = zk::TlsOptions::new().with_pem_ca(&ca).expect("CA parses");
    if let (Some(cert), Some(key)) = (&tls.cert, &tls.key) {
        options = options
            .with_pem_identity(
                &std::fs::read_to_string(cert).expect("cert"),
                &std::fs::read_to_string(key).expect("key"),
            )
            .expect("identity");
    }
    let outsider = zk::Client::connector()
        .with_session_timeout(Duration::from_secs(4))
        .with_tls(options)
        .secure_connect(&hosts.join(","))
        .await
        .expect("an anonymous TLS session");
    let node = format!("{}/{name}/{}", chroot.unwrap_or_default(), entry.name);
    // World: read. The outsider sees the holder...
    let (data, _stat) = outsider.get_data(&node).await.expect("world can read");
    assert!(!data.is_empty(), "the holder's node carries its owner data");
    // ...and cannot remove it, nor add to the queue.
    let del = outsider.delete(&node, None).await;
    assert_eq!(
        del,
        Err(zk::Error::NoAuth),
        "an outsider deleted the holder's node"
    );
    let create = outsider
        .create(
            &format!("{node}-intruder"),
            b"",
            &zk::CreateMode::Ephemeral.with_acls(zk::Acls::anyone_all()),
        )
        .await;
    assert!(matches!(create, Err(zk::Error::NoAuth)), "{create:?}");
    drop(outsider);
    guard.verify().await.expect("the holder still holds");
    guard.release().await.expect("release");
    nothing_left(url, &name).await;
    let _ = app.close().await;
}

/// etcd: a user whose role does not cover the lock's prefix is refused, and leaves no key
/// and no lease: the session's lease, granted at connect, is revoked when the client
/// closes (checked by its id, as the root user sees it).
#[cfg(feature = "etcd")]
pub async fn etcd_no_permission_leaves_no_lease(url: &str) {
    use dlock::DynBackend;
    use dlock_testkit::secure::{Pki, NOBODY_PASSWORD, NOBODY_USER};

    let nobody = with_credentials(url, NOBODY_USER, NOBODY_PASSWORD);
    let parsed = dlock::BackendUrl::parse(&nobody).expect("parses");
    let dlock::Servers::Etcd { hosts } = parsed.servers.clone() else {
        panic!("not an etcd URL: {url}")
    };
    let tls = parsed.tls.clone().expect("TLS");
    let opts = dlock::SessionOptions::default()
        .with_session_timeout(crate::support::SESSION_TIMEOUT)
        .with_tls(tls.clone())
        .with_credentials(parsed.credentials.clone().expect("credentials"));
    let backend = dlock_etcd::EtcdBackend::connect(&hosts, opts)
        .await
        .expect("etcd lets an authenticated user grant a lease");
    let lease = backend.lease_id();
    let c = dlock::Client::new(backend as std::sync::Arc<dyn DynBackend>);
    let name = unique("secure-etcd-lease");
    let e = c
        .mutex(&name)
        .expect("n")
        .try_lock()
        .await
        .expect_err("refused");
    assert!(matches!(e, Error::PermissionDenied(_)), "{e:?}");
    c.close().await.expect("close");

    let pki = Pki::in_dir(tls.ca.as_ref().expect("CA").parent().expect("PKI dir"));
    let endpoints = hosts
        .iter()
        .map(|h| format!("https://{h}"))
        .collect::<Vec<_>>()
        .join(",");
    let out = std::process::Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={endpoints}"))
        .args(dlock_testkit::secure::etcdctl_root_args(&pki))
        .args(["lease", "timetolive", &format!("{lease:x}")])
        .output()
        .expect("etcdctl runs");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("already expired"),
        "lease {lease:x} of the refused client is still there: {said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    nothing_left(url, &name).await;
}
