//! One acquire shape on every recipe: wait, wait at most a while, or not at all; a zero
//! timeout asks once (a free lock is taken, a held one fails at once); many permits come
//! as one guard. Written once, run on every backend.

use std::future::Future;
use std::time::Duration;

use dlock::Error;

use crate::support::{client, eventually, leftovers, unique, Kind};

const ZERO: Duration = Duration::ZERO;

/// Longer than any answer takes: an attempt that waited for a held lock instead of
/// failing at once would run into it (the lock is held until the test releases it).
const BOUND: Duration = Duration::from_secs(20);

/// `fut` must finish without waiting for the holder: a bound far above a round trip
/// turns a wait into a failure instead of a hang.
async fn at_once<T>(what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, fut)
        .await
        .unwrap_or_else(|_| panic!("{what}: waited for the holder instead of failing at once"))
}

fn is_zero_timeout<T>(r: &dlock::Result<T>) -> bool {
    matches!(r, Err(Error::Timeout(d)) if d.is_zero())
}

/// What an attempt ended with, printable whatever it holds.
fn err<T>(r: &dlock::Result<T>) -> Option<&Error> {
    r.as_ref().err()
}

/// Every lock named is left with no entry (removals may finish in the background).
async fn nothing_left(c: &dlock::Client, names: &[&String]) {
    for name in names {
        assert!(
            eventually(Duration::from_secs(30), || async {
                leftovers(c, name).await == 0
            })
            .await,
            "{name} left entries"
        );
    }
}

/// A zero timeout on every recipe: takes the free lock, fails with `Timeout(0)` on a
/// held one, and leaves nothing behind.
pub async fn zero_timeout_takes_a_free_lock_and_fails_at_once_on_a_held_one(
    _kind: Kind,
    url: &str,
) {
    let a = client(url).await;
    let b = client(url).await;

    let m = unique("zero-mutex");
    // `Duration::MAX` ("forever") is too long for the clock to add: it waits forever,
    // which on a free lock takes it (it panicked on the clock arithmetic before).
    let mut g = a
        .mutex(&m)
        .expect("n")
        .lock_timeout(Duration::MAX)
        .await
        .expect("Duration::MAX takes a free mutex");
    g.release().await.expect("release");
    let mut g = a
        .multi()
        .mutex(&m)
        .expect("n")
        .acquire_timeout(Duration::MAX)
        .await
        .expect("Duration::MAX takes a free multi-lock");
    g.release().await.expect("release");
    let mut g = at_once("mutex", a.mutex(&m).expect("n").lock_timeout(ZERO))
        .await
        .expect("a zero timeout takes a free mutex");
    let r = at_once("mutex", b.mutex(&m).expect("n").lock_timeout(ZERO)).await;
    assert!(is_zero_timeout(&r), "mutex held elsewhere: {:?}", err(&r));
    g.release().await.expect("release");

    let sm = unique("zero-smutex");
    let mut g = at_once(
        "semaphore-mutex",
        a.semaphore_mutex(&sm).expect("n").lock_timeout(ZERO),
    )
    .await
    .expect("a zero timeout takes a free semaphore-mutex");
    let r = at_once(
        "semaphore-mutex",
        b.semaphore_mutex(&sm).expect("n").lock_timeout(ZERO),
    )
    .await;
    assert!(
        is_zero_timeout(&r),
        "semaphore-mutex held elsewhere: {:?}",
        err(&r)
    );
    g.release().await.expect("release");

    let rw = unique("zero-rw");
    let mut r1 = at_once("read", a.rwlock(&rw).expect("n").read_timeout(ZERO))
        .await
        .expect("a zero timeout takes a free read lock");
    let mut r2 = at_once("read", b.rwlock(&rw).expect("n").read_timeout(ZERO))
        .await
        .expect("readers share, even at a zero timeout");
    let w = at_once("write", b.rwlock(&rw).expect("n").write_timeout(ZERO)).await;
    assert!(is_zero_timeout(&w), "write beside readers: {:?}", err(&w));
    r1.release().await.expect("release");
    r2.release().await.expect("release");
    let mut w = at_once("write", a.rwlock(&rw).expect("n").write_timeout(ZERO))
        .await
        .expect("a zero timeout takes a free write lock");
    let r = at_once("read", b.rwlock(&rw).expect("n").read_timeout(ZERO)).await;
    assert!(is_zero_timeout(&r), "read beside a writer: {:?}", err(&r));
    w.release().await.expect("release");

    let sem = unique("zero-sem");
    let mut p1 = at_once(
        "permit",
        a.semaphore(&sem, 2).expect("n").acquire_timeout(ZERO),
    )
    .await
    .expect("permit 1");
    let mut p2 = at_once(
        "permit",
        b.semaphore(&sem, 2).expect("n").acquire_timeout(ZERO),
    )
    .await
    .expect("permit 2");
    let p3 = at_once(
        "permit",
        b.semaphore(&sem, 2).expect("n").acquire_timeout(ZERO),
    )
    .await;
    assert!(
        is_zero_timeout(&p3),
        "a third permit of two: {:?}",
        err(&p3)
    );
    p1.release().await.expect("release");
    p2.release().await.expect("release");

    let (x, y) = (unique("zero-mx"), unique("zero-my"));
    let multi = |c: &dlock::Client| c.multi().mutex(&x).expect("x").mutex(&y).expect("y");
    let mut all = at_once("multi", multi(&a).acquire_timeout(ZERO))
        .await
        .expect("a zero timeout takes free parts");
    all.release().await.expect("release");
    let mut hold_y = b.mutex(&y).expect("n").lock().await.expect("hold y");
    let r = at_once("multi", multi(&a).acquire_timeout(ZERO)).await;
    assert!(is_zero_timeout(&r), "a part held elsewhere: {:?}", err(&r));
    hold_y.release().await.expect("release");

    nothing_left(&a, &[&m, &sm, &rw, &sem, &x, &y]).await;
    a.close().await.expect("close");
    b.close().await.expect("close");
}

/// Many permits are one guard: all or none, released together; a try that cannot take
/// them all takes none. A multi-lock's try gives up at the first held part and returns
/// the parts it took.
pub async fn many_permits_are_one_guard_and_tries_take_all_or_nothing(_kind: Kind, url: &str) {
    let a = client(url).await;
    let b = client(url).await;
    let sem = unique("many");
    let mut three = at_once(
        "acquire_many",
        a.semaphore(&sem, 3).expect("n").acquire_many(3),
    )
    .await
    .expect("three permits of three");
    assert_eq!(three.guards().len(), 3);
    assert_eq!(three.tokens().len(), 3);
    let r = at_once(
        "try_acquire",
        b.semaphore(&sem, 3).expect("n").try_acquire(),
    )
    .await;
    assert!(matches!(r, Err(Error::WouldBlock)), "{:?}", err(&r));
    three.release().await.expect("release all three");
    let mut two = at_once(
        "try_acquire_many",
        b.semaphore(&sem, 3).expect("n").try_acquire_many(2),
    )
    .await
    .expect("two of three once all were released");
    let r = at_once(
        "try_acquire_many",
        a.semaphore(&sem, 3).expect("n").try_acquire_many(2),
    )
    .await;
    assert!(
        matches!(r, Err(Error::WouldBlock)),
        "two more of three: {:?}",
        err(&r)
    );
    let r = at_once(
        "acquire_many_timeout",
        a.semaphore(&sem, 3)
            .expect("n")
            .acquire_many_timeout(2, ZERO),
    )
    .await;
    assert!(
        is_zero_timeout(&r),
        "two more of three at a zero timeout: {:?}",
        err(&r)
    );
    // The failed tries returned the permit they took: the last one is free.
    let mut one = at_once(
        "try_acquire",
        a.semaphore(&sem, 3).expect("n").try_acquire(),
    )
    .await
    .expect("the third permit is free again");
    one.release().await.expect("release");
    two.release().await.expect("release");
    assert!(matches!(
        a.semaphore(&sem, 3).expect("n").acquire_many(4).await,
        Err(Error::InvalidPermits(_))
    ));

    let (x, y) = (unique("try-mx"), unique("try-my"));
    let multi = |c: &dlock::Client| c.multi().mutex(&x).expect("x").mutex(&y).expect("y");
    let mut hold_y = b.mutex(&y).expect("n").lock().await.expect("hold y");
    let r = at_once("multi try", multi(&a).try_acquire()).await;
    assert!(matches!(r, Err(Error::WouldBlock)), "{:?}", err(&r));
    // x was given back: b takes it at once.
    let mut gx = b
        .mutex(&x)
        .expect("n")
        .try_lock()
        .await
        .expect("x was released");
    gx.release().await.expect("release");
    hold_y.release().await.expect("release");
    let mut both = at_once("multi try", multi(&a).try_acquire())
        .await
        .expect("both parts free");
    both.release().await.expect("release");

    nothing_left(&a, &[&sem, &x, &y]).await;
    a.close().await.expect("close");
    b.close().await.expect("close");
}
