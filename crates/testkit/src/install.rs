//! Installing the server packages on a Debian machine when they are missing.

use std::path::Path;
use std::process::{Command, Stdio};

use crate::config::{NETTY_CODEC_JAR, ZK_JAR};
use crate::error::io_ctx;
use crate::{Error, Result};

/// The Debian packages that provide every server, client and jar the tests use.
pub const APT_PACKAGES: &[&str] = &[
    "zookeeper",
    "etcd-server",
    "etcd-client",
    "redis-server",
    "redis-tools",
    "protobuf-compiler",
    "libcurator-recipes-java",
    "libslf4j-java",
    // netty-codec.jar: ZooKeeper's TLS client port (secured clusters). zookeeper already
    // pulls it in; named so the jar's source is on record.
    "libnetty-java",
    // `nft`: server-side partitions ([`crate::NetCut`]).
    "nftables",
];

// `javac`: the Curator interop tests compile their Curator peer at run time.
const PROGRAMS: &[&str] = &[
    "java",
    "javac",
    "etcd",
    "etcdctl",
    "redis-server",
    "redis-cli",
    "protoc",
    "nft",
];
const FILES: &[&str] = &[
    ZK_JAR,
    "/usr/share/java/curator-recipes.jar",
    NETTY_CODEC_JAR,
];

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|paths| {
        std::env::split_paths(&paths).any(|dir| {
            let candidate = dir.join(program);
            candidate.is_file()
                && std::fs::metadata(&candidate)
                    .map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o111 != 0)
                    .unwrap_or(false)
        })
    })
}

/// The programs (looked up on `PATH`) and files the test servers need that are missing.
pub fn missing_prerequisites() -> Vec<String> {
    let mut missing: Vec<String> = PROGRAMS
        .iter()
        .filter(|p| !on_path(p))
        .map(|p| p.to_string())
        .collect();
    missing.extend(
        FILES
            .iter()
            .filter(|f| !Path::new(f).exists())
            .map(|f| f.to_string()),
    );
    missing
}

fn run(program: &str, args: &[&str]) -> Result<()> {
    let command = format!("{program} {}", args.join(" "));
    let status = Command::new(program)
        .args(args)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null())
        .status()
        .map_err(io_ctx(format!("running {command}")))?;
    if status.success() {
        Ok(())
    } else {
        Err(Error::Command {
            command,
            detail: status.to_string(),
        })
    }
}

/// Makes sure every server package is installed, installing with apt-get when not.
///
/// Returns `Ok(false)` when everything was already there (no command run), `Ok(true)` after
/// one `apt-get update` and one `apt-get install -y` of [`APT_PACKAGES`] (plus
/// `default-jdk-headless` when `java` or `javac` is missing). Fails when apt-get fails or something is
/// still missing afterwards.
pub fn ensure_installed() -> Result<bool> {
    let missing = missing_prerequisites();
    if missing.is_empty() {
        return Ok(false);
    }
    eprintln!("dlock-testkit: missing {missing:?}; installing with apt-get");
    run("apt-get", &["update"])?;
    let mut args = vec!["install", "-y"];
    args.extend_from_slice(APT_PACKAGES);
    if missing.iter().any(|m| m == "java" || m == "javac") {
        args.push("default-jdk-headless");
    }
    run("apt-get", &args)?;
    let still = missing_prerequisites();
    if still.is_empty() {
        Ok(true)
    } else {
        Err(Error::Command {
            command: "apt-get install".into(),
            detail: format!("still missing after install: {still:?}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_program_that_exists_and_not_one_that_does_not() {
        assert!(on_path("sh"));
        assert!(!on_path("dlock-no-such-program-xyz"));
    }
}
