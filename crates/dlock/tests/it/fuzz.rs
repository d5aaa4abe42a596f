//! Bad input at scale: random URLs and random command lines never make dlock panic.
//!
//! The CLI test runs the built `dlock` binary: whatever the argv, it prints help or
//! version and exits 0, or refuses the usage with 64 (`EX_USAGE`) — never 101 (a Rust
//! panic) or a signal. No URL the generator makes can be valid, so no case ever reaches
//! a server and the test needs none.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt as _;
use std::os::unix::process::ExitStatusExt as _;
use std::process::{Command, Stdio};

use proptest::prelude::*;

/// Words the parser knows, so random argv reach deep into clap and into dlock's own
/// checks instead of failing on the first word.
const WORDS: &[&str] = &[
    "exec",
    "multi",
    "status",
    "--url",
    "--timeout",
    "--read",
    "--write",
    "--permits",
    "--non-reentrant",
    "--json",
    "--session-timeout",
    "--connect-timeout",
    "--",
    "-",
    "0",
    "1s",
    "-1s",
    "500ms",
    "99999999999999999999s",
    "4294967296",
    "zk://",
    "redis://a:1,b:2",
    "redlock://a:1",
    "etcd://a:1/x",
    "zk://host",
    "ftp://a:1",
    "orders/42",
    "a//b",
    "..",
    "zookeeper/x",
    "{x}",
    "true",
    "sh",
    "-c",
];

/// Anything but a valid URL: a generated string never contains `://` followed by a
/// well-formed `host:port`, because it never contains `:` at all (nor NUL, which no
/// argv can carry).
fn garbage() -> impl Strategy<Value = OsString> {
    prop_oneof![
        "[^:\\x00]{0,12}".prop_map(OsString::from),
        prop::collection::vec(
            any::<u8>().prop_filter("no colon", |b| *b != b':' && *b != 0),
            0..12
        )
        .prop_map(OsString::from_vec),
    ]
}

fn arg() -> impl Strategy<Value = OsString> {
    prop_oneof![
        3 => prop::sample::select(WORDS).prop_map(OsString::from),
        2 => garbage(),
    ]
}

fn helpish(argv: &[OsString]) -> bool {
    argv.iter().any(|a| {
        let a = a.to_string_lossy();
        ["-h", "--help", "help", "-V", "--version"].contains(&a.as_ref())
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn garbage_argv_exits_64_or_shows_help(argv in prop::collection::vec(
        prop_oneof![9 => arg(), 1 => prop::sample::select(&["-h", "--help", "help", "-V"][..]).prop_map(OsString::from)],
        0..8,
    )) {
        let out = Command::new(crate::support::dlock_bin())
            .args(&argv)
            .env_remove("DLOCK_URL")
            .env_remove("DLOCK_LOG")
            .stdin(Stdio::null())
            .output()
            .expect("the dlock binary runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        prop_assert!(out.status.signal().is_none(), "killed by a signal: {argv:?}\n{stderr}");
        prop_assert!(!stderr.contains("panicked"), "panic for {argv:?}:\n{stderr}");
        match out.status.code() {
            Some(64) => prop_assert!(stderr.starts_with("dlock: "), "unclear message for {argv:?}: {stderr}"),
            Some(0) => prop_assert!(helpish(&argv), "exit 0 without help for {argv:?}"),
            other => prop_assert!(false, "exit {other:?} for {argv:?}:\n{stderr}"),
        }
    }

    /// Any string is a URL or a typed `InvalidUrl`; never a panic.
    #[test]
    fn any_url_parses_or_is_refused(s in prop_oneof![
        any::<String>(),
        (prop::sample::select(&["zk", "etcd", "redis", "redlock", "zookeeper", "http", ""][..]),
         prop::collection::vec("[a-z0-9.\\[\\]:_-]{0,10}", 0..5),
         prop::option::of("/[a-z/.]{0,10}"))
            .prop_map(|(scheme, hosts, path)| format!("{scheme}://{}{}", hosts.join(","), path.unwrap_or_default())),
    ]) {
        match dlock::BackendUrl::parse(&s) {
            Ok(_) => {}
            Err(dlock::Error::InvalidUrl { url, reason }) => {
                prop_assert_eq!(url, dlock::BackendUrl::redact(&s));
                prop_assert!(!reason.is_empty());
            }
            Err(other) => prop_assert!(false, "unexpected error {other:?}"),
        }
    }
}

/// Every well-formed URL of every scheme parses, whatever its hosts and ports.
#[test]
fn generated_valid_urls_parse() {
    let mut runner = proptest::test_runner::TestRunner::default();
    runner
        .run(
            &(
                prop::collection::vec(("[a-z][a-z0-9.-]{0,10}", 1u16..=65535), 3..6),
                prop::option::of("(/[a-z0-9_]{1,6}){1,3}"),
            ),
            |(hosts, chroot)| {
                let list = hosts
                    .iter()
                    .map(|(h, p)| format!("{h}:{p}"))
                    .collect::<Vec<_>>()
                    .join(",");
                for url in [
                    format!("zk://{list}{}", chroot.clone().unwrap_or_default()),
                    format!("etcd://{list}"),
                    format!("redis://{}", list.split(',').next().unwrap_or_default()),
                    format!("redlock://{list}"),
                ] {
                    prop_assert!(dlock::BackendUrl::parse(&url).is_ok(), "{url}");
                }
                Ok(())
            },
        )
        .expect("every generated URL parses");
}
