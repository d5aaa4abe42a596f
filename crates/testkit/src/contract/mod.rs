//! The backend contract, written once: the behaviour every [`dlock_core::Backend`] keeps (the module
//! docs of `dlock_core::backend`), as test functions over a connect factory, and the
//! [`backend_contract!`](crate::backend_contract) macro that instantiates them for one
//! backend.
//!
//! Each function in [`tests`] takes a [`Connect`], opens the sessions it needs (every
//! call of the factory is a new client with a session of its own), works under a lock
//! name nobody else uses ([`fresh_queue`]), and panics on the first broken promise.
//! The functions in [`capabilities`] cover the optional abilities a backend may claim
//! ([`Capability`]); a backend that does not claim one is checked to refuse it with a
//! typed error instead.

pub mod capabilities;
pub mod gone;
pub mod tests;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use dlock_core::{DynBackend, Enqueued, EntryKind, LockName, Position, QueuePath, SessionOptions};
use futures::future::BoxFuture;

/// Opens a new session (a new client) on the backend under test. Each call is one more
/// contender, as a separate process would be.
pub type Connect = Arc<
    dyn Fn(SessionOptions) -> BoxFuture<'static, dlock_core::Result<Arc<dyn DynBackend>>>
        + Send
        + Sync,
>;

/// Wraps an adapter's connect function (anything that turns [`SessionOptions`] into a
/// future of `Arc<B>`) as a [`Connect`].
///
/// ```ignore
/// // A factory over one etcd cluster: every call opens a new client with its own lease.
/// let endpoints: Vec<String> = vec!["127.0.0.1:2379".into()];
/// let connect = dlock_testkit::contract::connect_fn(move |opts| {
///     let endpoints = endpoints.clone();
///     async move { dlock_etcd::EtcdBackend::connect(&endpoints, opts).await }
/// });
/// ```
pub fn connect_fn<F, Fut, B>(f: F) -> Connect
where
    F: Fn(SessionOptions) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = dlock_core::Result<Arc<B>>> + Send + 'static,
    B: DynBackend,
{
    Arc::new(move |opts| {
        let fut = f(opts);
        Box::pin(async move { fut.await.map(|b| b as Arc<dyn DynBackend>) })
    })
}

/// The optional abilities a backend may claim: `dlock_core`'s, named in
/// [`backend_contract!`](crate::backend_contract)'s `supports` list and checked against
/// [`DynBackend::supports`].
pub use dlock_core::Capability;

/// The skip rule for a contract test whose backend needs a server: the value of `var`,
/// or `None` after a loud `SKIPPED` line naming the test. Under `CI` (set to anything
/// but empty, `0` or `false`) a missing endpoint fails the test instead: a CI run that
/// skipped the servers would be a green build that tested nothing.
///
/// # Panics
/// When `var` is missing and `CI` is set.
pub fn endpoint_or_skip(var: &str, test: &str) -> Option<String> {
    if let Some(v) = std::env::var(var).ok().filter(|v| !v.trim().is_empty()) {
        return Some(v.trim().to_owned());
    }
    let ci = std::env::var("CI")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .is_some_and(|v| v != "0" && !v.eq_ignore_ascii_case("false"));
    if ci {
        panic!(
            "{test}: {var} is not set but CI is: the backend contract must run in CI. Run it through `cargo xtask integration`, which starts the servers and exports {var}."
        );
    }
    // Straight to the process's stderr: libtest captures `eprintln!` of passing tests,
    // and a skip must be seen.
    use std::io::Write as _;
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED: {test}: {var} not set (run through cargo xtask integration)"
    );
    None
}

/// Generous bound for anything that should happen "soon": a hang fails the test, a slow
/// machine does not.
pub const LONG: Duration = Duration::from_secs(30);

/// Runs `f`, failing the test if it takes longer than [`LONG`].
pub async fn within<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(LONG, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: did not finish within {LONG:?}"))
}

/// Spends the current task's tokio budget, as a task that has just read many ready
/// messages has: until it yields, every tokio resource's poll answers `Pending`. Fails
/// the test if the budget never ran out.
pub fn spend_task_budget() {
    use futures::FutureExt as _;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..1000 {
        tx.send(i).expect("send");
    }
    let mut read = 0;
    while rx.recv().now_or_never().is_some() {
        read += 1;
    }
    assert!(read < 1000, "the budget never ran out ({read} read)");
}

/// Opens one session with the default options, failing the test if it cannot.
pub async fn session(connect: &Connect) -> Arc<dyn DynBackend> {
    session_with(connect, SessionOptions::default()).await
}

/// Opens one session with `opts`, failing the test if it cannot.
pub async fn session_with(connect: &Connect, opts: SessionOptions) -> Arc<dyn DynBackend> {
    within("connect", connect(opts))
        .await
        .unwrap_or_else(|e| panic!("connect: {e}"))
}

/// A lock queue no other test uses, valid under `b`'s name rules:
/// `dlock-contract/<test>/<random>`.
pub fn fresh_queue(b: &dyn DynBackend, test: &str) -> QueuePath {
    QueuePath::root(fresh_name(b, test))
}

/// The lock name of [`fresh_queue`].
pub fn fresh_name(b: &dyn DynBackend, test: &str) -> LockName {
    let name = format!("dlock-contract/{test}/{}", crate::ticket().as_str());
    LockName::new(&name, b.name_rules()).expect("a valid contract lock name")
}

/// Adds an entry of `kind` at the tail of `q` for a new ticket, failing the test (naming
/// `what`) if that fails.
pub async fn add(b: &dyn DynBackend, q: &QueuePath, kind: EntryKind, what: &str) -> Enqueued {
    within(
        what,
        b.enqueue(q, &crate::ticket(), kind, Position::Tail, b""),
    )
    .await
    .unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// Polls `cond` every 20 ms until it holds, failing the test (naming `what`) after
/// [`LONG`]. For reads that may be served by a replica trailing another session's write
/// (a ZooKeeper follower, an etcd member), which the contract allows.
pub async fn eventually<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    within(what, async {
        while !cond().await {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

/// The macro behind [`backend_contract!`](crate::backend_contract): one test per
/// contract function. Not for direct use.
#[doc(hidden)]
#[macro_export]
macro_rules! __contract_tests {
    ($make:ident; $($test:ident),* $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                let Some(connect) = $make(stringify!($test)) else { return };
                $crate::contract::tests::$test(connect).await;
            }
        )*
    };
}

/// Expands `$yes` if `$cap` is in the list, `$no` otherwise. Not for direct use.
#[doc(hidden)]
#[macro_export]
macro_rules! __contract_if_claimed {
    (revocation in [revocation $(, $rest:ident)*] { $($yes:tt)* } else { $($no:tt)* }) => { $($yes)* };
    (shared_value in [shared_value $(, $rest:ident)*] { $($yes:tt)* } else { $($no:tt)* }) => { $($yes)* };
    ($cap:ident in [] { $($yes:tt)* } else { $($no:tt)* }) => { $($no)* };
    ($cap:ident in [$other:ident $(, $rest:ident)*] { $($yes:tt)* } else { $($no:tt)* }) => {
        $crate::__contract_if_claimed!($cap in [$($rest),*] { $($yes)* } else { $($no)* });
    };
}

/// Rejects a capability name the contract does not know. Not for direct use.
#[doc(hidden)]
#[macro_export]
macro_rules! __contract_known_capability {
    (revocation) => {};
    (shared_value) => {};
    ($other:ident) => {
        compile_error!(concat!(
            "unknown backend capability `",
            stringify!($other),
            "`: expected revocation or shared_value"
        ));
    };
}

/// Instantiates the backend contract ([`contract`](crate::contract)) for one backend:
/// one `#[tokio::test(flavor = "multi_thread", worker_threads = 2)]` per contract test,
/// each named after its function in [`contract::tests`](crate::contract::tests) or
/// [`contract::capabilities`](crate::contract::capabilities).
///
/// - `endpoint` (optional): the `DLOCK_TEST_*` variable naming the servers. When it is
///   missing every test prints a `SKIPPED` line and passes, or fails under `CI`
///   ([`contract::endpoint_or_skip`](crate::contract::endpoint_or_skip)). With an
///   endpoint, `connect` is a closure from the variable's value to a
///   [`Connect`](crate::contract::Connect); without one (a backend that needs no server),
///   `connect` is a `Connect` expression.
/// - `supports`: the optional capabilities the backend claims (`revocation`,
///   `shared_value`). Each claimed one runs its tests; each unclaimed one runs a test
///   that the backend refuses it with a typed error.
///
/// The calling crate needs `tokio` (with `macros` and `rt-multi-thread`) and
/// `dlock-testkit` as dev-dependencies.
///
/// # Example
/// In `crates/<adapter>/tests/contract.rs`:
///
/// ```ignore
/// use dlock_testkit::contract::{connect_fn, Connect};
///
/// fn connect(hosts: String) -> Connect {
///     connect_fn(move |opts| dlock_zookeeper::ZkBackend::connect(&hosts, opts))
/// }
///
/// dlock_testkit::backend_contract! {
///     endpoint: dlock_testkit::ENV_ZK,
///     connect: connect,
///     supports: [revocation, shared_value],
/// }
/// ```
///
/// A backend without a server (in memory):
///
/// ```ignore
/// dlock_testkit::backend_contract! {
///     connect: my_backend::contract_connect(),
///     supports: [],
/// }
/// ```
#[macro_export]
macro_rules! backend_contract {
    (
        endpoint: $var:expr,
        connect: $connect:expr,
        supports: [$($cap:ident),* $(,)?] $(,)?
    ) => {
        fn __contract_connect(test: &str) -> ::std::option::Option<$crate::contract::Connect> {
            let endpoint = $crate::contract::endpoint_or_skip($var, test)?;
            let make = $connect;
            ::std::option::Option::Some(make(endpoint))
        }
        $crate::backend_contract!(@body [$($cap),*]);
    };
    (
        connect: $connect:expr,
        supports: [$($cap:ident),* $(,)?] $(,)?
    ) => {
        fn __contract_connect(_test: &str) -> ::std::option::Option<$crate::contract::Connect> {
            ::std::option::Option::Some($connect)
        }
        $crate::backend_contract!(@body [$($cap),*]);
    };
    (@body [$($cap:ident),*]) => {
        $( $crate::__contract_known_capability!($cap); )*
        $crate::__contract_tests!(__contract_connect;
            enqueue_returns_the_queue_in_order_with_mine_and_a_token,
            fifo_across_two_sessions_and_wait_gone_wakes_on_removal,
            wait_gone_returns_at_once_when_already_gone,
            tokens_strictly_increase_across_sessions,
            a_new_entry_sorts_after_every_entry_in_its_queue,
            beside_read_sorts_beside_its_writer,
            beside_a_gone_writer_is_refused_and_leaves_nothing,
            abandon_removes_exactly_the_tickets_entry,
            dropped_enqueues_then_abandon_leave_nothing,
            queue_ahead_and_contains_agree_with_queue,
            still_queued_answers_for_the_moment_of_the_wake,
            close_fires_lost_and_later_calls_fail_typed,
            close_removes_the_sessions_entries,
            wait_changed_wakes_on_a_removal_and_an_addition,
            sub_queues_are_independent,
            bad_input_gets_typed_errors,
            list_queues_finds_the_queues_with_entries,
            enqueue_removing_adds_one_and_removes_the_other,
            wait_gone_detail_says_head_only_for_a_head_removal,
            wait_gone_detail_waits_while_the_entry_stays,
            head_handoffs_keep_exclusion,
        );
        $crate::__contract_if_claimed!(revocation in [$($cap),*] {
            $crate::__contract_capability_tests!(__contract_connect;
                set_data_reaches_wait_data_changed_not_wait_gone,
            );
        } else {
            $crate::__contract_capability_tests!(__contract_connect;
                revocation_unsupported_is_a_typed_error,
            );
        });
        $crate::__contract_if_claimed!(shared_value in [$($cap),*] {
            $crate::__contract_capability_tests!(__contract_connect;
                read_value_is_none_until_set,
            );
        } else {
            $crate::__contract_capability_tests!(__contract_connect;
                shared_value_unsupported_is_a_typed_error,
            );
        });
    };
}

/// As [`__contract_tests!`], for [`capabilities`]. Not for direct use.
#[doc(hidden)]
#[macro_export]
macro_rules! __contract_capability_tests {
    ($make:ident; $($test:ident),* $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                let Some(connect) = $make(stringify!($test)) else { return };
                $crate::contract::capabilities::$test(connect).await;
            }
        )*
    };
}
