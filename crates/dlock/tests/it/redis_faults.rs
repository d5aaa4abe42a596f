//! Redis faults the shared suite cannot stage: the server losing a lock's keys while a
//! waiter waits.

use std::process::Command;
use std::time::Duration;

use dlock::{Error, SessionOptions};

use crate::support::{client, eventually, leftovers, unique};

/// Runs `redis-cli` against the server of `url` (`redis://host:port`).
pub(crate) fn redis_cli(url: &str, args: &[&str]) -> String {
    let addr = url.strip_prefix("redis://").unwrap_or(url);
    let (host, port) = addr.rsplit_once(':').expect("redis://host:port");
    let out = Command::new("redis-cli")
        .args(["-h", host, "-p", port])
        .args(args)
        .output()
        .expect("redis-cli runs");
    assert!(out.status.success(), "redis-cli {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Deletes every key of the lock `name` on the server of `url` at once, with nothing
/// published (as a restart without persistence leaves it); returns how many went.
fn wipe_lock(url: &str, name: &str) -> String {
    redis_cli(
        url,
        &[
            "EVAL",
            "local n = 0 for _, k in ipairs(redis.call('KEYS', ARGV[1])) do n = n + redis.call('DEL', k) end return n",
            "0",
            &format!("dlock:{{{name}}}:*"),
        ],
    )
}

/// A waiter whose own entry the server lost never takes the lock from the view it had
/// before the loss: it lists the queue again, finds its entry gone and fails with
/// `LockLost`, so it cannot hold beside a newcomer that queued into the emptied lock.
///
/// The loss is staged as a restart without persistence would leave the lock: every key
/// of the lock deleted at once, with no removal published; the waiter's subscriber
/// connection is then cut, and its reconnect wakes every waiter to re-check. The waiter's
/// session is long, so its watchdog (every lease/3) does not notice its own entry's loss
/// first.
pub async fn waiter_whose_entry_was_wiped_never_grants_itself(url: &str) {
    let name = unique("wiped");
    let a = client(url).await;
    let b = long_session(url).await;
    let _held = a.mutex(&name).expect("name").lock().await.expect("lock");
    let mb = b.mutex(&name).expect("name");
    let waiter = tokio::spawn(async move { mb.lock().await });
    assert!(
        eventually(Duration::from_secs(20), || async {
            leftovers(&a, &name).await == 2
        })
        .await,
        "the waiter queued"
    );

    let wiped = wipe_lock(url, &name);
    assert!(
        wiped.trim().parse::<u32>().is_ok_and(|n| n >= 2),
        "both entries and the queue were deleted: {wiped}"
    );
    redis_cli(url, &["CLIENT", "KILL", "TYPE", "pubsub"]);

    let woke = tokio::time::timeout(Duration::from_secs(30), waiter)
        .await
        .expect("the waiter re-checks after its subscriber reconnects")
        .expect("join");
    match woke {
        Ok(g) => panic!(
            "the waiter took the lock with no entry of its own on the server (verify: {:?})",
            g.verify().await
        ),
        Err(e) => assert!(matches!(e, Error::LockLost(_)), "{e:?}"),
    }
    assert_eq!(leftovers(&a, &name).await, 0, "nothing is left of the lock");
    a.close().await.expect("close");
    b.close().await.expect("close");
}

/// A waiter whose entry *key* alone is deleted from outside (`redis-cli DEL`, its member
/// left in the queue) never holds: the holder's release finds no key behind the member
/// and names no entry behind it (`removed head`, not `removed head <name>`), so the
/// waiter looks its entry up, finds it gone and fails with `LockLost`. (A newcomer would
/// list the queue and drop the keyless member first; here nobody else lists it.)
pub async fn waiter_whose_entry_key_was_deleted_never_holds(url: &str) {
    let name = unique("keygone");
    let a = client(url).await;
    let b = long_session(url).await;
    let mut held = a.mutex(&name).expect("name").lock().await.expect("lock");
    let mb = b.mutex(&name).expect("name");
    let waiter = tokio::spawn(async move { mb.lock().await.map(|g| g.token().get()) });
    let queue = format!("dlock:{{{name}}}:q");
    // Raw reads: a listing through dlock would drop the keyless member itself.
    assert!(
        eventually(Duration::from_secs(20), || async {
            redis_cli(url, &["ZCARD", &queue]).trim() == "2"
        })
        .await,
        "the waiter queued"
    );
    let members = redis_cli(url, &["ZRANGE", &queue, "1", "1"]);
    let key = format!("dlock:{{{name}}}:e:{}", members.trim());
    let deleted = redis_cli(url, &["DEL", &key]);
    assert_eq!(
        deleted.trim(),
        "1",
        "the waiter's entry key {key} was deleted"
    );
    held.release().await.expect("release");
    let woke = tokio::time::timeout(Duration::from_secs(30), waiter)
        .await
        .expect("the waiter woke")
        .expect("join");
    assert!(
        matches!(woke, Err(Error::LockLost(_))),
        "a waiter whose entry key was deleted took the lock: {woke:?}"
    );
    assert_eq!(leftovers(&a, &name).await, 0, "nothing is left of the lock");
    a.close().await.expect("close");
    b.close().await.expect("close");
}

/// A release the server refuses is retried in the background until it goes, not left
/// for the entry's lease to end. Redis takes the entry out of the client's registry of
/// live entries (its renewals, its lost signal) before it sends the removal, so a retry
/// that asked for a lost signal only after that first attempt found no entry, took it
/// for lost and stopped: the key stayed, unrenewed, and every waiter waited for its
/// lease (60 s here).
///
/// The refusal is staged with an ACL user of the holder's own whose key permissions are
/// taken away just before the release (`NOPERM`, the script never runs) and given back
/// after it failed; nothing else on the shared server is touched. Once with the entry
/// alone (the solo layout), once with a waiter queued behind it.
pub async fn a_release_the_server_refused_is_retried_until_it_goes(
    _kind: crate::support::Kind,
    url: &str,
) {
    let user = unique("relfail").replace(|c: char| !c.is_ascii_alphanumeric(), "");
    let addr = url.strip_prefix("redis://").expect("redis://host:port");
    redis_cli(
        url,
        &["ACL", "SETUSER", &user, "on", ">pw", "~*", "&*", "+@all"],
    );
    let holder = dlock::connect_with(
        &format!("redis://{user}:pw@{addr}"),
        SessionOptions::default().with_session_timeout(Duration::from_secs(60)),
    )
    .await
    .expect("connect as the ACL user");
    let b = client(url).await;
    // The holder's release, refused: its user loses its keys for it, then gets them back.
    let release_refused = |mut g: dlock::LockGuard| {
        let (url, user) = (url.to_owned(), user.clone());
        async move {
            redis_cli(
                &url,
                &["ACL", "SETUSER", &user, "resetkeys", "~nothing-of-dlock:*"],
            );
            let refused = g.release().await;
            redis_cli(&url, &["ACL", "SETUSER", &user, "~*"]);
            assert!(
                matches!(refused, Err(Error::PermissionDenied(_))),
                "the release was refused: {refused:?}"
            );
        }
    };

    // Alone.
    let name = unique("relfail-solo");
    let g = holder
        .mutex(&name)
        .expect("name")
        .lock()
        .await
        .expect("lock");
    release_refused(g).await;
    assert!(
        eventually(Duration::from_secs(10), || async {
            leftovers(&b, &name).await == 0
        })
        .await,
        "the refused release of a lone entry was not retried: its key waits for its lease"
    );

    // With a waiter behind it.
    let name = unique("relfail-queued");
    let g = holder
        .mutex(&name)
        .expect("name")
        .lock()
        .await
        .expect("lock");
    let mb = b.mutex(&name).expect("name");
    let waiter = tokio::spawn(async move { mb.lock_timeout(Duration::from_secs(50)).await });
    assert!(
        eventually(Duration::from_secs(20), || async {
            leftovers(&b, &name).await == 2
        })
        .await,
        "the waiter queued"
    );
    release_refused(g).await;
    let granted = tokio::time::timeout(Duration::from_secs(10), waiter).await;
    let mut next = granted
        .expect(
            "the waiter was granted once the refused release was retried, not at the lease's end",
        )
        .expect("join")
        .expect("lock");
    next.release().await.expect("release");
    assert_eq!(leftovers(&b, &name).await, 0, "nothing is left of the lock");

    holder.close().await.expect("close");
    b.close().await.expect("close");
    redis_cli(url, &["ACL", "DELUSER", &user]);
}

/// A client whose session (60 s) is long enough that its watchdog, renewing every
/// lease/3, does not notice its own entry's loss before the test's waiter does.
async fn long_session(url: &str) -> dlock::Client {
    dlock::connect_with(
        url,
        SessionOptions::default().with_session_timeout(Duration::from_secs(60)),
    )
    .await
    .expect("connect")
}

/// On Redlock a hold is verified only while a majority of the masters still have its
/// entry. First the holder's keys go from a minority (2 of 5 in the test cluster) and
/// one of the masters still holding it is paused for 1.5 s: the hold is on a bare
/// majority and must verify (the paused master is waited for, not counted as missing).
/// Then a third master loses them, as an expiry or a restart without persistence would
/// leave it, before the watchdog's next round (a 60 s session: rounds every 20 s): a
/// contender could now be granted by that majority, and `verify` must say the hold is
/// lost. Before, it merged the masters' listings and found the entry on a master that
/// still had it.
pub async fn redlock_verify_needs_the_entry_on_a_majority(_kind: crate::support::Kind, url: &str) {
    let name = unique("rlverify");
    let a = long_session(url).await;
    let mut g = a.mutex(&name).expect("name").lock().await.expect("lock");
    g.verify().await.expect("a fresh hold verifies");
    let masters: Vec<&str> = url
        .split_once("://")
        .map_or(url, |(_, rest)| rest)
        .split(',')
        .collect();
    assert!(masters.len() >= 3, "Redlock masters: {masters:?}");
    let wipe = |m: &str| {
        wipe_lock(&format!("redis://{m}"), &name);
    };
    let majority = masters.len() / 2 + 1;
    // Left on a bare majority, one of which answers late: still held. The late master
    // is waited for, not counted as missing.
    let slow = masters[masters.len() - 1];
    for m in &masters[..masters.len() - majority] {
        wipe(m);
    }
    redis_cli(
        &format!("redis://{slow}"),
        &["CLIENT", "PAUSE", "1500", "ALL"],
    );
    let verified = g.verify().await;
    assert!(
        verified.is_ok(),
        "a hold on a bare majority of masters, one of them slow, did not verify: {verified:?}"
    );
    // Left on a minority: lost.
    wipe(masters[masters.len() - majority]);
    let lose_on = masters.len() - majority + 1;
    let verified = g.verify().await;
    assert!(
        matches!(verified, Err(Error::LockLost(_))),
        "a hold left on {} of {} masters verified: {verified:?}",
        masters.len() - lose_on,
        masters.len()
    );
    let _ = g.release().await;
    assert!(
        eventually(Duration::from_secs(20), || async {
            leftovers(&a, &name).await == 0
        })
        .await,
        "the hold's last keys were not removed"
    );
    a.close().await.expect("close");
}

/// A multi-lock whose first part is lost while it waits for the second (the first's key
/// deleted on its master, which the watchdog finds within lease/3: a loss of that entry
/// alone, the session goes on) fails with `LockLost` once the second comes free, and
/// releases both, instead of handing out a hold one of whose parts another client may
/// already have. Each grant checks only its own part; before, the multi-lock returned
/// `Ok` with that part lost.
pub async fn multilock_with_a_part_lost_meanwhile_is_not_granted(
    _kind: crate::support::Kind,
    url: &str,
) {
    let (first, second) = (unique("mlfirst"), unique("mlsecond"));
    let (a, b) = (client(url).await, client(url).await);
    let mut held = b.mutex(&second).expect("name").lock().await.expect("lock");
    // Parts are taken in name order: `first` sorts before `second`.
    let multi = a
        .multi()
        .mutex(&first)
        .expect("name")
        .mutex(&second)
        .expect("name");
    let waiting = tokio::spawn(async move { multi.acquire_timeout(Duration::from_secs(30)).await });
    assert!(
        eventually(Duration::from_secs(20), || async {
            leftovers(&b, &first).await == 1 && leftovers(&b, &second).await == 2
        })
        .await,
        "the multi-lock took its first part and queued for the second"
    );
    wipe_lock(url, &first);
    // A whole lease: the watchdog (every lease/3) has found the first part gone.
    tokio::time::sleep(crate::support::SESSION_TIMEOUT).await;
    held.release().await.expect("release");
    let got = tokio::time::timeout(Duration::from_secs(30), waiting)
        .await
        .expect("the multi-lock finished")
        .expect("task");
    assert!(
        matches!(&got, Err(Error::LockLost(why)) if why.contains(&first)),
        "a multi-lock with a lost part was handed out: {:?}",
        got.as_ref().map(dlock::MultiGuard::tokens)
    );
    assert!(
        eventually(Duration::from_secs(20), || async {
            leftovers(&b, &first).await == 0 && leftovers(&b, &second).await == 0
        })
        .await,
        "the rolled-back parts left entries"
    );
    a.close().await.expect("close");
    b.close().await.expect("close");
}

/// A database the server does not have (`redis://host:port/99`; Redis has 16 by
/// default) is the caller's URL at fault: `InvalidUrl` (the CLI's exit 64), at once, not
/// `Unreachable` after the connect timeout (exit 69, "retry later"), as before.
pub async fn a_database_the_server_lacks_is_a_url_error(_kind: crate::support::Kind, url: &str) {
    let opts = SessionOptions::default().with_connect_timeout(Duration::from_secs(20));
    let started = std::time::Instant::now();
    let r = dlock::connect_with(&format!("{url}/99"), opts).await;
    assert!(
        matches!(&r, Err(Error::InvalidUrl { reason, .. }) if reason.contains("no such database")),
        "{:?}",
        r.map(|_| ())
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "refused only at the connect timeout"
    );
}

/// `dlock exec` with the default `--kill-after` stops a command that ignores SIGTERM
/// before the next holder can get the lock: the default grace is half the lead the lost
/// signal has on the session's end. The holder's renewals are refused (an ACL user of
/// the test's own loses its keys), so its lost signal fires at its deadline and its key
/// expires a lead later. Before, the default grace was 5 s, longer than the 1 s lead of
/// a 10 s session: the command was still running when the waiter got the lock.
pub async fn cli_default_grace_ends_before_the_next_holder(_kind: crate::support::Kind, url: &str) {
    use crate::faults::{recorded_pid, spawn_exec, start_time, wait_exit, GENEROUS};
    let user = unique("grace").replace(|c: char| !c.is_ascii_alphanumeric(), "");
    let addr = url.strip_prefix("redis://").expect("redis://host:port");
    redis_cli(
        url,
        &["ACL", "SETUSER", &user, "on", ">pw", "~*", "&*", "+@all"],
    );
    let name = unique("grace");
    let dir = crate::support::tempdir("grace");
    let pid_file = dir.join("pid");
    let errfile = dir.join("dlock.err");
    let holder_url = format!("redis://{user}:pw@{addr}");
    let mut holder = spawn_exec(
        &[
            "--url",
            &holder_url,
            "--session-timeout",
            "10s",
            "exec",
            &name,
        ],
        "trap '' TERM; echo $$ > \"$1.tmp\"; mv \"$1.tmp\" \"$1\"; \
         while :; do sleep 0.02; done",
        &[&pid_file],
        &errfile,
    );
    let pid = recorded_pid(&pid_file).await;
    let start = start_time(pid).expect("the command runs");
    let c = client(url).await;
    let m = c.mutex(&name).expect("name");
    let waiter = tokio::spawn(async move { m.lock_timeout(GENEROUS).await });
    assert!(
        eventually(GENEROUS, || async { leftovers(&c, &name).await == 2 }).await,
        "the waiter queued"
    );
    // From now on the holder's renewals are refused.
    redis_cli(
        url,
        &["ACL", "SETUSER", &user, "resetkeys", "~nothing-of-dlock:*"],
    );
    let next = waiter
        .await
        .expect("join")
        .expect("the waiter gets the lock once the holder's key expired");
    let still_running = start_time(pid) == Some(start);
    let status = wait_exit(&mut holder.0, GENEROUS).await;
    let err = std::fs::read_to_string(&errfile).unwrap_or_default();
    redis_cli(url, &["ACL", "DELUSER", &user]);
    let _ = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status();
    assert!(
        !still_running,
        "the command that ignores SIGTERM still ran when the next holder got the lock; stderr: {err}"
    );
    let status = status.unwrap_or_else(|| panic!("dlock did not exit; stderr: {err}"));
    assert_eq!(status.code(), Some(70), "{status}; stderr: {err}");
    assert!(err.contains("stopping the command"), "stderr: {err}");
    crate::faults::next_holder_undisturbed(next, c, &name, &dir).await;
}
