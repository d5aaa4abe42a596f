//! A metrics recorder that panics (a label clash in the application's exporter, a bug
//! in it) must not leave a lock held: the panic unwinds through the acquire or the
//! release, and the entry must still go, or every other contender waits for as long as
//! the session lives. On the in-memory backend; a binary of its own, since the recorder
//! is global to the process.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use dlock_core::{DynBackend, SessionOptions};
use dlock_recipes::Client;
use dlock_testkit::mem::MemServer;
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};

/// The metric whose registration panics, if any.
static REFUSED: Mutex<Option<&'static str>> = Mutex::new(None);

struct Panicking;

impl Panicking {
    fn check(key: &Key) {
        let refused = *REFUSED.lock().unwrap_or_else(|p| p.into_inner());
        if refused == Some(key.name()) {
            panic!("the recorder refuses {}", key.name());
        }
    }
}

impl Recorder for Panicking {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Self::check(key);
        Counter::noop()
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Self::check(key);
        Gauge::noop()
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Self::check(key);
        Histogram::noop()
    }
}

async fn client(server: &Arc<MemServer>) -> Client<dyn DynBackend> {
    let backend = server
        .connect(SessionOptions::default().with_session_timeout(Duration::from_secs(30)))
        .await
        .expect("mem session");
    Client::new(backend as Arc<dyn DynBackend>)
}

fn refuse(metric: Option<&'static str>) {
    *REFUSED.lock().unwrap_or_else(|p| p.into_inner()) = metric;
}

/// For each place a hold's metrics are recorded (the grant's outcome, the hold's end on
/// a release and on a guard's drop, on a mutex and a semaphore permit), a task whose
/// recorder panics there, then a
/// second client that must get the lock well within the first one's 30 s session.
/// Before the fix the panic came after the grant and before the guard existed, or
/// after the last guard and before the removal: the entry stayed, and the second
/// client timed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_recorder_leaves_no_lock_held() {
    metrics::set_global_recorder(Panicking).expect("the only recorder of this binary");
    let server = MemServer::new();
    let (a, b) = (client(&server).await, client(&server).await);
    // The hold's end is recorded on a release and on a guard's drop: both are tried.
    let cases = [
        ("dlock_acquires_total", true),
        ("dlock_hold_seconds", true),
        ("dlock_hold_seconds", false),
    ];
    for (i, (metric, release)) in cases.into_iter().enumerate() {
        for semaphore in [false, true] {
            let name = format!("recorder/{i}/{semaphore}");
            refuse(Some(metric));
            let (a2, n) = (a.clone(), name.clone());
            let task = tokio::spawn(async move {
                let mut g = if semaphore {
                    a2.semaphore(&n, 1).expect("name").acquire().await
                } else {
                    a2.mutex(&n).expect("name").lock().await
                }
                .expect("granted");
                if release {
                    g.release().await
                } else {
                    drop(g);
                    Ok(())
                }
            });
            let r = task.await;
            assert!(
                r.as_ref().is_err_and(|e| e.is_panic()),
                "{metric}: the recorder's panic reached the task: {r:?}"
            );
            refuse(None);
            let next = if semaphore {
                b.semaphore(&name, 1)
                    .expect("name")
                    .acquire_timeout(Duration::from_secs(5))
                    .await
            } else {
                b.mutex(&name)
                    .expect("name")
                    .lock_timeout(Duration::from_secs(5))
                    .await
            };
            let mut g = next.unwrap_or_else(|e| {
                panic!(
                    "{metric} panicked (semaphore: {semaphore}, release: {release}): \
                     the lock stayed held: {e}"
                )
            });
            g.release().await.expect("release");
        }
    }
}
