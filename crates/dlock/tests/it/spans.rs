//! What the recipes tell a tracing subscriber: every acquire is a `dlock.acquire` span
//! carrying the lock, the kind, the fencing token and the time waited; every release a
//! `dlock.release` span with the lock and token. In memory: no server needed.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use dlock::{Client, DynBackend, SessionOptions};
use dlock_testkit::mem::MemServer;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::Subscriber;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

/// One span: its id, name, and every field it was given, at creation or later.
type SpanSeen = (Id, &'static str, BTreeMap<String, String>);

/// Every span opened while the layer was installed.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<SpanSeen>>>);

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Seen {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _ctx: Context<'_, S>) {
        let mut fields = BTreeMap::new();
        attrs.record(&mut Fields(&mut fields));
        if let Ok(mut seen) = self.0.lock() {
            seen.push((id.clone(), attrs.metadata().name(), fields));
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _ctx: Context<'_, S>) {
        if let Ok(mut seen) = self.0.lock() {
            if let Some((_, _, fields)) = seen.iter_mut().rev().find(|(i, _, _)| i == id) {
                values.record(&mut Fields(fields));
            }
        }
    }
}

/// Takes and frees a mutex and a semaphore permit on a fresh in-memory server: the
/// recipes' acquire and release callsites are hit, on whatever thread runs this.
async fn lock_and_permit(client: &Client) -> String {
    let mut g = client
        .mutex("spans/m")
        .expect("name")
        .lock()
        .await
        .expect("lock");
    let token = g.token().get().to_string();
    g.release().await.expect("release");
    let mut p = client
        .semaphore("spans/s", 2)
        .expect("name")
        .acquire()
        .await
        .expect("permit");
    p.release().await.expect("release");
    token
}

async fn mem_client() -> Client {
    let backend = MemServer::new()
        .connect(SessionOptions::default())
        .await
        .expect("connect to the in-memory server");
    Client::new(backend as Arc<dyn DynBackend>)
}

#[tokio::test]
async fn acquire_and_release_spans_carry_lock_token_and_wait() {
    // tracing caches, per callsite and for the whole process, whether any subscriber
    // wants it. While exactly one dispatcher exists, tracing-core decides that from the
    // default of whichever thread hits the callsite first: another test's thread, with
    // no subscriber, would cache "never" and hide this test's spans (CI saw a missing
    // `dlock.acquire` span). A second live dispatcher makes every decision ask all of
    // them, this test's layer included.
    let _second = tracing::Dispatch::new(tracing_subscriber::registry());
    let seen = Seen::default();
    let subscriber = tracing_subscriber::registry().with(seen.clone());
    let _default = tracing::subscriber::set_default(subscriber);

    // Provoke the race: a thread with no subscriber hits the callsites first.
    std::thread::spawn(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async { lock_and_permit(&mem_client().await).await });
    })
    .join()
    .expect("the other thread's lock and permit");

    let token = lock_and_permit(&mem_client().await).await;

    let seen = seen.0.lock().expect("spans").clone();
    let named = |name: &str, lock: &str| {
        seen.iter()
            .find(|(_, n, f)| *n == name && f.get("lock").map(String::as_str) == Some(lock))
            .map(|(_, _, f)| f.clone())
            .unwrap_or_else(|| panic!("no {name} span for {lock}: {seen:?}"))
    };
    let acquire = named("dlock.acquire", "spans/m");
    assert_eq!(acquire.get("token"), Some(&token), "{acquire:?}");
    let waited: f64 = acquire
        .get("wait_ms")
        .and_then(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("no wait_ms: {acquire:?}"));
    assert!(waited >= 0.0, "{acquire:?}");
    assert_eq!(
        acquire.get("kind").map(String::as_str),
        Some("lock"),
        "{acquire:?}"
    );
    let release = named("dlock.release", "spans/m");
    assert_eq!(release.get("token"), Some(&token), "{release:?}");
    let lease = named("dlock.acquire", "spans/s");
    assert!(
        lease.contains_key("token") && lease.contains_key("wait_ms"),
        "{lease:?}"
    );
    assert!(
        !seen
            .iter()
            .any(|(_, n, _)| *n == "acquire" || *n == "release"),
        "a span without the crate prefix: {seen:?}"
    );
}
