//! The `dlock` binary, driven as a user's scripts drive it: real OS processes.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::support::{
    client, dlock, dlock_exec_true, eventually, leftovers, tempdir, unique, Kind, SESSION_TIMEOUT,
};

/// 8 OS processes x `sections` critical sections through `dlock exec` on one name: each
/// appends start/end lines with its token to a shared file; no interleaving, tokens
/// strictly increasing.
pub async fn cli_processes_never_overlap(kind: Kind, url: &str) {
    let sections: usize = match kind {
        Kind::Zk => 50,
        _ => 25,
    };
    let name = unique("cli");
    let dir = tempdir("cli");
    let log = dir.join("log");
    let script = "echo \"start $DLOCK_TOKEN $$\" >> \"$1\"; echo \"end $DLOCK_TOKEN $$\" >> \"$1\"";
    let mut workers = Vec::new();
    for _ in 0..8 {
        let (url, name, log) = (url.to_owned(), name.clone(), log.clone());
        let session = SESSION_TIMEOUT;
        workers.push(tokio::task::spawn_blocking(move || {
            for _ in 0..sections {
                let st = dlock()
                    .args([
                        "--url",
                        &url,
                        "--session-timeout",
                        &format!("{}s", session.as_secs()),
                    ])
                    .args([
                        "exec",
                        &name,
                        "--timeout",
                        "120s",
                        "--",
                        "sh",
                        "-c",
                        script,
                        "sh",
                    ])
                    .arg(&log)
                    .status()
                    .expect("run dlock");
                assert!(st.success(), "dlock exec failed: {st:?}");
            }
        }));
    }
    for w in workers {
        w.await.expect("worker");
    }
    let text = std::fs::read_to_string(&log).expect("log");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 8 * sections * 2);
    let mut last_token = 0u64;
    for pair in lines.chunks(2) {
        let s: Vec<&str> = pair[0].split(' ').collect();
        let e: Vec<&str> = pair[1].split(' ').collect();
        assert_eq!(
            (s[0], e[0]),
            ("start", "end"),
            "interleaved sections: {pair:?}"
        );
        assert_eq!(
            s[1..],
            e[1..],
            "a section ended by another holder: {pair:?}"
        );
        let t: u64 = s[1].parse().expect("token");
        // Redlock's tokens are documented as not safe fencing tokens (independent masters
        // agree on no total order of grants); every other backend's must grow.
        if !matches!(kind, Kind::Redlock) {
            assert!(t > last_token, "token {t} after {last_token}");
        }
        last_token = t;
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The documented exit codes: 75 timed out, 69 unreachable, 64 bad input; the command's
/// own code otherwise.
pub async fn cli_exit_codes(kind: Kind, url: &str) {
    let name = unique("codes");
    let c = client(url).await;
    let code = |args: &[&str]| dlock().args(args).output().expect("run").status.code();
    assert_eq!(
        code(&["--url", url, "exec", &name, "--", "sh", "-c", "exit 7"]),
        Some(7)
    );
    let mut g = c.mutex(&name).expect("n").lock().await.expect("lock");
    assert_eq!(
        dlock_exec_true(url, &name, "500ms")
            .status()
            .expect("run dlock")
            .code(),
        Some(75)
    );
    // A zero timeout and --try ask once: 75 at once on a held lock...
    for wait in [&["--timeout", "0"][..], &["--try"][..]] {
        let mut args = vec!["--url", url, "exec", name.as_str()];
        args.extend_from_slice(wait);
        args.extend_from_slice(&["--", "true"]);
        assert_eq!(code(&args), Some(75), "{wait:?} on a held lock");
    }
    let multi_try = code(&["--url", url, "multi", &name, "--try", "--", "true"]);
    assert_eq!(multi_try, Some(75), "multi --try on a held lock");
    g.release().await.expect("release");
    // ...and take a free one, running the command.
    for (wait, exit) in [
        (&["--timeout", "0"][..], "exit 3"),
        (&["--try"][..], "exit 4"),
    ] {
        let mut args = vec!["--url", url, "exec", name.as_str()];
        args.extend_from_slice(wait);
        args.extend_from_slice(&["--", "sh", "-c", exit]);
        let want = exit.trim_start_matches("exit ").parse::<i32>().ok();
        assert_eq!(code(&args), want, "{wait:?} on a free lock");
    }
    assert_eq!(
        code(&["--url", url, "multi", &name, "--try", "--", "sh", "-c", "exit 5"]),
        Some(5),
        "multi --try on a free lock"
    );
    assert_eq!(code(&["--url", url, "exec", "", "--", "true"]), Some(64));
    // `multi`'s DLOCK_TOKEN is `name=token,...`: names with `,` or `=` are refused.
    for odd in ["a,b", "a=1"] {
        let odd_name = format!("{name}/{odd}");
        assert_eq!(
            code(&["--url", url, "multi", &odd_name, "--", "true"]),
            Some(64),
            "multi {odd_name}"
        );
    }
    // A huge duration is a usage error, not a panic (exit 101).
    assert_eq!(
        code(&[
            "--url",
            url,
            "exec",
            &name,
            "--timeout",
            "18446744073709551615s",
            "--",
            "true"
        ]),
        Some(64)
    );
    assert_eq!(
        code(&["--url", url, "exec", "a\u{1}b", "--", "true"]),
        Some(64)
    );
    assert_eq!(
        code(&["--url", url, "exec", &name, "--permits", "0", "--", "true"]),
        Some(64)
    );
    assert_eq!(
        code(&["--url", url, "exec", &name, "--bogus", "--", "true"]),
        Some(64)
    );
    assert_eq!(
        code(&["--url", "nope://x", "exec", &name, "--", "true"]),
        Some(64)
    );
    assert_eq!(code(&["exec", &name, "--", "true"]), Some(64));
    assert_eq!(
        code(&["--url", url, "exec", &name, "--", "/nonexistent/cmd"]),
        Some(127)
    );
    let unreachable = match kind {
        Kind::Zk => "zk://127.0.0.1:1",
        Kind::Etcd => "etcd://127.0.0.1:1",
        Kind::Redis => "redis://127.0.0.1:1",
        Kind::Redlock => "redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3",
        Kind::RedisSentinel => "redis+sentinel://127.0.0.1:1,127.0.0.1:2/mymaster",
        Kind::RedisCluster => "redis+cluster://127.0.0.1:1,127.0.0.1:2",
        Kind::Mem => panic!("the CLI tests need a real server: they are not instantiated on mem"),
    };
    assert_eq!(
        code(&[
            "--url",
            unreachable,
            "--connect-timeout",
            "1s",
            "exec",
            &name,
            "--",
            "true"
        ]),
        Some(69)
    );
    // One-line messages on stderr, never a panic.
    let out = dlock()
        .args(["--url", url, "exec", "", "--", "true"])
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(!err.contains("panicked"));
    assert!(
        eventually(Duration::from_secs(30), || async {
            leftovers(&c, &name).await == 0
        })
        .await
    );
    c.close().await.expect("close");
}

/// SIGKILL of the process holding the lock frees it within the session timeout.
pub async fn cli_sigkill_frees_the_lock(_kind: Kind, url: &str) {
    let name = unique("kill");
    let dir = crate::support::tempdir("kill");
    let pidfile = dir.join("child.pid");
    let mut holder = crate::faults::spawn_exec(
        &["--url", url, "--session-timeout", "2s", "exec", &name],
        crate::faults::RECORD_PID_AND_SLEEP,
        &[&pidfile],
        &dir.join("dlock.err"),
    );
    let c = client(url).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            c.participants(&name)
                .await
                .map(|p| p.iter().any(|x| x.holds))
                .unwrap_or(false)
        })
        .await,
        "holder never acquired"
    );
    // SIGKILL the holder's whole process group: dlock and its `sleep` child die at once,
    // as in a machine crash; nothing releases the lock but the session's end.
    let child_pid = crate::faults::recorded_pid(&pidfile).await;
    // dlock's command, in a process group of its own, outlives the SIGKILL below.
    let _command = crate::faults::Orphan::new(child_pid);
    let pgid = holder.0.id();
    let st = Command::new("kill")
        .args(["-KILL", "--", &format!("-{pgid}")])
        .status()
        .expect("kill");
    assert!(st.success());
    let _ = holder.0.wait();
    // Acquired after the holder's session ends: within the session timeout plus slack.
    let mut g = c
        .mutex(&name)
        .expect("n")
        .lock_timeout(Duration::from_secs(30))
        .await
        .expect("the dead holder's lock freed itself");
    g.release().await.expect("release");
    c.close().await.expect("close");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `dlock status` lists holders and waiters in queue order, as text and JSON.
pub async fn cli_status_shows_queue(kind: Kind, url: &str) {
    let name = unique("status");
    let c = client(url).await;
    let out = dlock()
        .args(["--url", url, "status", &name])
        .output()
        .expect("run");
    assert!(String::from_utf8_lossy(&out.stdout).contains("free"));
    assert_eq!(out.status.code(), Some(3), "status of a free lock");
    let mut g = c.mutex(&name).expect("n").lock().await.expect("lock");
    let waiter = client(url).await;
    let m = waiter.mutex(&name).expect("n");
    let pending = tokio::spawn(async move {
        let r = m.lock_timeout(Duration::from_secs(60)).await;
        (r.map(|mut g| async move { g.release().await }), waiter)
    });
    assert!(
        eventually(Duration::from_secs(30), || async {
            leftovers(&c, &name).await == 2
        })
        .await
    );
    let out = dlock()
        .args(["--url", url, "status", &name, "--json"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(0));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let parts = doc["participants"].as_array().expect("array");
    assert_eq!(parts.len(), 2);
    assert_eq!(parts[0]["state"], "holder");
    assert_eq!(parts[1]["state"], "waiter");
    assert_eq!(parts[0]["token"].as_u64(), Some(g.token().get()));
    // On a Redis Cluster the master of the lock's slot, one of the cluster's nodes;
    // elsewhere nothing (every lock is served alike).
    let node = doc["node"].as_str().map(str::to_owned);
    if kind == Kind::RedisCluster {
        let node = node.as_deref().expect("the serving node on a cluster");
        let (addr, slot) = node.split_once(" (slot ").expect("host:port (slot N)");
        assert!(url.contains(addr), "{addr} is a node of {url}");
        let slot: u16 = slot.trim_end_matches(')').parse().expect("slot number");
        assert_eq!(
            slot,
            dlock_testkit::key_slot(&format!("dlock:{{{name}}}:q"))
        );
    } else {
        assert_eq!(node, None, "no serving node off a cluster");
    }
    let text = dlock()
        .args(["--url", url, "status", &name])
        .output()
        .expect("run");
    let text = String::from_utf8_lossy(&text.stdout);
    let mut lines = text.lines();
    if kind == Kind::RedisCluster {
        let served = lines.next().unwrap_or_default();
        assert!(served.starts_with("served by "), "{text}");
    }
    let rows: Vec<&str> = lines.skip(1).collect();
    assert!(
        rows[0].starts_with("holder") && rows[1].starts_with("waiter"),
        "{text}"
    );
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").expect("hostname");
    let owner = format!("dlock pid={} host={}", std::process::id(), host.trim());
    assert!(rows[0].ends_with(&owner), "owner {owner:?} in {text}");
    g.release().await.expect("release");
    let (r, waiter) = pending.await.expect("waiter");
    r.expect("waiter acquired").await.expect("release");
    waiter.close().await.expect("close");
    c.close().await.expect("close");
}

/// `dlock list PREFIX` names the locks with holders or waiters under PREFIX, as a table
/// and as JSON; none is success with no table and `[]`; a bad prefix exits 64.
pub async fn cli_list_shows_locks(_kind: Kind, url: &str) {
    let base = unique("cli-list");
    let prefix = format!("{base}/");
    let run = |args: &[&str]| {
        let out = dlock()
            .args(["--url", url, "list"])
            .args(args)
            .output()
            .expect("run");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    assert_eq!(run(&[&prefix]), (Some(0), String::new()), "nothing held");
    assert_eq!(run(&[&prefix, "--json"]), (Some(0), "[]\n".to_owned()));
    assert_eq!(run(&["a//b"]).0, Some(64), "a prefix no name starts with");

    let (a, b) = (format!("{base}/a"), format!("{base}/b b"));
    let c = client(url).await;
    let mut ga = c.mutex(&a).expect("n").lock().await.expect("lock");
    let mut gb = c.mutex(&b).expect("n").lock().await.expect("lock");
    let waiter = client(url).await;
    let m = waiter.mutex(&b).expect("n");
    let pending = tokio::spawn(async move {
        let r = m.lock_timeout(Duration::from_secs(60)).await;
        (r.map(|mut g| async move { g.release().await }), waiter)
    });
    assert!(
        eventually(Duration::from_secs(30), || async {
            leftovers(&c, &b).await == 2
        })
        .await
    );
    let (code, json) = run(&[&prefix, "--json"]);
    assert_eq!(code, Some(0));
    let doc: serde_json::Value = serde_json::from_str(&json).expect("json");
    assert_eq!(
        doc,
        serde_json::json!([
            {"name": a, "kind": "mutex", "holders": 1, "waiters": 0, "entries": 1},
            {"name": b, "kind": "mutex", "holders": 1, "waiters": 1, "entries": 2},
        ])
    );
    let (code, text) = run(&[&prefix]);
    assert_eq!(code, Some(0));
    let lines: Vec<String> = text
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    assert_eq!(
        lines,
        [
            "holders waiters kind name".to_owned(),
            format!("1 0 mutex {a}"),
            format!("1 1 mutex {b}"),
        ],
        "{text}"
    );
    ga.release().await.expect("release");
    gb.release().await.expect("release");
    let (r, waiter) = pending.await.expect("waiter");
    r.expect("waiter acquired").await.expect("release");
    waiter.close().await.expect("close");
    assert_eq!(run(&[&prefix]), (Some(0), String::new()), "all released");
    c.close().await.expect("close");
}

/// `dlock elect` runs its command only while leading, with the term and value in its
/// environment; `dlock leader` names that leader (text and JSON, exit 0) and says when
/// nobody leads (exit 3); a second candidate with a timeout exits 75; `leader --watch`
/// prints the leader and then its resignation.
pub async fn cli_elect_and_leader(_kind: Kind, url: &str) {
    let name = unique("elect-cli");
    let dir = tempdir("elect-cli");
    let (seen, gate) = (dir.join("seen"), dir.join("gate"));
    let leader = |extra: &[&str]| {
        dlock()
            .args(["--url", url, "leader", &name])
            .args(extra)
            .output()
            .expect("run")
    };
    let none = leader(&[]);
    assert_eq!(none.status.code(), Some(3), "nobody leads yet: {none:?}");
    assert_eq!(
        String::from_utf8_lossy(&none.stdout).trim(),
        format!("{name}: no leader")
    );
    let none: serde_json::Value =
        serde_json::from_slice(&leader(&["--json"]).stdout).expect("json");
    assert_eq!(
        none,
        serde_json::json!({ "name": name, "value": null, "term": null })
    );

    let script = format!(
        "echo \"$DLOCK_NAME $DLOCK_TERM $DLOCK_VALUE\" > {}; while [ ! -e {} ]; do sleep 0.05; done",
        seen.display(),
        gate.display()
    );
    let mut first = dlock()
        .args(["--url", url, "elect", &name, "--value", "node-1", "--"])
        .args(["sh", "-c", &script])
        .spawn()
        .expect("spawn");
    assert!(
        eventually(Duration::from_secs(30), || async { seen.exists() }).await,
        "the first candidate never led"
    );
    let line = eventually_read(&seen).await;
    let fields: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(fields.len(), 3, "{line:?}");
    assert_eq!((fields[0], fields[2]), (name.as_str(), "node-1"));
    let term: u64 = fields[1].parse().expect("DLOCK_TERM is a number");

    let now = leader(&["--json"]);
    assert_eq!(now.status.code(), Some(0), "{now:?}");
    let now: serde_json::Value = serde_json::from_slice(&now.stdout).expect("json");
    assert_eq!(
        now,
        serde_json::json!({ "name": name, "value": "node-1", "term": term })
    );
    let text = leader(&[]);
    assert_eq!(
        String::from_utf8_lossy(&text.stdout).trim(),
        format!("{name}: node-1 (term {term})")
    );
    let second = dlock()
        .args(["--url", url, "elect", &name, "--value", "node-2"])
        .args(["--timeout", "300ms", "--", "true"])
        .output()
        .expect("run");
    assert_eq!(second.status.code(), Some(75), "{second:?}");

    let mut watch = dlock()
        .args(["--url", url, "leader", &name, "--watch", "--json"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut lines = {
        use std::io::BufRead;
        std::io::BufReader::new(watch.stdout.take().expect("stdout")).lines()
    };
    let next = |lines: &mut std::io::Lines<_>| -> serde_json::Value {
        let l: String = lines
            .next()
            .expect("a line from --watch")
            .expect("readable");
        serde_json::from_str(&l).expect("json")
    };
    assert_eq!(
        next(&mut lines)["value"],
        "node-1",
        "--watch starts with the leader"
    );
    std::fs::write(&gate, b"").expect("open the gate");
    let status = tokio::task::spawn_blocking(move || first.wait())
        .await
        .expect("join")
        .expect("wait");
    assert_eq!(
        status.code(),
        Some(0),
        "elect exits with its command's code"
    );
    assert_eq!(
        next(&mut lines),
        serde_json::json!({ "name": name, "value": null, "term": null }),
        "--watch prints the resignation"
    );
    let _ = watch.kill();
    let _ = watch.wait();
    let after = leader(&[]);
    assert_eq!(after.status.code(), Some(3), "{after:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The first line of `path`, once the writer has finished it.
async fn eventually_read(path: &std::path::Path) -> String {
    let mut text = String::new();
    let done = eventually(Duration::from_secs(10), || {
        let t = std::fs::read_to_string(path).unwrap_or_default();
        let ready = t.ends_with('\n');
        if ready {
            text = t;
        }
        async move { ready }
    })
    .await;
    assert!(done, "{} never got its line", path.display());
    text.trim().to_owned()
}
