//! The secured cluster's fixed identities, its PKI and the URLs that name it.
//!
//! A [`crate::ClusterSpec`] with `secure: true` starts every server with TLS on its
//! client port (the servers ask for the client certificate; etcd requires it), with
//! authentication and with access control:
//! - ZooKeeper: only a TLS client port (`secureClientPort`), `ssl.clientAuth=want` (see [`crate::secure_zoo_cfg`]);
//!   digest authentication needs no server setup.
//! - etcd: `https://` client URLs with `--client-cert-auth`, then users and roles
//!   ([`APP_USER`] may read and write under [`ETCD_APP_PREFIX`], [`NOBODY_USER`] only read
//!   under [`ETCD_NOBODY_PREFIX`]) and `auth enable`.
//! - Redis: TLS port only (`--port 0`), client certificates optional, ACL users
//!   [`REDIS_ADMIN_USER`] (everything), [`APP_USER`] ([`REDIS_APP_ACL`]) and
//!   [`NOBODY_USER`] (commands but no keys or channels).
//!
//! Ensembles (ZooKeeper, etcd) are secured on their client ports only: traffic between
//! members stays plain (etcd peer TLS adds 2 s to every bootstrap). A Sentinel group is
//! secured throughout: TLS replication, Sentinels on TLS that log in to the data nodes
//! and to each other as the administrator, and [`APP_USER`]/[`NOBODY_USER`] on the
//! Sentinels too ([`SENTINEL_CLIENT_ACL`]).
//!
//! The passwords are fixed test values: these servers listen on 127.0.0.1 and hold
//! throwaway data.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

use crate::env::ENV_SECURE_STATE;
use crate::error::io_ctx;
use crate::{Error, LockService, Result, State, SENTINEL_SERVICE};

/// The application user of every secured server: what dlock's tests connect as.
pub const APP_USER: &str = "dlock-app";
/// [`APP_USER`]'s password.
pub const APP_PASSWORD: &str = "app-secret-1";
/// An authenticated user that may do nothing dlock needs: its lock operations are denied.
pub const NOBODY_USER: &str = "dlock-nobody";
/// [`NOBODY_USER`]'s password.
pub const NOBODY_PASSWORD: &str = "nobody-secret-1";
/// A password no user has, for "wrong password" tests (paired with [`APP_USER`]).
pub const WRONG_PASSWORD: &str = "not-the-secret";

/// The Redis administrator: the `default` user, given a password (an unauthenticated
/// connection gets `NOAUTH`). The testkit's own probes log in as it.
pub const REDIS_ADMIN_USER: &str = "default";
/// [`REDIS_ADMIN_USER`]'s password.
pub const REDIS_ADMIN_PASSWORD: &str = "admin-secret-1";

/// The etcd administrator: user `root` with role `root` (needed by `auth enable`).
pub const ETCD_ROOT_USER: &str = "root";
/// [`ETCD_ROOT_USER`]'s password.
pub const ETCD_ROOT_PASSWORD: &str = "root-secret-1";
/// The etcd key prefix [`APP_USER`] may read and write (role [`ETCD_APP_ROLE`]): every
/// lock name dlock's tests use starts with it.
pub const ETCD_APP_PREFIX: &str = "dlock-test/";
/// The etcd role of [`APP_USER`].
pub const ETCD_APP_ROLE: &str = "dlock-rw";
/// The only etcd key prefix [`NOBODY_USER`] may touch, read-only (role
/// [`ETCD_NOBODY_ROLE`]).
pub const ETCD_NOBODY_PREFIX: &str = "nothing/";
/// The etcd role of [`NOBODY_USER`].
pub const ETCD_NOBODY_ROLE: &str = "dlock-none";

/// The ACL rules of [`APP_USER`] on Redis, after `on` and its password: dlock's keys and
/// channels (`dlock:{NAME}:...`), the commands its Lua scripts run, `EVALSHA` with
/// `SCRIPT LOAD` on `NOSCRIPT`, pub/sub on exact channels, and what a client library sends
/// on connecting (`HELLO`, `AUTH`, `CLIENT SETNAME`, `PING`, `SELECT`, `ROLE` through
/// Sentinel, `INFO`).
///
/// Rule order matters: `-@dangerous` removes `INFO`, `ROLE` and more, so `+info` and
/// `+role` come after it; `+@write` includes `FUNCTION LOAD/DELETE/FLUSH`, which `-function`
/// removes. `PSUBSCRIBE dlock:{x}:*` would be refused (a pattern must equal an ACL channel
/// pattern); dlock subscribes to exact channels only.
pub const REDIS_APP_ACL: &str = "~dlock:* &dlock:* -@all +@read +@write +@pubsub +@connection -@dangerous -function +eval +evalsha +eval_ro +evalsha_ro +script|load +script|exists +time +info +role +wait";

/// The ACL rules of [`NOBODY_USER`] on Redis: the same commands as [`REDIS_APP_ACL`] but no
/// key and no channel pattern, so every dlock command is refused with `NOPERM`.
pub const REDIS_NOBODY_ACL: &str = "resetkeys resetchannels -@all +@read +@write +@pubsub +@connection -@dangerous -function +eval +evalsha +eval_ro +evalsha_ro +script|load +script|exists +time +info +role +wait";

/// The ACL rules of [`APP_USER`] and [`NOBODY_USER`] on a secured Sentinel: ask for the
/// primary and the group, listen for `+switch-master` and the failover starts and ends
/// that hold a client's commands back (`+odown`, `-odown`, `+try-failover`), and what a
/// client library sends on connecting. (fred, without its `sentinel-auth` feature, logs
/// in to the Sentinels with the data nodes' credentials, so the same users exist there.)
pub const SENTINEL_CLIENT_ACL: &str = "resetchannels &+switch-master &+odown &-odown &+try-failover -@all +@connection +sentinel|get-master-addr-by-name +sentinel|master +sentinel|replicas +sentinel|sentinels +subscribe +unsubscribe +role +info";

/// The ACL rules a client of a Redis Cluster needs beside [`REDIS_APP_ACL`] (or
/// [`REDIS_NOBODY_ACL`]): `CLUSTER SLOTS`, the slot map fred routes by (read at connect
/// and after every redirection), and `CLUSTER INFO`, which fred sends on every new
/// connection to check `cluster_state:ok` (refused, connecting fails with `NOPERM`). `ASKING`, sent before a command that follows an `ASK` redirection, is in
/// `@connection` already. Given to both users on a cluster, so that the user without
/// permissions connects and is refused at the lock, as on the other servers.
pub const REDIS_CLUSTER_CLIENT_ACL: &str = "+cluster|slots +cluster|info";

/// The ACL rules of [`REDIS_ADMIN_USER`].
const REDIS_ADMIN_ACL: &str = "~* &* +@all";

/// The `--user` arguments of a secured Redis: one rule per argv element (a whole rule
/// list in one element makes Redis exit with "Spaces not allowed in ACL usernames").
pub fn redis_user_args() -> Vec<String> {
    user_args(None)
}

/// [`redis_user_args`] for a node of a Redis Cluster: [`APP_USER`] and [`NOBODY_USER`]
/// also get [`REDIS_CLUSTER_CLIENT_ACL`].
pub fn redis_cluster_user_args() -> Vec<String> {
    user_args(Some(REDIS_CLUSTER_CLIENT_ACL))
}

/// The `--user` arguments, with `extra` rules appended for the two client users.
fn user_args(extra: Option<&str>) -> Vec<String> {
    let mut argv = Vec::new();
    for (user, password, rules, client) in [
        (
            REDIS_ADMIN_USER,
            REDIS_ADMIN_PASSWORD,
            REDIS_ADMIN_ACL,
            false,
        ),
        (APP_USER, APP_PASSWORD, REDIS_APP_ACL, true),
        (NOBODY_USER, NOBODY_PASSWORD, REDIS_NOBODY_ACL, true),
    ] {
        argv.push("--user".to_owned());
        argv.push(user.to_owned());
        // `reset` first: the `default` user starts as `nopass` with every permission.
        argv.push("reset".to_owned());
        argv.push("on".to_owned());
        argv.push(format!(">{password}"));
        argv.extend(rules.split(' ').map(str::to_owned));
        if let (true, Some(extra)) = (client, extra) {
            argv.extend(extra.split(' ').map(str::to_owned));
        }
    }
    argv
}

/// The files of a secured cluster's PKI, all PEM, in `<cluster root>/pki/`.
///
/// Keys are ECDSA P-256 in PKCS#8 (`BEGIN PRIVATE KEY`), which ZooKeeper 3.8's PEM
/// keystore, Redis (OpenSSL) and etcd (Go) all accept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pki {
    /// The directory holding every file below.
    pub dir: PathBuf,
    /// The CA every server and client certificate is signed by (and the servers trust).
    pub ca: PathBuf,
    /// The CA's key (for tests that mint more certificates).
    pub ca_key: PathBuf,
    /// The servers' certificate: SAN IP 127.0.0.1 and DNS localhost, serverAuth and
    /// clientAuth.
    pub server_cert: PathBuf,
    /// The servers' key.
    pub server_key: PathBuf,
    /// Key then certificate: ZooKeeper's PEM keystore.
    pub server_pem: PathBuf,
    /// The client certificate (CN `dlock-client`, clientAuth).
    pub cert: PathBuf,
    /// The client key.
    pub key: PathBuf,
    /// Client key then certificate, for Java clients' PEM keystores.
    pub client_pem: PathBuf,
    /// A second CA that signed nothing the servers use: trusting only it must fail.
    pub other_ca: PathBuf,
}

/// The common name of the client certificate.
pub const CLIENT_CN: &str = "dlock-client";

impl Pki {
    /// The file names in `dir` (nothing is read or checked).
    pub fn in_dir(dir: impl Into<PathBuf>) -> Pki {
        let dir = dir.into();
        Pki {
            ca: dir.join("ca.crt"),
            ca_key: dir.join("ca.key"),
            server_cert: dir.join("server.crt"),
            server_key: dir.join("server.key"),
            server_pem: dir.join("server.pem"),
            cert: dir.join("client.crt"),
            key: dir.join("client.key"),
            client_pem: dir.join("client.pem"),
            other_ca: dir.join("other-ca.crt"),
            dir,
        }
    }

    /// Generates a fresh PKI into `dir` (created if missing) and returns its paths.
    pub fn generate(dir: impl Into<PathBuf>) -> Result<Pki> {
        let pki = Pki::in_dir(dir);
        std::fs::create_dir_all(&pki.dir)
            .map_err(io_ctx(format!("creating {}", pki.dir.display())))?;
        let (ca_params, ca_key) = ca("dlock-test-ca")?;
        let ca_cert = ca_params.self_signed(&ca_key).map_err(rcgen_err("CA"))?;
        let issuer = Issuer::new(ca_params, &ca_key);

        let mut server = leaf("localhost", ExtendedKeyUsagePurpose::ServerAuth);
        server
            .extended_key_usages
            .push(ExtendedKeyUsagePurpose::ClientAuth);
        server.subject_alt_names = vec![
            SanType::IpAddress(std::net::Ipv4Addr::LOCALHOST.into()),
            SanType::DnsName("localhost".try_into().map_err(rcgen_err("SAN"))?),
        ];
        let server_key = KeyPair::generate().map_err(rcgen_err("server key"))?;
        let server_cert = server
            .signed_by(&server_key, &issuer)
            .map_err(rcgen_err("server certificate"))?;

        let client = leaf(CLIENT_CN, ExtendedKeyUsagePurpose::ClientAuth);
        let client_key = KeyPair::generate().map_err(rcgen_err("client key"))?;
        let client_cert = client
            .signed_by(&client_key, &issuer)
            .map_err(rcgen_err("client certificate"))?;

        let (other_params, other_key) = ca("dlock-test-other-ca")?;
        let other_cert = other_params
            .self_signed(&other_key)
            .map_err(rcgen_err("other CA"))?;

        let server_key_pem = server_key.serialize_pem();
        let client_key_pem = client_key.serialize_pem();
        for (path, text) in [
            (&pki.ca, ca_cert.pem()),
            (&pki.ca_key, ca_key.serialize_pem()),
            (&pki.server_cert, server_cert.pem()),
            (&pki.server_key, server_key_pem.clone()),
            (
                &pki.server_pem,
                format!("{server_key_pem}{}", server_cert.pem()),
            ),
            (&pki.cert, client_cert.pem()),
            (&pki.key, client_key_pem.clone()),
            (
                &pki.client_pem,
                format!("{client_key_pem}{}", client_cert.pem()),
            ),
            (&pki.other_ca, other_cert.pem()),
        ] {
            std::fs::write(path, text).map_err(io_ctx(format!("writing {}", path.display())))?;
        }
        Ok(pki)
    }
}

fn rcgen_err(what: &'static str) -> impl FnOnce(rcgen::Error) -> Error {
    move |e| Error::Command {
        command: format!("generating the test PKI ({what})"),
        detail: e.to_string(),
    }
}

fn name(cn: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    dn
}

fn ca(cn: &str) -> Result<(CertificateParams, KeyPair)> {
    let mut params = CertificateParams::default();
    params.distinguished_name = name(cn);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let key = KeyPair::generate().map_err(rcgen_err("CA key"))?;
    Ok((params, key))
}

fn leaf(cn: &str, eku: ExtendedKeyUsagePurpose) -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name = name(cn);
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![eku];
    params.use_authority_key_identifier_extension = true;
    params
}

/// Who a secured URL connects as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Caller {
    /// [`APP_USER`] with its password, trusting the cluster's CA, presenting the client
    /// certificate: what works.
    App,
    /// [`NOBODY_USER`]: authenticated, but denied every lock operation.
    Nobody,
    /// [`APP_USER`] with [`WRONG_PASSWORD`]: authentication fails.
    WrongPassword,
    /// [`APP_USER`] trusting only the unrelated [`Pki::other_ca`]: the server's
    /// certificate does not verify.
    OtherCa,
    /// [`APP_USER`] without a client certificate: etcd refuses the TLS handshake;
    /// ZooKeeper and Redis (client certificates optional) accept it.
    NoClientCert,
}

impl Caller {
    /// Every caller.
    pub const ALL: [Caller; 5] = [
        Caller::App,
        Caller::Nobody,
        Caller::WrongPassword,
        Caller::OtherCa,
        Caller::NoClientCert,
    ];

    /// The user name and password this caller sends.
    pub fn credentials(self) -> (&'static str, &'static str) {
        match self {
            Caller::Nobody => (NOBODY_USER, NOBODY_PASSWORD),
            Caller::WrongPassword => (APP_USER, WRONG_PASSWORD),
            Caller::App | Caller::OtherCa | Caller::NoClientCert => (APP_USER, APP_PASSWORD),
        }
    }
}

impl LockService {
    /// The facade's TLS URL scheme for this service: `zks`, `etcds`, `rediss`,
    /// `redlocks`, `rediss+sentinel`, `rediss+cluster`.
    pub fn secure_scheme(self) -> &'static str {
        match self {
            LockService::Zk => "zks",
            LockService::Etcd => "etcds",
            LockService::Redis => "rediss",
            LockService::Redlock => "redlocks",
            LockService::RedisSentinel => "rediss+sentinel",
            LockService::RedisCluster => "rediss+cluster",
        }
    }

    /// The environment variable holding this service's full secured URL.
    pub fn secure_env_var(self) -> &'static str {
        use crate::env::{
            ENV_SECURE_ETCD, ENV_SECURE_REDIS, ENV_SECURE_REDIS_CLUSTER, ENV_SECURE_REDIS_SENTINEL,
            ENV_SECURE_REDLOCK, ENV_SECURE_ZK,
        };
        match self {
            LockService::Zk => ENV_SECURE_ZK,
            LockService::Etcd => ENV_SECURE_ETCD,
            LockService::Redis => ENV_SECURE_REDIS,
            LockService::Redlock => ENV_SECURE_REDLOCK,
            LockService::RedisSentinel => ENV_SECURE_REDIS_SENTINEL,
            LockService::RedisCluster => ENV_SECURE_REDIS_CLUSTER,
        }
    }

    /// The secured facade URL of `service` at `addrs` for `caller`:
    /// `SCHEME://USER:PASSWORD@h:p[,h:p...][/mymaster]?ca=PATH&cert=PATH&key=PATH`.
    ///
    /// User and password are percent-encoded as URL userinfo; the query values are
    /// percent-encoded except for `/`, so a path reads as itself and decodes to the same
    /// path with any URL parser (`url::Url::query_pairs`, `form_urlencoded::parse`). A
    /// single Redis master takes only the first address. [`Caller::NoClientCert`] leaves
    /// out `cert` and `key`.
    pub fn secure_url(self, addrs: &[String], pki: &Pki, caller: Caller) -> String {
        let addrs = match self {
            LockService::Redis => &addrs[..addrs.len().min(1)],
            _ => addrs,
        };
        let (user, password) = caller.credentials();
        let userinfo = userinfo(user, password);
        let path = match self {
            LockService::RedisSentinel => format!("/{SENTINEL_SERVICE}"),
            _ => String::new(),
        };
        let ca = match caller {
            Caller::OtherCa => &pki.other_ca,
            _ => &pki.ca,
        };
        let mut query = vec![("ca", ca.as_path())];
        if caller != Caller::NoClientCert {
            query.push(("cert", pki.cert.as_path()));
            query.push(("key", pki.key.as_path()));
        }
        let query = query
            .iter()
            .map(|(k, v)| format!("{k}={}", encode_query_value(&v.display().to_string())))
            .collect::<Vec<_>>()
            .join("&");
        format!(
            "{}://{userinfo}@{}{path}?{query}",
            self.secure_scheme(),
            addrs.join(",")
        )
    }
}

/// `user:password`, each percent-encoded as URL userinfo.
///
/// Not through `url::Url::set_password`: it leaves `%` as it is (it takes the input as
/// possibly encoded already), so a password with `%` would not survive a round trip.
fn userinfo(user: &str, password: &str) -> String {
    format!(
        "{}:{}",
        percent_encode(user, false),
        percent_encode(password, false)
    )
}

/// Percent-encodes everything but RFC 3986 unreserved characters and `/`.
fn encode_query_value(value: &str) -> String {
    percent_encode(value, true)
}

/// Percent-encodes every byte but RFC 3986 unreserved characters (and `/` when
/// `keep_slash`): safe in userinfo and in a query value, and decoded back by any parser.
fn percent_encode(value: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if b.is_ascii_alphanumeric()
            || matches!(b, b'-' | b'.' | b'_' | b'~')
            || (keep_slash && b == b'/')
        {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The TLS and identity flags of an `etcdctl` talking to a secured etcd as
/// [`ETCD_ROOT_USER`] (the endpoints are the caller's).
pub fn etcdctl_root_args(pki: &Pki) -> Vec<String> {
    let mut args = etcdctl_tls_args(pki);
    args.push(format!("--user={ETCD_ROOT_USER}:{ETCD_ROOT_PASSWORD}"));
    args
}

/// `--cacert`, `--cert` and `--key` of `pki`, for `etcdctl`.
pub fn etcdctl_tls_args(pki: &Pki) -> Vec<String> {
    vec![
        format!("--cacert={}", pki.ca.display()),
        format!("--cert={}", pki.cert.display()),
        format!("--key={}", pki.key.display()),
    ]
}

/// Creates the users and roles of a secured etcd at `endpoints` (`https://h:p,...`), then
/// enables authentication.
///
/// `root` gets role `root` before `auth enable`: etcd refuses to enable auth otherwise
/// (etcdctl hides that by granting it itself; the RPC does not). Each step's output is
/// checked, because etcdctl exits 0 on some errors.
pub(crate) fn setup_etcd_auth(endpoints: &str, pki: &Pki) -> Result<()> {
    let steps: &[(&[&str], &str)] = &[
        (
            &[
                "user",
                "add",
                ETCD_ROOT_USER,
                &format!("--new-user-password={ETCD_ROOT_PASSWORD}"),
            ],
            "User root created",
        ),
        (&["role", "add", "root"], "Role root created"),
        (
            &["user", "grant-role", ETCD_ROOT_USER, "root"],
            "Role root is granted to user root",
        ),
        (
            &[
                "user",
                "add",
                APP_USER,
                &format!("--new-user-password={APP_PASSWORD}"),
            ],
            "created",
        ),
        (&["role", "add", ETCD_APP_ROLE], "created"),
        (
            &[
                "role",
                "grant-permission",
                ETCD_APP_ROLE,
                "--prefix=true",
                "readwrite",
                ETCD_APP_PREFIX,
            ],
            "updated",
        ),
        (
            &["user", "grant-role", APP_USER, ETCD_APP_ROLE],
            "is granted",
        ),
        (
            &[
                "user",
                "add",
                NOBODY_USER,
                &format!("--new-user-password={NOBODY_PASSWORD}"),
            ],
            "created",
        ),
        (&["role", "add", ETCD_NOBODY_ROLE], "created"),
        (
            &[
                "role",
                "grant-permission",
                ETCD_NOBODY_ROLE,
                "--prefix=true",
                "read",
                ETCD_NOBODY_PREFIX,
            ],
            "updated",
        ),
        (
            &["user", "grant-role", NOBODY_USER, ETCD_NOBODY_ROLE],
            "is granted",
        ),
        (&["auth", "enable"], "Authentication Enabled"),
    ];
    for (args, expect) in steps {
        let mut argv = vec![format!("--endpoints={endpoints}")];
        argv.extend(etcdctl_tls_args(pki));
        argv.extend(args.iter().map(|a| a.to_string()));
        let out = std::process::Command::new("etcdctl")
            .args(&argv)
            .env("ETCDCTL_API", "3")
            .stdin(std::process::Stdio::null())
            .output()
            .map_err(io_ctx("running etcdctl"))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() || !stdout.contains(expect) {
            return Err(Error::Command {
                command: format!("etcdctl {}", argv.join(" ")),
                detail: format!(
                    "{}; expected {expect:?} in the output; stdout: {stdout}; stderr: {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                ),
            });
        }
    }
    Ok(())
}

impl State {
    /// The PKI of a secured cluster (`None` for a plain one).
    pub fn pki(&self) -> Option<Pki> {
        self.pki_dir.as_ref().map(Pki::in_dir)
    }

    /// The secured facade URL of `service` on this cluster for `caller`
    /// ([`LockService::secure_url`]); `None` for a plain cluster or when the cluster has
    /// no such servers (a Redlock set needs at least two Redis masters).
    pub fn secure_url(&self, service: LockService, caller: Caller) -> Option<String> {
        let pki = self.pki()?;
        let addrs: Vec<String> = self
            .servers_of(service.server())
            .filter(|s| s.tls.is_some())
            .map(|s| s.addr.clone())
            .collect();
        let enough = match service {
            LockService::Redlock => addrs.len() > 1,
            _ => !addrs.is_empty(),
        };
        enough.then(|| service.secure_url(&addrs, &pki, caller))
    }

    /// The `DLOCK_TEST_SECURE_*` variables of a secured cluster, each a full URL for
    /// [`Caller::App`] (credentials, CA, client certificate), plus
    /// [`ENV_SECURE_STATE`](crate::ENV_SECURE_STATE) with this state's file when it has
    /// one; empty for a plain cluster. `cargo xtask integration` exports these.
    pub fn secure_env(&self) -> Vec<(&'static str, String)> {
        if self.pki_dir.is_none() {
            return Vec::new();
        }
        let mut vars: Vec<(&'static str, String)> = LockService::ALL
            .iter()
            .filter_map(|&s| Some((s.secure_env_var(), self.secure_url(s, Caller::App)?)))
            .collect();
        if let Some(p) = self.path() {
            vars.push((ENV_SECURE_STATE, p.display().to_string()));
        }
        vars
    }
}

/// Where the PKI of a cluster rooted at `root_dir` lives.
pub(crate) fn pki_dir(root_dir: &Path) -> PathBuf {
    root_dir.join("pki")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pki() -> Pki {
        Pki::in_dir("/tmp/x y/pki")
    }

    #[test]
    fn urls_follow_the_facade_contract() {
        let a: Vec<String> = ["127.0.0.1:16379", "127.0.0.1:16380"]
            .map(String::from)
            .to_vec();
        let p = Pki::in_dir("/tmp/x/pki");
        assert_eq!(
            LockService::Redis.secure_url(&a, &p, Caller::App),
            "rediss://dlock-app:app-secret-1@127.0.0.1:16379?ca=/tmp/x/pki/ca.crt&cert=/tmp/x/pki/client.crt&key=/tmp/x/pki/client.key"
        );
        assert_eq!(
            LockService::Redlock.secure_url(&a, &p, Caller::NoClientCert),
            "redlocks://dlock-app:app-secret-1@127.0.0.1:16379,127.0.0.1:16380?ca=/tmp/x/pki/ca.crt"
        );
        assert!(LockService::Etcd
            .secure_url(&a, &p, Caller::OtherCa)
            .starts_with("etcds://dlock-app:app-secret-1@127.0.0.1:16379,127.0.0.1:16380?ca=/tmp/x/pki/other-ca.crt&cert="));
        assert!(LockService::Zk
            .secure_url(&a, &p, Caller::Nobody)
            .starts_with("zks://dlock-nobody:nobody-secret-1@127.0.0.1:16379,127.0.0.1:16380?"));
        assert!(LockService::RedisSentinel
            .secure_url(&a, &p, Caller::WrongPassword)
            .starts_with(
                "rediss+sentinel://dlock-app:not-the-secret@127.0.0.1:16379,127.0.0.1:16380/mymaster?ca="
            ));
    }

    #[test]
    fn a_url_parser_gets_the_exact_credentials_and_paths_back() {
        let p = pki();
        let url = LockService::Redis.secure_url(&["127.0.0.1:1".into()], &p, Caller::App);
        assert!(url.contains("ca=/tmp/x%20y/pki/ca.crt&"), "{url}");
        let parsed = url::Url::parse(&url).expect("parses");
        assert_eq!(parsed.username(), APP_USER);
        assert_eq!(parsed.password(), Some(APP_PASSWORD));
        let q: Vec<(String, String)> = parsed.query_pairs().into_owned().collect();
        assert_eq!(
            q,
            vec![
                ("ca".to_owned(), "/tmp/x y/pki/ca.crt".to_owned()),
                ("cert".to_owned(), "/tmp/x y/pki/client.crt".to_owned()),
                ("key".to_owned(), "/tmp/x y/pki/client.key".to_owned()),
            ]
        );
        assert_eq!(userinfo("a@b", "p:w/%"), "a%40b:p%3Aw%2F%25");
        let odd = url::Url::parse(&format!("rediss://{}@h:1", userinfo("a@b", "p:w/% é")))
            .expect("parses");
        let decode = |s: &str| {
            url::form_urlencoded::parse(format!("v={s}").as_bytes())
                .next()
                .map(|(_, v)| v.into_owned())
        };
        assert_eq!(decode(odd.username()).as_deref(), Some("a@b"));
        assert_eq!(odd.password().and_then(decode).as_deref(), Some("p:w/% é"));
        assert_eq!(encode_query_value("/a+b&c=d"), "/a%2Bb%26c%3Dd");
    }

    #[test]
    fn redis_users_are_one_rule_per_argument() {
        let argv = redis_user_args();
        assert_eq!(argv.iter().filter(|a| *a == "--user").count(), 3);
        assert!(argv.iter().all(|a| !a.contains(' ')), "{argv:?}");
        let app = argv.iter().position(|a| a == APP_USER).expect("app user");
        assert_eq!(argv[app + 3], format!(">{APP_PASSWORD}"));
        assert_eq!(argv[app + 4], "~dlock:*");
        let nobody = argv.iter().position(|a| a == NOBODY_USER).expect("nobody");
        assert!(!argv[nobody..]
            .iter()
            .any(|a| a.starts_with('~') || a.starts_with('&')));
    }

    #[test]
    fn generated_pki_has_every_file_in_pem() {
        let dir = std::env::temp_dir().join(format!("dlock-testkit-pki-{}", std::process::id()));
        let pki = Pki::generate(&dir).expect("generates");
        for f in [&pki.ca, &pki.server_cert, &pki.cert, &pki.other_ca] {
            let text = std::fs::read_to_string(f).expect("read");
            assert!(text.starts_with("-----BEGIN CERTIFICATE-----"), "{text}");
        }
        for f in [&pki.ca_key, &pki.server_key, &pki.key] {
            let text = std::fs::read_to_string(f).expect("read");
            assert!(text.starts_with("-----BEGIN PRIVATE KEY-----"), "{text}");
        }
        let pem = std::fs::read_to_string(&pki.server_pem).expect("read");
        assert!(pem.starts_with("-----BEGIN PRIVATE KEY-----") && pem.contains("CERTIFICATE"));
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
