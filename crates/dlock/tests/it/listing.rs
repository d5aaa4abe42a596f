//! `Client::locks`: the locks with holders or waiters under a name prefix.

use std::time::Duration;

use dlock::{Client, LockKind, LockSummary};

use crate::support::{client, eventually, leftovers, unique, Kind};

fn rows(locks: &[LockSummary]) -> Vec<(String, LockKind, usize, usize)> {
    locks
        .iter()
        .map(|l| (l.name.to_string(), l.kind, l.holders, l.waiters))
        .collect()
}

async fn listed(c: &Client, prefix: &str) -> Vec<(String, LockKind, usize, usize)> {
    rows(&c.locks(prefix).await.expect("list the locks"))
}

/// A held mutex with a waiter, a read lock with a writer waiting, a semaphore with two
/// permits taken, all under one prefix: the listing names exactly those, once each, with
/// their kinds and counts; a lock beside the prefix is left out unless the prefix covers
/// it; after the releases nothing is listed.
pub async fn locks_lists_what_is_held_and_waited_for(_kind: Kind, url: &str) {
    let base = unique("list");
    let (c, w) = (client(url).await, client(url).await);
    let (m, rw, s, beside) = (
        format!("{base}/m"),
        format!("{base}/rw"),
        format!("{base}/s"),
        format!("{base}-beside"),
    );
    let mut held = vec![
        c.mutex(&m).expect("n").lock().await.expect("lock"),
        c.rwlock(&rw).expect("n").read().await.expect("read"),
        c.semaphore(&s, 2)
            .expect("n")
            .acquire()
            .await
            .expect("permit"),
        w.semaphore(&s, 2)
            .expect("n")
            .acquire()
            .await
            .expect("permit"),
        c.mutex(&beside).expect("n").lock().await.expect("lock"),
    ];
    let (wm, wrw) = (w.mutex(&m).expect("n"), w.rwlock(&rw).expect("n"));
    let waiting = tokio::spawn(async move {
        let t = Duration::from_secs(60);
        let (a, b) = tokio::join!(wm.lock_timeout(t), wrw.write_timeout(t));
        for mut g in [
            a.expect("mutex after release"),
            b.expect("write after release"),
        ] {
            g.release().await.expect("release");
        }
    });
    assert!(
        eventually(Duration::from_secs(30), || async {
            leftovers(&c, &m).await == 2 && leftovers(&c, &rw).await == 2
        })
        .await,
        "the waiters queued"
    );

    let under = listed(&c, &format!("{base}/")).await;
    assert_eq!(
        under,
        [
            (m.clone(), LockKind::Mutex, 1, 1),
            (rw.clone(), LockKind::ReadWrite, 1, 1),
            (s.clone(), LockKind::Semaphore, 2, 0),
        ]
    );
    // Another session sees the same; a plain string prefix covers the lock beside too; a
    // partial last segment narrows it.
    assert_eq!(listed(&w, &format!("/{base}/")).await, under);
    let names: Vec<String> = listed(&c, &base).await.into_iter().map(|r| r.0).collect();
    assert_eq!(names, [beside.clone(), m.clone(), rw.clone(), s.clone()]);
    let narrowed: Vec<String> = listed(&c, &format!("{base}/r"))
        .await
        .into_iter()
        .map(|r| r.0)
        .collect();
    assert_eq!(narrowed, [rw.as_str()]);
    let everything = listed(&c, "").await;
    for name in [&m, &rw, &s, &beside] {
        assert_eq!(
            everything.iter().filter(|r| &r.0 == name).count(),
            1,
            "{name} once in the listing of every lock"
        );
    }

    for g in &mut held {
        g.release().await.expect("release");
    }
    waiting.await.expect("waiters");
    assert!(
        eventually(Duration::from_secs(30), || async {
            listed(&c, &base).await.is_empty()
        })
        .await,
        "released locks are no longer listed: {:?}",
        listed(&c, &base).await
    );
    for client in [c, w] {
        client.close().await.expect("close");
    }
}
