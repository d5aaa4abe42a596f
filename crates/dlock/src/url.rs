//! Backend URLs: `zk://`, `etcd://`, `redis://`, `redlock://`, `redis+sentinel://`,
//! `redis+cluster://`, their TLS forms (`zks://`, `etcds://`, `rediss://`, `redlocks://`,
//! `rediss+sentinel://`, `rediss+cluster://`), credentials in the userinfo and TLS
//! settings in the query.

use std::path::PathBuf;

use dlock_core::{Credentials, Error, Secret, TlsOptions};
use percent_encoding::percent_decode_str;

/// The environment variable a password comes from when the URL names a user but no
/// password, so the password need not appear in a process list.
pub const PASSWORD_ENV: &str = "DLOCK_PASSWORD";

/// A parsed backend URL: which servers, and how to reach them securely.
///
/// `Debug` never shows a password ([`Secret`] prints `***`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BackendUrl {
    /// The servers and how they are used.
    pub servers: Servers,
    /// TLS settings: `Some` for the TLS schemes (`zks://`, `etcds://`, `rediss://`,
    /// `redlocks://`, `rediss+sentinel://`, `rediss+cluster://`), from the `ca`, `cert`, `key` and
    /// `server_name` query parameters.
    pub tls: Option<TlsOptions>,
    /// The credentials of the userinfo (`USER:PASSWORD@`, `:PASSWORD@`), percent-decoded;
    /// a user without a password takes it from `DLOCK_PASSWORD`.
    pub credentials: Option<Credentials>,
    /// The key prefix of a Redis URL (`?prefix=app1:`) or the key namespace of an etcd
    /// URL (`?namespace=/app1/`); see `SessionOptions::namespace`.
    pub namespace: Option<String>,
    /// How many replicas must acknowledge a grant or a renewal (`?replicas=1`, on
    /// `redis://` and `redis+sentinel://` and their TLS forms); 0 when not given. See
    /// `SessionOptions::replicas`.
    pub replicas: u32,
}

/// The servers a URL names, by backend.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Servers {
    /// `zk://host:port[,host:port...][/chroot]`.
    ZooKeeper {
        /// `host:port` of each server.
        hosts: Vec<String>,
        /// The chroot path (`/app`), if any.
        chroot: Option<String>,
    },
    /// `etcd://host:port[,host:port...]`.
    Etcd {
        /// `host:port` of each endpoint.
        hosts: Vec<String>,
    },
    /// `redis://host:port`.
    Redis {
        /// `host:port` of the server.
        host: String,
        /// The database number (`redis://h:p/3`; 0 when the URL has no path). Keys are
        /// per database; pub/sub channels are not, so two databases only share
        /// wake-ups, which waiters re-check.
        database: u8,
    },
    /// `redlock://host:port,host:port,host:port[,...]`: independent masters.
    Redlock {
        /// `host:port` of each master.
        hosts: Vec<String>,
    },
    /// `redis+sentinel://host:port[,host:port...]/service`: the primary of the Redis
    /// group the Sentinels at these addresses monitor as `service`, followed across
    /// failovers.
    RedisSentinel {
        /// `host:port` of each Sentinel.
        sentinels: Vec<String>,
        /// The monitored service (master) name, e.g. `mymaster`.
        service: String,
    },
    /// `redis+cluster://host:port[,host:port...]`: a Redis Cluster, found through these
    /// seed nodes (any of its nodes; one that answers is enough), each lock on the master
    /// of its slot, followed across failovers and slot migrations.
    RedisCluster {
        /// `host:port` of each seed node.
        seeds: Vec<String>,
    },
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Zk,
    Etcd,
    Redis,
    Redlock,
    Sentinel,
    Cluster,
}

/// Scheme → (backend, TLS).
fn scheme(s: &str) -> Option<(Kind, bool)> {
    Some(match s {
        "zk" | "zookeeper" => (Kind::Zk, false),
        "zks" => (Kind::Zk, true),
        "etcd" => (Kind::Etcd, false),
        "etcds" => (Kind::Etcd, true),
        "redis" => (Kind::Redis, false),
        "rediss" => (Kind::Redis, true),
        "redlock" => (Kind::Redlock, false),
        "redlocks" => (Kind::Redlock, true),
        "redis+sentinel" => (Kind::Sentinel, false),
        "rediss+sentinel" => (Kind::Sentinel, true),
        "redis+cluster" => (Kind::Cluster, false),
        "rediss+cluster" => (Kind::Cluster, true),
        _ => return None,
    })
}

impl BackendUrl {
    /// Parses a backend URL; a user named without a password takes it from
    /// `DLOCK_PASSWORD`.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] saying what is wrong; its `url` has any password replaced by
    /// `***` ([`BackendUrl::redact`]).
    pub fn parse(url: &str) -> Result<Self, Error> {
        Self::parse_with(url, || std::env::var(PASSWORD_ENV).ok())
    }

    /// [`BackendUrl::parse`] with the fallback password from `password_env` instead of
    /// the environment.
    pub fn parse_with(
        url: &str,
        password_env: impl FnOnce() -> Option<String>,
    ) -> Result<Self, Error> {
        let bad = |reason: &str| Error::InvalidUrl {
            url: Self::redact(url),
            reason: reason.to_owned(),
        };
        let (scheme_str, rest) = url
            .split_once("://")
            .ok_or_else(|| bad("expected scheme://host:port, e.g. zk://127.0.0.1:2181"))?;
        let (kind, tls) = scheme(scheme_str).ok_or_else(|| {
            bad(&format!(
                "unknown scheme {scheme_str:?}: use zk://, etcd://, redis://, redlock://, \
                 redis+sentinel:// or redis+cluster://, or their TLS forms zks://, etcds://, \
                 rediss://, redlocks://, rediss+sentinel://, rediss+cluster://"
            ))
        })?;
        let (userinfo, host_list, tail) = split_authority(rest);
        if userinfo.is_none() && rest.contains('@') {
            // An `@` after the authority ended at a `/`, `?` or `#`: most likely a
            // password with one of those unencoded. Said without quoting any part of it.
            return Err(bad(
                "an `@` after the host list: percent-encode a `/`, `?`, `#` or `@` in the \
                 user or password (%2F, %3F, %23, %40)",
            ));
        }
        let mut hosts = Vec::new();
        for h in host_list.split(',') {
            hosts.push(host_port(h).map_err(|r| bad(&r))?);
        }
        // The `url` crate resolves `.` and `..` (also spelled `%2e`) before the path is
        // looked at, so `zk://h/app1/..` would quietly mean no chroot and
        // `redis://h/5/..` database 0: refused as written instead.
        let raw_path = tail.split(['?', '#']).next().unwrap_or("");
        if raw_path.split('/').any(|seg| {
            let seg = percent_decode_str(seg).decode_utf8_lossy();
            seg == "." || seg == ".."
        }) {
            return Err(bad("the path takes no `.` or `..` segments"));
        }
        // The rest is read by the `url` crate, on the URL with its first host only (it
        // does not take a host list). A non-special scheme keeps the path as written.
        let single = format!(
            "dlock://{}{}{tail}",
            userinfo.map(|u| format!("{u}@")).unwrap_or_default(),
            hosts[0]
        );
        let parsed = url::Url::parse(&single).map_err(|e| bad(&e.to_string()))?;
        if parsed.fragment().is_some() {
            return Err(bad("a backend URL takes no #fragment"));
        }
        let credentials = credentials(&parsed, password_env).map_err(|r| bad(&r))?;
        let Query {
            tls,
            namespace,
            replicas,
        } = query(&parsed, tls, kind).map_err(|r| bad(&r))?;
        let path = Some(parsed.path()).filter(|p| !p.trim_matches('/').is_empty());
        let servers = match kind {
            Kind::Zk => {
                let chroot = match path {
                    Some(p) => {
                        let p = percent_decode_str(p.trim_end_matches('/'))
                            .decode_utf8()
                            .map_err(|_| bad("the chroot is not UTF-8"))?;
                        if p.split('/')
                            .skip(1)
                            .any(|s| s.is_empty() || s == "." || s == "..")
                            || p.chars().any(char::is_control)
                        {
                            return Err(bad("the chroot must be a plain path like /app/locks"));
                        }
                        Some(p.into_owned())
                    }
                    None => None,
                };
                Servers::ZooKeeper { hosts, chroot }
            }
            Kind::Etcd => {
                if path.is_some() {
                    return Err(bad("etcd URLs take no path"));
                }
                Servers::Etcd { hosts }
            }
            Kind::Redis => {
                let database = match path.map(|p| p.trim_matches('/')) {
                    None | Some("") => 0,
                    Some(n) => n.parse::<u8>().map_err(|_| {
                        bad("the path of a redis URL is the database number, 0 to 255")
                    })?,
                };
                match <[String; 1]>::try_from(hosts) {
                    Ok([host]) => Servers::Redis { host, database },
                    Err(_) => return Err(bad(
                        "redis:// takes one host; use redlock:// for several independent masters",
                    )),
                }
            }
            Kind::Redlock => {
                if path.is_some() {
                    return Err(bad("redlock URLs take no path"));
                }
                if hosts.len() < 3 {
                    return Err(bad("redlock:// needs at least 3 independent masters"));
                }
                Servers::Redlock { hosts }
            }
            Kind::Sentinel => {
                let service = path.map(|p| p.trim_matches('/')).ok_or_else(|| {
                    bad("redis+sentinel:// needs the service name: redis+sentinel://h:p,h:p,h:p/mymaster")
                })?;
                if !service
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                {
                    return Err(bad(
                        "the Sentinel service name takes letters, digits, '-', '_' and '.' only",
                    ));
                }
                Servers::RedisSentinel {
                    sentinels: hosts,
                    service: service.to_owned(),
                }
            }
            Kind::Cluster => {
                if path.is_some() {
                    return Err(bad(
                        "redis+cluster URLs take no path: a Redis Cluster has only database 0",
                    ));
                }
                if hosts.iter().collect::<std::collections::HashSet<_>>().len() != hosts.len() {
                    return Err(bad("a seed node is listed twice"));
                }
                Servers::RedisCluster { seeds: hosts }
            }
        };
        if let Some(c) = &credentials {
            let needs_user = matches!(servers, Servers::ZooKeeper { .. } | Servers::Etcd { .. });
            if needs_user && c.user.is_none() {
                return Err(bad(
                    "ZooKeeper and etcd authenticate a user: give USER:PASSWORD@, not :PASSWORD@",
                ));
            }
        }
        Ok(BackendUrl {
            servers,
            tls,
            credentials,
            namespace,
            replicas,
        })
    }

    /// `url` with the password of its userinfo replaced by `***`: the form every error,
    /// log line and status output shows.
    ///
    /// Text that is not a well-formed URL is hidden generously rather than shown: a
    /// password with an unencoded `/`, `?` or `#` (which ends the authority early, so the
    /// `@` after it is not the userinfo's) is still hidden up to the last `@`, and so is
    /// everything before the last `@` of text without `://`.
    pub fn redact(url: &str) -> String {
        let Some((scheme, rest)) = url.split_once("://") else {
            return match url.rsplit_once('@') {
                Some((_, after)) => format!("***@{after}"),
                None => url.to_owned(),
            };
        };
        // Up to the last `@`, not the authority's: a password may hold an unencoded `/`,
        // `?`, `#` or `@` (and, quoted in a message, a space), which would otherwise end
        // the userinfo early and show the rest of it.
        let Some((userinfo, after)) = rest.rsplit_once('@') else {
            return url.to_owned();
        };
        let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
        let hidden = if userinfo.contains(':') { ":***" } else { "" };
        format!("{scheme}://{user}{hidden}@{after}")
    }

    /// `text` (an error message, say) with every URL in it redacted ([`Self::redact`]):
    /// each space-separated word that contains `://` or `@`, quotes around it kept. A
    /// password with a space in it splits its URL into several words: a word with `://`
    /// is taken together with the words up to the last one with an `@` before the next
    /// `://`, so no part of the password is shown, whatever else it holds; text that only
    /// looks like that is hidden generously (the words up to such an `@` are hidden with
    /// the password).
    pub fn redact_in(text: &str) -> String {
        let words: Vec<&str> = text.split(' ').collect();
        let mut out = Vec::with_capacity(words.len());
        let mut i = 0;
        while i < words.len() {
            let mut j = i;
            if words[i].contains("://") {
                // A password may hold a space (and `@`, `/`, quotes...): the URL's words
                // go on up to the last one with an `@` before the next URL.
                let rest = &words[i + 1..];
                let until = rest
                    .iter()
                    .position(|w| w.contains("://"))
                    .unwrap_or(rest.len());
                if let Some(k) = rest[..until].iter().rposition(|w| w.contains('@')) {
                    j = i + 1 + k;
                }
            }
            let word = words[i..=j].join(" ");
            if word.contains("://") || word.contains('@') {
                let inner = word.trim_matches(|c| matches!(c, '\'' | '"' | ',' | ':' | '`'));
                out.push(word.replacen(inner, &Self::redact(inner), 1));
            } else {
                out.push(word);
            }
            i = j + 1;
        }
        out.join(" ")
    }
}

/// What follows `scheme://`, split into the userinfo (up to the last `@` of the
/// authority), the host list, and the path, query and fragment.
fn split_authority(rest: &str) -> (Option<&str>, &str, &str) {
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    match authority.rsplit_once('@') {
        Some((userinfo, hosts)) => (Some(userinfo), hosts, tail),
        None => (None, authority, tail),
    }
}

/// Checks one `host:port` of a host list with the `url` crate and returns it as
/// `host:port` (an IPv6 host in brackets).
fn host_port(h: &str) -> Result<String, String> {
    if h.is_empty() {
        return Err("empty host in the host list".to_owned());
    }
    let parsed = url::Url::parse(&format!("dlock://{h}")).map_err(|e| format!("{h:?}: {e}"))?;
    let host = parsed
        .host_str()
        .filter(|s| !s.is_empty())
        .ok_or_else(|| format!("{h:?} has no valid host"))?;
    // An opaque host keeps percent-escapes; a real host name never needs one.
    if host.contains('%') || !parsed.username().is_empty() || parsed.path() != "" {
        return Err(format!("{h:?} has no valid host"));
    }
    match parsed.port() {
        Some(p) if p > 0 => Ok(format!("{host}:{p}")),
        _ => Err(format!("{h:?} has no valid port (host:port)")),
    }
}

fn decode(s: &str, what: &str) -> Result<String, String> {
    percent_decode_str(s)
        .decode_utf8()
        .map(|c| c.into_owned())
        .map_err(|_| format!("the {what} is not UTF-8 after percent-decoding"))
}

fn credentials(
    url: &url::Url,
    password_env: impl FnOnce() -> Option<String>,
) -> Result<Option<Credentials>, String> {
    let user = decode(url.username(), "user")?;
    let password = url.password().map(|p| decode(p, "password")).transpose()?;
    Ok(match (user.is_empty(), password) {
        (true, None) => None,
        (true, Some(p)) => Some(Credentials::password_only(Secret::new(p))),
        (false, Some(p)) => Some(Credentials::new(user, Secret::new(p))),
        (false, None) => match password_env() {
            Some(p) => Some(Credentials::new(user, Secret::new(p))),
            None => {
                return Err(format!(
                    "the URL names user {user:?} but no password: put it in {PASSWORD_ENV}"
                ))
            }
        },
    })
}

/// What a URL's query sets.
struct Query {
    tls: Option<TlsOptions>,
    namespace: Option<String>,
    replicas: u32,
}

/// The query: TLS settings (on a TLS scheme only), the key namespace (`prefix` on
/// Redis, `namespace` on etcd) and the replicas a grant waits for (one Redis primary).
fn query(url: &url::Url, tls: bool, kind: Kind) -> Result<Query, String> {
    let mut opts = TlsOptions::new();
    let mut any_tls = false;
    let mut namespace = None;
    let mut replicas = None;
    let redis = matches!(
        kind,
        Kind::Redis | Kind::Redlock | Kind::Sentinel | Kind::Cluster
    );
    for (k, v) in url.query_pairs() {
        let v = v.into_owned();
        if v.is_empty() {
            return Err(format!("query parameter {k} has no value"));
        }
        let slot = match &*k {
            "ca" => &mut opts.ca,
            "cert" => &mut opts.cert,
            "key" => &mut opts.key,
            "server_name" => {
                any_tls = true;
                if opts.server_name.replace(v).is_some() {
                    return Err("query parameter server_name given twice".to_owned());
                }
                continue;
            }
            "prefix" if redis => {
                if v.contains(['{', '}']) || v.chars().any(char::is_control) {
                    return Err(
                        "the Redis key prefix may not contain '{', '}' or control characters"
                            .to_owned(),
                    );
                }
                if namespace.replace(v).is_some() {
                    return Err("query parameter prefix given twice".to_owned());
                }
                continue;
            }
            "namespace" if kind == Kind::Etcd => {
                if v.chars().any(char::is_control) {
                    return Err("the etcd namespace may not contain control characters".to_owned());
                }
                if namespace.replace(v).is_some() {
                    return Err("query parameter namespace given twice".to_owned());
                }
                continue;
            }
            "replicas" if matches!(kind, Kind::Redis | Kind::Sentinel) => {
                let n = v.parse::<u32>().map_err(|_| {
                    format!("replicas takes a number of replicas (0 to {}), not {v:?}", u32::MAX)
                })?;
                if replicas.replace(n).is_some() {
                    return Err("query parameter replicas given twice".to_owned());
                }
                continue;
            }
            "replicas" => {
                return Err(match kind {
                    Kind::Zk | Kind::Etcd => "replicas is for Redis: ZooKeeper and etcd answer a write only once a quorum has it".to_owned(),
                    _ => "replicas is taken by one primary only (redis://, redis+sentinel://): dlock does not wait for replicas on Redlock masters or a Redis Cluster".to_owned(),
                })
            }
            "prefix" | "namespace" => {
                return Err(match kind {
                    Kind::Zk => "ZooKeeper keeps applications apart with a chroot (zk://h:p/app), not a query parameter".to_owned(),
                    Kind::Etcd => "etcd takes ?namespace=, not ?prefix=".to_owned(),
                    _ => "Redis takes ?prefix=, not ?namespace=".to_owned(),
                })
            }
            other => {
                return Err(format!(
                    "unknown query parameter {other:?} (known: ca, cert, key, server_name; prefix and replicas on Redis, namespace on etcd)"
                ))
            }
        };
        any_tls = true;
        if slot.replace(PathBuf::from(v)).is_some() {
            return Err(format!("query parameter {k} given twice"));
        }
    }
    if any_tls && !tls {
        return Err(
            "ca, cert, key and server_name are TLS settings: use the TLS scheme (zks://, \
             etcds://, rediss://, redlocks://, rediss+sentinel://, rediss+cluster://)"
                .to_owned(),
        );
    }
    if opts.cert.is_some() != opts.key.is_some() {
        return Err("cert and key go together: give both or neither".to_owned());
    }
    Ok(Query {
        tls: tls.then_some(opts),
        namespace,
        replicas: replicas.unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn servers(url: &str) -> Servers {
        BackendUrl::parse_with(url, || None)
            .unwrap_or_else(|e| panic!("{url}: {e}"))
            .servers
    }

    fn refused(url: &str) -> String {
        match BackendUrl::parse_with(url, || None) {
            Err(Error::InvalidUrl { reason, .. }) => reason,
            other => panic!("{url:?} should be refused, got {other:?}"),
        }
    }

    #[test]
    fn parses_every_scheme() {
        assert_eq!(
            servers("zk://127.0.0.1:2181,127.0.0.1:2182/app"),
            Servers::ZooKeeper {
                hosts: vec!["127.0.0.1:2181".into(), "127.0.0.1:2182".into()],
                chroot: Some("/app".into())
            }
        );
        assert_eq!(
            servers("zk://localhost:2181/"),
            Servers::ZooKeeper {
                hosts: vec!["localhost:2181".into()],
                chroot: None
            }
        );
        assert!(matches!(
            servers("etcd://a:2379,b:2379"),
            Servers::Etcd { .. }
        ));
        assert!(matches!(servers("redis://a:6379"), Servers::Redis { .. }));
        assert!(matches!(
            servers("redis://a:6379/0"),
            Servers::Redis { database: 0, .. }
        ));
        assert!(matches!(
            servers("rediss://a:6379/12"),
            Servers::Redis { database: 12, .. }
        ));
        for bad in [
            "redis://a:6379/x",
            "redis://a:6379/256",
            "redis://a:6379/1/2",
        ] {
            assert!(
                matches!(BackendUrl::parse(bad), Err(Error::InvalidUrl { .. })),
                "{bad}"
            );
        }
        assert!(matches!(
            servers("redlock://a:1,b:2,c:3"),
            Servers::Redlock { .. }
        ));
        assert_eq!(
            servers("redis+sentinel://127.0.0.1:6393,127.0.0.1:6394/mymaster"),
            Servers::RedisSentinel {
                sentinels: vec!["127.0.0.1:6393".into(), "127.0.0.1:6394".into()],
                service: "mymaster".into()
            }
        );
        assert_eq!(
            servers("etcd://[::1]:2379"),
            Servers::Etcd {
                hosts: vec!["[::1]:2379".into()]
            }
        );
        assert_eq!(
            servers("redis+cluster://127.0.0.1:7001,127.0.0.1:7002"),
            Servers::RedisCluster {
                seeds: vec!["127.0.0.1:7001".into(), "127.0.0.1:7002".into()],
            }
        );
        assert_eq!(
            servers("redis+cluster://h:7001?prefix=app1:"),
            Servers::RedisCluster {
                seeds: vec!["h:7001".into()],
            }
        );
        for bad in [
            "redis+cluster://127.0.0.1:7001/0",
            "redis+cluster://127.0.0.1:7001,127.0.0.1:7001",
            "redis+cluster://127.0.0.1",
            "redis+cluster://a:1?namespace=x",
            "redis+cluster://a:1?ca=/x",
            "redis+sentinel://127.0.0.1:6393",
            "redis+sentinel://127.0.0.1:6393/",
            "redis+sentinel://127.0.0.1:6393/a/b",
            "redis+sentinel://127.0.0.1:6393/my master",
            "redis+sentinel://127.0.0.1/mymaster",
        ] {
            refused(bad);
        }
    }

    #[test]
    fn rejects_bad_urls() {
        for u in [
            "",
            "zk",
            "zk://",
            "zk://host",
            "zk://host:0",
            "zk://host:99999",
            "zk://:2181",
            "zk://a:1//x",
            "ftp://a:1",
            "redis://a:1,b:2",
            "redlock://a:1,b:2",
            "etcd://a:1/x",
            "zk://a b:1",
            "zk://a:1,",
            "zk://a:1#frag",
            "redis://a:1?ca=/x",
            "rediss://a:1?ca=",
            "rediss://a:1?cert=/c",
            "rediss://a:1?bogus=1",
            "zk://a:1?prefix=x",
            "etcd://a:1?prefix=x",
            "redis://a:1?namespace=x",
            "redis://a:1?prefix=a{b",
            "rediss://a:1?ca=/x&ca=/y",
            "etcd://:pw@a:1",
            "zk://:pw@a:1",
            // Dot segments, which the url crate would resolve away.
            "zk://a:1/app1/..",
            "zk://a:1/.",
            "zk://a:1/a/../b",
            "zk://a:1/a/%2e%2e/b",
            "redis://a:1/5/..",
            "etcd://a:1/..",
            // Each parameter once.
            "rediss://a:1?server_name=x&server_name=y",
            "redis://a:1?prefix=a:&prefix=b:",
            "etcd://a:1?namespace=/a/&namespace=/b/",
            "redis://a:1?replicas=1&replicas=2",
            // Replicas: a count, on one Redis primary only.
            "redis://a:1?replicas=one",
            "redis://a:1?replicas=-1",
            "redis://a:1?replicas=4294967296",
            "redlock://a:1,b:1,c:1?replicas=1",
            "redis+cluster://a:1?replicas=1",
            "etcd://a:1?replicas=1",
            "zk://a:1?replicas=1",
        ] {
            refused(u);
        }
    }

    #[test]
    fn tls_schemes_and_query_parameters() {
        let u = BackendUrl::parse_with(
            "rediss://a:6380?ca=/etc/ca.pem&cert=/c%20d.pem&key=/k.pem&server_name=redis.internal",
            || None,
        )
        .expect("parses");
        assert!(matches!(u.servers, Servers::Redis { .. }));
        let tls = u.tls.expect("TLS");
        assert_eq!(tls.ca.as_deref(), Some(std::path::Path::new("/etc/ca.pem")));
        assert_eq!(tls.cert.as_deref(), Some(std::path::Path::new("/c d.pem")));
        assert_eq!(tls.key.as_deref(), Some(std::path::Path::new("/k.pem")));
        assert_eq!(tls.server_name.as_deref(), Some("redis.internal"));
        for (url, tls) in [
            ("zks://a:1/app", true),
            ("zk://a:1/app", false),
            ("etcds://a:1", true),
            ("redlocks://a:1,b:1,c:1", true),
            ("rediss+sentinel://a:1/m", true),
            ("redis+sentinel://a:1/m", false),
            ("rediss+cluster://a:1,b:2", true),
            ("redis+cluster://a:1,b:2", false),
        ] {
            let u = BackendUrl::parse_with(url, || None).expect(url);
            assert_eq!(u.tls.is_some(), tls, "{url}");
            // No query: TLS against the system roots.
            if let Some(t) = u.tls {
                assert_eq!(t, TlsOptions::new());
            }
        }
    }

    #[test]
    fn credentials_are_percent_decoded_and_never_shown() {
        let u = BackendUrl::parse_with("etcds://app:p%40ss%3Aw0rd@a:1", || None).expect("parses");
        let c = u.credentials.clone().expect("credentials");
        assert_eq!(c.user.as_deref(), Some("app"));
        assert_eq!(c.password.expose(), "p@ss:w0rd");
        assert!(!format!("{u:?}").contains("w0rd"), "{u:?}");

        let c = BackendUrl::parse_with("redis://:hunter2@a:1", || None)
            .expect("parses")
            .credentials
            .expect("credentials");
        assert_eq!(c.user, None);
        assert_eq!(c.password.expose(), "hunter2");

        // A user without a password takes DLOCK_PASSWORD's value.
        let c = BackendUrl::parse_with("zk://app@a:1/x", || Some("from-env".into()))
            .expect("parses")
            .credentials
            .expect("credentials");
        assert_eq!(c.password.expose(), "from-env");
        assert!(refused("zk://app@a:1/x").contains(PASSWORD_ENV));

        // A password with an unencoded `/`, `?` or `#` is refused and never shown.
        for url in [
            "redis://app:pa/ss@h:6379",
            "etcds://app:se?cret@h:1",
            "redis://:hunter#2@h:1",
            "redis:u:hunter2@h:1",
        ] {
            let e = BackendUrl::parse_with(url, || None).expect_err(url);
            let shown = format!("{e} {e:?}");
            for secret in ["pa/ss", "se?cret", "hunter"] {
                assert!(!shown.contains(secret), "{url}: {shown}");
            }
        }

        // Errors show the URL with the password redacted.
        match BackendUrl::parse_with("redis://app:hunter2@a:1,b:2", || None) {
            Err(e @ Error::InvalidUrl { .. }) => {
                let shown = format!("{e} {e:?}");
                assert!(!shown.contains("hunter2"), "{shown}");
                assert!(shown.contains("redis://app:***@a:1,b:2"), "{shown}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn namespaces_per_backend() {
        let ns = |url: &str| BackendUrl::parse_with(url, || None).expect(url).namespace;
        assert_eq!(ns("redis://a:1?prefix=app1:").as_deref(), Some("app1:"));
        assert_eq!(
            ns("redlocks://a:1,b:1,c:1?prefix=app1:&ca=/x").as_deref(),
            Some("app1:")
        );
        assert_eq!(
            ns("etcd://a:1?namespace=%2Fapp1%2F").as_deref(),
            Some("/app1/")
        );
        assert_eq!(ns("etcd://a:1"), None);
    }

    #[test]
    fn replicas_on_one_redis_primary() {
        let r = |url: &str| BackendUrl::parse_with(url, || None).expect(url).replicas;
        assert_eq!(r("redis://a:1?replicas=2"), 2);
        assert_eq!(r("rediss://a:1/3?replicas=1&ca=/x"), 1);
        assert_eq!(r("redis+sentinel://a:1,b:1,c:1/svc?replicas=1"), 1);
        assert_eq!(r("redis://a:1?replicas=0"), 0);
        assert_eq!(r("redis://a:1"), 0);
    }

    #[test]
    fn redact_in_hides_the_passwords_of_every_url_in_a_message() {
        assert_eq!(
            BackendUrl::redact_in("unrecognized subcommand 'redis://:hunter2@h:1'"),
            "unrecognized subcommand 'redis://:***@h:1'"
        );
        assert_eq!(
            BackendUrl::redact_in("a value \"zk://u:p/w@a:1/c\" for --url: bad, x"),
            "a value \"zk://u:***@a:1/c\" for --url: bad, x"
        );
        assert_eq!(BackendUrl::redact_in("no url here"), "no url here");
        // A password with a space: no part of it shows.
        let shown = BackendUrl::redact_in("a value 'redis://:pa ss@h:1' for --url");
        assert!(!shown.contains("pa") && !shown.contains("ss@"), "{shown}");
        assert_eq!(shown, "a value 'redis://:***@h:1' for --url");
        // Generous: a later word with an `@` is taken as the end of the userinfo.
        assert_eq!(
            BackendUrl::redact_in("'redis://:pa ss@h:1' and x@y"),
            "'redis://:***@y"
        );
        // A `/`, `?` or a quote in the password before the space.
        for (text, shown) in [
            ("'redis://:pa/ss word@h:1'", "'redis://:***@h:1'"),
            ("'redis://u:x@y/z w@h:1'", "'redis://u:***@h:1'"),
            ("'redis://:ab' cd@h:1'", "'redis://:***@h:1'"),
            ("\"redis://:a?b c@h:1\" x", "\"redis://:***@h:1\" x"),
        ] {
            assert_eq!(BackendUrl::redact_in(text), shown, "{text}");
        }
        let shown = BackendUrl::redact_in("'etcd://u:a b c@h:1/x' and zk://h:1");
        assert_eq!(shown, "'etcd://u:***@h:1/x' and zk://h:1");
        // With an `@` before the space too.
        let shown = BackendUrl::redact_in("'redis://u:a@b c@h:1' failed");
        assert_eq!(shown, "'redis://u:***@h:1' failed");
    }

    #[test]
    fn redact_hides_only_the_password() {
        for (url, shown) in [
            ("redis://a:1", "redis://a:1"),
            ("redis://:pw@a:1", "redis://:***@a:1"),
            ("etcds://u:pw@a:1,b:2?ca=/x", "etcds://u:***@a:1,b:2?ca=/x"),
            ("zk://u@a:1/c", "zk://u@a:1/c"),
            ("zk://u:p@w@a:1/c", "zk://u:***@a:1/c"),
            ("not a url", "not a url"),
            // A password with an unencoded `/`, `?` or `#`: hidden all the same.
            ("redis://app:pa/ss@h:6379", "redis://app:***@h:6379"),
            ("etcds://app:se?cret@h:1", "etcds://app:***@h:1"),
            ("redis://:hunter#2@h:1", "redis://:***@h:1"),
            ("redis:u:hunter2@h:1", "***@h:1"),
        ] {
            assert_eq!(BackendUrl::redact(url), shown);
        }
    }
}
