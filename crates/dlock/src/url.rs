//! Backend URLs: `zk://`, `etcd://`, `redis://`, `redlock://`, `redis+sentinel://`.

use dlock_core::Error;

/// A parsed backend URL.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BackendUrl {
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
}

impl BackendUrl {
    /// Parses a backend URL.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] saying what is wrong.
    pub fn parse(url: &str) -> Result<Self, Error> {
        let bad = |reason: &str| Error::InvalidUrl {
            url: url.to_owned(),
            reason: reason.to_owned(),
        };
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| bad("expected scheme://host:port, e.g. zk://127.0.0.1:2181"))?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], Some(&rest[i..])),
            None => (rest, None),
        };
        let hosts: Vec<String> = authority.split(',').map(str::to_owned).collect();
        for h in &hosts {
            check_host(h).map_err(|r| bad(&r))?;
        }
        let path = path.filter(|p| !p.trim_matches('/').is_empty());
        match scheme {
            "zk" | "zookeeper" => {
                let chroot = match path {
                    Some(p) => {
                        let p = p.trim_end_matches('/');
                        if p.split('/')
                            .skip(1)
                            .any(|s| s.is_empty() || s == "." || s == "..")
                            || p.bytes().any(|b| b.is_ascii_control())
                        {
                            return Err(bad("the chroot must be a plain path like /app/locks"));
                        }
                        Some(p.to_owned())
                    }
                    None => None,
                };
                Ok(BackendUrl::ZooKeeper { hosts, chroot })
            }
            "etcd" => {
                if path.is_some() {
                    return Err(bad("etcd URLs take no path"));
                }
                Ok(BackendUrl::Etcd { hosts })
            }
            "redis" => {
                if path.is_some_and(|p| p.trim_matches('/') != "0") {
                    return Err(bad("redis URLs take no path (database 0 only)"));
                }
                match <[String; 1]>::try_from(hosts) {
                    Ok([host]) => Ok(BackendUrl::Redis { host }),
                    Err(_) => Err(bad(
                        "redis:// takes one host; use redlock:// for several independent masters",
                    )),
                }
            }
            "redlock" => {
                if path.is_some() {
                    return Err(bad("redlock URLs take no path"));
                }
                if hosts.len() < 3 {
                    return Err(bad("redlock:// needs at least 3 independent masters"));
                }
                Ok(BackendUrl::Redlock { hosts })
            }
            "redis+sentinel" => {
                let service = path
                    .map(|p| p.trim_matches('/'))
                    .ok_or_else(|| bad("redis+sentinel:// needs the service name: redis+sentinel://h:p,h:p,h:p/mymaster"))?;
                if !service
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                {
                    return Err(bad(
                        "the Sentinel service name takes letters, digits, '-', '_' and '.' only",
                    ));
                }
                Ok(BackendUrl::RedisSentinel {
                    sentinels: hosts,
                    service: service.to_owned(),
                })
            }
            other => Err(bad(&format!(
                "unknown scheme {other:?}: use zk://, etcd://, redis://, redlock:// or redis+sentinel://"
            ))),
        }
    }
}

fn check_host(h: &str) -> Result<(), String> {
    let (host, port) = h
        .rsplit_once(':')
        .ok_or_else(|| format!("{h:?} is not host:port"))?;
    if host.is_empty()
        || !host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | '[' | ']' | ':'))
    {
        return Err(format!("{h:?} has no valid host"));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => Err(format!("{h:?} has no valid port")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_scheme() {
        assert_eq!(
            BackendUrl::parse("zk://127.0.0.1:2181,127.0.0.1:2182/app").expect("zk"),
            BackendUrl::ZooKeeper {
                hosts: vec!["127.0.0.1:2181".into(), "127.0.0.1:2182".into()],
                chroot: Some("/app".into())
            }
        );
        assert_eq!(
            BackendUrl::parse("zk://localhost:2181/").expect("zk"),
            BackendUrl::ZooKeeper {
                hosts: vec!["localhost:2181".into()],
                chroot: None
            }
        );
        assert!(matches!(
            BackendUrl::parse("etcd://a:2379,b:2379"),
            Ok(BackendUrl::Etcd { .. })
        ));
        assert!(matches!(
            BackendUrl::parse("redis://a:6379"),
            Ok(BackendUrl::Redis { .. })
        ));
        assert!(matches!(
            BackendUrl::parse("redlock://a:1,b:2,c:3"),
            Ok(BackendUrl::Redlock { .. })
        ));
        assert_eq!(
            BackendUrl::parse("redis+sentinel://127.0.0.1:6393,127.0.0.1:6394/mymaster")
                .expect("sentinel"),
            BackendUrl::RedisSentinel {
                sentinels: vec!["127.0.0.1:6393".into(), "127.0.0.1:6394".into()],
                service: "mymaster".into()
            }
        );
        for bad in [
            "redis+sentinel://127.0.0.1:6393",
            "redis+sentinel://127.0.0.1:6393/",
            "redis+sentinel://127.0.0.1:6393/a/b",
            "redis+sentinel://127.0.0.1:6393/my master",
            "redis+sentinel://127.0.0.1/mymaster",
        ] {
            assert!(
                matches!(BackendUrl::parse(bad), Err(Error::InvalidUrl { .. })),
                "{bad} must be rejected"
            );
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
        ] {
            assert!(
                matches!(BackendUrl::parse(u), Err(Error::InvalidUrl { .. })),
                "{u:?} should be rejected"
            );
        }
    }
}
