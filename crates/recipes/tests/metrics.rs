//! The recipes' metrics, read back from a recording recorder: every acquire outcome,
//! the wait and hold times and a lost hold are counted under the documented names and
//! labels. On the in-memory backend, so no server is needed.

use std::sync::Arc;
use std::time::Duration;

use dlock_core::{DynBackend, Error, SessionOptions};
use dlock_recipes::Client;
use dlock_testkit::mem::MemServer;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::{CompositeKey, MetricKind};

/// One snapshot of every metric. (A snapshot takes the histograms' samples with it, so
/// each checkpoint reads one and asks it everything.)
type Metrics = Vec<(CompositeKey, DebugValue)>;

fn read(snap: &metrics_util::debugging::Snapshotter) -> Metrics {
    snap.snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, v)| (key, v))
        .collect()
}

async fn client(server: &Arc<MemServer>) -> Client<dyn DynBackend> {
    let backend = server
        .connect(SessionOptions::default().with_session_timeout(Duration::from_secs(4)))
        .await
        .expect("mem session");
    Client::new(backend as Arc<dyn DynBackend>)
}

/// The value of the metric `name` whose labels include every one of `labels`.
fn value<'a>(
    snap: &'a Metrics,
    kind: MetricKind,
    name: &str,
    labels: &[(&str, &str)],
) -> Option<&'a DebugValue> {
    snap.iter().find_map(|(key, v)| {
        let ok = key.kind() == kind
            && key.key().name() == name
            && labels.iter().all(|(k, want)| {
                key.key()
                    .labels()
                    .any(|l| l.key() == *k && l.value() == *want)
            });
        ok.then_some(v)
    })
}

fn count(snap: &Metrics, name: &str, labels: &[(&str, &str)]) -> u64 {
    match value(snap, MetricKind::Counter, name, labels) {
        Some(DebugValue::Counter(n)) => *n,
        None => 0,
        Some(other) => panic!("{name} is not a counter: {other:?}"),
    }
}

fn samples(snap: &Metrics, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
    match value(snap, MetricKind::Histogram, name, labels) {
        Some(DebugValue::Histogram(v)) => v.iter().map(|x| x.into_inner()).collect(),
        None => Vec::new(),
        Some(other) => panic!("{name} is not a histogram: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquires_waits_holds_and_losses_are_recorded() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this test binary");

    let server = MemServer::new();
    let a = client(&server).await;
    let b = client(&server).await;
    let m = "metrics/one";
    let lock = [("backend", "mem"), ("kind", "lock")];
    let with = |outcome: &'static str| [("backend", "mem"), ("kind", "lock"), ("outcome", outcome)];

    // Granted, then held for at least 50 ms.
    let mut g = a.mutex(m).expect("name").lock().await.expect("lock");
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Held elsewhere: a try and a short timeout.
    let mb = b.mutex(m).expect("name");
    assert!(matches!(mb.try_lock().await, Err(Error::WouldBlock)));
    assert!(matches!(
        mb.lock_timeout(Duration::from_millis(100)).await,
        Err(Error::Timeout(_))
    ));
    g.release().await.expect("release");

    let snap = read(&snapshotter);
    assert_eq!(count(&snap, "dlock_acquires_total", &with("granted")), 1);
    assert_eq!(
        count(&snap, "dlock_acquires_total", &with("would_block")),
        1
    );
    assert_eq!(count(&snap, "dlock_acquires_total", &with("timeout")), 1);
    let waits = samples(&snap, "dlock_acquire_wait_seconds", &with("timeout"));
    assert!(
        !waits.is_empty() && waits.iter().all(|w| *w >= 0.1),
        "a 100 ms timeout waited {waits:?}"
    );
    let holds = samples(&snap, "dlock_hold_seconds", &lock);
    assert_eq!(holds.len(), 1, "{holds:?}");
    assert!(holds[0] >= 0.05, "held 50 ms, recorded {holds:?}");
    assert_eq!(count(&snap, "dlock_holds_lost_total", &lock), 0);

    // A hold whose session ends under it counts as lost when it ends.
    let g = b.mutex(m).expect("name").lock().await.expect("lock");
    let lost = g.lost();
    b.close().await.expect("close");
    tokio::time::timeout(Duration::from_secs(10), lost)
        .await
        .expect("the lost signal fires");
    drop(g);
    let snap = read(&snapshotter);
    assert_eq!(count(&snap, "dlock_holds_lost_total", &lock), 1);

    // A closed client's acquire is an error, counted by its label.
    let r = b.mutex("metrics/two").expect("name").lock().await;
    let label = r
        .as_ref()
        .err()
        .map(Error::label)
        .expect("a closed client fails");
    let snap = read(&snapshotter);
    assert_eq!(
        count(
            &snap,
            "dlock_errors_total",
            &[("backend", "mem"), ("kind", "lock"), ("error", label)]
        ),
        1
    );

    // Semaphore permits are `lease`s.
    let s = a.semaphore("metrics/sem", 2).expect("name");
    let p = s.acquire().await.expect("permit");
    drop(p);
    let snap = read(&snapshotter);
    assert_eq!(
        count(
            &snap,
            "dlock_acquires_total",
            &[
                ("backend", "mem"),
                ("kind", "lease"),
                ("outcome", "granted")
            ]
        ),
        1
    );
}
