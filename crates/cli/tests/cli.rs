//! The `dlock` binary without a server: its help, version, and the typed refusals of bad
//! input (exit 64, a `dlock: ` message, no password in it). Its behaviour against real
//! servers is tested by the `dlock` crate's integration suite, which runs this binary.

use std::process::Command;

fn dlock() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_dlock"));
    c.env_remove("DLOCK_URL").env_remove("DLOCK_PASSWORD");
    c
}

#[test]
fn help_and_version() {
    let out = dlock().arg("--help").output().expect("runs");
    assert_eq!(out.status.code(), Some(0));
    let help = String::from_utf8_lossy(&out.stdout);
    for cmd in ["exec", "multi", "status", "revoke"] {
        assert!(help.contains(cmd), "--help lists {cmd}: {help}");
    }
    let out = dlock().arg("--version").output().expect("runs");
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("dlock "));
}

#[test]
fn bad_input_exits_64_without_showing_the_password() {
    for (url, why) in [
        (None, "no URL"),
        (Some("ftp://app:s3cret-pw@h:1"), "unknown scheme"),
        (
            Some("redis://app:s3cret-pw@h:1?ca=/x"),
            "TLS parameter on a plain scheme",
        ),
        (
            Some("rediss://app:s3cret-pw@h:1?cert=/c"),
            "cert without key",
        ),
    ] {
        let mut c = dlock();
        if let Some(url) = url {
            c.env("DLOCK_URL", url);
        }
        let out = c.args(["status", "x"]).output().expect("runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{why}: {stderr}");
        assert!(stderr.starts_with("dlock: "), "{why}: {stderr}");
        assert!(
            !stderr.contains("s3cret-pw"),
            "{why}: the password leaked: {stderr}"
        );
    }
}
