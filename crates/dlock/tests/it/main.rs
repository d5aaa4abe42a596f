//! Integration tests against real servers, written once and run per backend.
//!
//! `cargo xtask integration` starts the servers and exports their endpoints
//! (`DLOCK_TEST_ZK`, `DLOCK_TEST_ETCD`, `DLOCK_TEST_REDIS`, `DLOCK_TEST_REDLOCK`,
//! `DLOCK_TEST_REDIS_SENTINEL`); a test
//! whose endpoint is missing says so loudly, and fails under CI. Every shared recipe test
//! that needs no real server and no second process also runs on dlock-testkit's
//! in-memory backend (`mem`), which needs no endpoint.

// Without any backend feature there is nothing to instantiate the tests for.
#![cfg_attr(
    not(any(feature = "zookeeper", feature = "etcd", feature = "redis")),
    allow(dead_code, unused_macros, unused_imports)
)]

mod acquire_shape;
mod cli;
mod cli_signals;
#[cfg(feature = "zookeeper")]
mod curator;
#[cfg(feature = "zookeeper")]
mod curator_peer;
mod election;
mod etcd_election;
mod faults;
mod fuzz;
mod late_grant;
mod listing;
mod own_client;
mod recipes;
#[cfg(feature = "redis")]
mod redis_cluster;
#[cfg(feature = "redis")]
mod redis_faults;
mod reentry;
mod removal;
mod secure;
mod semaphore;
#[cfg(all(feature = "etcd", feature = "zookeeper"))]
mod server_faults;
mod spans;
mod support;
#[cfg(feature = "zookeeper")]
mod zk_faults;
#[cfg(feature = "zookeeper")]
mod zk_herd;
#[cfg(feature = "zookeeper")]
mod zk_revoke;
#[cfg(feature = "zookeeper")]
mod zk_scenarios;

/// Instantiates every shared test for one backend.
macro_rules! backend_tests {
    ($module:ident, $kind:expr, $feature:literal; $($test:path),* $(,)?) => {
        #[cfg(feature = $feature)]
        mod $module {
            $(
                paste_test!($test, $kind);
            )*
        }
    };
}

/// One `#[tokio::test]` named after the shared test function it runs.
macro_rules! paste_test {
    ($test:path, $kind:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        #[allow(non_snake_case)]
        async fn run() {
            let _cluster = crate::support::cluster_shared().await;
            if let Some(url) = crate::support::url($kind) {
                $test($kind, &url).await;
            }
        }
    };
}

/// One `#[tokio::test]` running a shared test on the in-memory backend. It needs no
/// server and no endpoint, so it never skips, and it does not take the cluster lock:
/// server faults cannot touch it.
macro_rules! mem_test {
    ($test:path) => {
        mod mem {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn run() {
                $test(crate::support::Kind::Mem, crate::support::MEM_URL).await;
            }
        }
    };
}

/// Instantiates each shared test on every real backend, and on mem where it is marked
/// `mem`. Tests marked `servers` run on real backends only: each says why.
macro_rules! all_backends {
    ($($on:ident $test:ident => $path:path),* $(,)?) => {
        $(
            mod $test {
                backend_tests!(zk, crate::support::Kind::Zk, "zookeeper"; $path);
                backend_tests!(etcd, crate::support::Kind::Etcd, "etcd"; $path);
                backend_tests!(redis, crate::support::Kind::Redis, "redis"; $path);
                backend_tests!(redlock, crate::support::Kind::Redlock, "redis"; $path);
                backend_tests!(redis_sentinel, crate::support::Kind::RedisSentinel, "redis"; $path);
                backend_tests!(redis_cluster, crate::support::Kind::RedisCluster, "redis"; $path);
                all_backends!(@$on $path);
            }
        )*
    };
    (@mem $path:path) => { mem_test!($path); };
    (@servers $path:path) => {};
}

all_backends! {
    mem mutex_excludes_and_tokens_grow => crate::recipes::mutex_excludes_and_tokens_grow,
    mem joined_futures_never_share_a_hold => crate::reentry::joined_futures_never_share_a_hold,
    mem select_branch_waits_for_the_holder => crate::reentry::select_branch_waits_for_the_holder,
    mem a_local_task_run_inside_a_scope_does_not_reenter => crate::reentry::a_local_task_run_inside_a_scope_does_not_reenter,
    mem moved_guard_leaves_no_reentry_behind => crate::reentry::moved_guard_leaves_no_reentry_behind,
    mem nested_reentry_through_guard_and_scope => crate::reentry::nested_reentry_through_guard_and_scope,
    mem lost_hold_is_never_reentered_or_downgraded => crate::reentry::lost_hold_is_never_reentered_or_downgraded,
    mem reentered_guards_report_a_lost_hold_on_release => crate::reentry::reentered_guards_report_a_lost_hold_on_release,
    mem non_reentrant_and_upgrade_in_scope_are_typed_errors => crate::reentry::non_reentrant_and_upgrade_in_scope_are_typed_errors,
    mem a_scoped_future_made_in_a_scope_does_not_carry_its_hold => crate::reentry::a_scoped_future_made_in_a_scope_does_not_carry_its_hold,
    mem timeout_and_try_lock_leave_nothing => crate::recipes::timeout_and_try_lock_leave_nothing,
    mem zero_timeout_takes_a_free_lock => crate::acquire_shape::zero_timeout_takes_a_free_lock_and_fails_at_once_on_a_held_one,
    mem many_permits_are_one_guard => crate::acquire_shape::many_permits_are_one_guard_and_tries_take_all_or_nothing,
    mem cancelled_acquisitions_leave_nothing => crate::recipes::cancelled_acquisitions_leave_nothing,
    mem bad_input_gives_typed_errors => crate::recipes::bad_input_gives_typed_errors,
    servers replicas_where_they_mean_something => crate::recipes::replicas_where_they_mean_something,
    mem huge_session_options_are_clamped => crate::recipes::huge_session_options_are_clamped_not_a_panic,
    mem missing_capabilities_fail_at_the_call => crate::recipes::missing_capabilities_fail_at_the_call,
    mem rwlock_readers_share_writers_exclude => crate::recipes::rwlock_readers_share_writers_exclude,
    mem rwlock_downgrade => crate::recipes::rwlock_downgrade,
    mem downgrade_beside_a_deleted_write_is_lost => crate::recipes::downgrade_beside_a_deleted_write_is_lost,
    mem semaphore_peak_equals_permits => crate::recipes::semaphore_peak_equals_permits,
    mem a_waiter_gets_the_permit_any_holder_gives_back => crate::semaphore::a_waiter_gets_the_permit_any_holder_gives_back,
    mem a_long_semaphore_queue_hands_every_permit_on => crate::semaphore::a_long_semaphore_queue_hands_every_permit_on,
    mem a_permit_waiter_whose_entry_went_is_never_granted => crate::semaphore::a_permit_waiter_whose_entry_went_is_never_granted,
    mem failed_removals_keep_trying_while_the_session_lives => crate::removal::failed_removals_keep_trying_while_the_session_lives,
    mem a_dropped_guard_hands_the_lock_on_before_its_session_ends => crate::removal::a_dropped_guard_hands_the_lock_on_before_its_session_ends,
    mem entries_dropped_off_the_runtime_still_go => crate::removal::entries_dropped_off_the_runtime_still_go,
    mem entries_dropped_inside_another_runtime_still_go => crate::removal::entries_dropped_inside_another_runtime_still_go,
    mem multilock_rollback_and_order => crate::recipes::multilock_rollback_and_order,
    mem lost_signal_fires_on_session_end => crate::recipes::lost_signal_fires_on_session_end,
    mem a_starved_runtime_knows_its_session_deadline_passed => crate::recipes::a_starved_runtime_knows_its_session_deadline_passed,
    mem verify_checks_the_entry_on_the_server => crate::recipes::verify_checks_the_entry_on_the_server,
    mem a_waiter_whose_entry_went_is_never_granted => crate::recipes::a_waiter_whose_entry_went_is_never_granted,
    mem health_is_ok_while_live_and_an_error_after_close => crate::recipes::health_is_ok_while_live_and_an_error_after_close,
    mem locks_lists_what_is_held_and_waited_for => crate::listing::locks_lists_what_is_held_and_waited_for,
    mem election_one_leader_at_a_time => crate::election::one_leader_at_a_time_and_terms_grow,
    mem election_resign_hands_over_in_fifo_order => crate::election::resign_hands_over_in_fifo_order,
    mem election_cancelled_campaigns_leave_nothing => crate::election::cancelled_campaigns_leave_nothing,
    mem election_leader_names_the_value_and_term => crate::election::leader_names_the_value_and_term,
    mem election_observe_sees_every_change_in_order => crate::election::observe_sees_every_change_in_order,
    mem election_lost_fires_before_the_next_leads => crate::election::lost_leadership_fires_before_the_next_leads,
    mem election_deposed_leader_cannot_proclaim => crate::election::deposed_leader_cannot_proclaim,
    // The rest run the `dlock` binary as separate OS processes (`dlock exec`, `dlock
    // status`, SIGKILL/SIGSTOP of a holder), which must reach the backend through a URL:
    // an in-memory server lives inside this test process and has none.
    // A namespace is a URL parameter (a chroot on ZooKeeper): mem has no URL.
    servers namespaces_keep_applications_apart => crate::recipes::namespaces_keep_applications_apart,
    // The client libraries' own clients: real servers only.
    servers own_client_shares_locks => crate::own_client::own_client_shares_locks_and_leaves_the_connection_open,
    servers cli_processes_never_overlap => crate::cli::cli_processes_never_overlap,
    servers cli_exit_codes => crate::cli::cli_exit_codes,
    servers cli_sigkill_frees_the_lock => crate::cli::cli_sigkill_frees_the_lock,
    servers cli_status_shows_queue => crate::cli::cli_status_shows_queue,
    servers cli_elect_and_leader => crate::cli::cli_elect_and_leader,
    servers cli_list_shows_locks => crate::cli::cli_list_shows_locks,
    servers cli_paused_holder_exits_70 => crate::faults::cli_paused_holder_exits_70,
    servers cli_paused_leader_exits_70 => crate::faults::cli_paused_leader_exits_70,
    servers cli_killed_leader_is_replaced => crate::faults::cli_killed_leader_is_replaced,
    servers cli_unnoticed_loss_exits_70 => crate::faults::cli_unnoticed_loss_exits_70,
    servers cli_lost_lock_stops_the_whole_process_group => crate::faults::cli_lost_lock_stops_the_whole_process_group,
    servers cli_hangup_stops_the_command_before_dlock_exits => crate::cli_signals::cli_hangup_stops_the_command_before_dlock_exits,
    servers cli_leftovers_of_the_command_stop_before_the_release => crate::cli_signals::cli_leftovers_of_the_command_stop_before_the_release,
    servers cli_interrupted_waiter_leaves_the_queue => crate::cli_signals::cli_interrupted_waiter_leaves_the_queue,
    servers cli_closed_output_changes_no_exit_code => crate::cli_signals::cli_closed_output_changes_no_exit_code,
    servers cli_stopped_dlock_stops_its_command => crate::cli_signals::cli_stopped_dlock_stops_its_command,
    servers cli_signal_reaches_a_stopped_command => crate::cli_signals::cli_signal_reaches_a_stopped_command,
}

/// One `#[tokio::test]` per backend running a shared test against the secured variant
/// of its server (TLS, credentials, access control: `DLOCK_TEST_SECURE_*`). The kind is
/// the plain backend's: the same adapter, reached another way.
macro_rules! secure_tests {
    ($($test:ident => $path:path),* $(,)?) => {
        $(
            mod $test {
                secure_tests!(@one zk, crate::support::Kind::Zk, "zookeeper", $path);
                secure_tests!(@one etcd, crate::support::Kind::Etcd, "etcd", $path);
                secure_tests!(@one redis, crate::support::Kind::Redis, "redis", $path);
                secure_tests!(@one redlock, crate::support::Kind::Redlock, "redis", $path);
                secure_tests!(@one redis_sentinel, crate::support::Kind::RedisSentinel, "redis", $path);
                secure_tests!(@one redis_cluster, crate::support::Kind::RedisCluster, "redis", $path);
            }
        )*
    };
    (@one $module:ident, $kind:expr, $feature:literal, $path:path) => {
        #[cfg(feature = $feature)]
        mod $module {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn run() {
                if let Some(url) = crate::support::secure_url($kind) {
                    $path($kind, &url).await;
                }
            }
        }
    };
}

secure_tests! {
    secure_mutex_excludes_and_tokens_grow => crate::recipes::mutex_excludes_and_tokens_grow,
    secure_lost_signal_fires_on_session_end => crate::recipes::lost_signal_fires_on_session_end,
    secure_cancelled_acquisitions_leave_nothing => crate::recipes::cancelled_acquisitions_leave_nothing,
    secure_rwlock_readers_share_writers_exclude => crate::recipes::rwlock_readers_share_writers_exclude,
    secure_semaphore_peak_equals_permits => crate::recipes::semaphore_peak_equals_permits,
    secure_health => crate::recipes::health_is_ok_while_live_and_an_error_after_close,
    secure_wrong_password => crate::secure::wrong_password_is_refused_and_leaves_nothing,
    secure_no_permission => crate::secure::user_without_permission_is_refused_and_leaves_nothing,
    secure_untrusted_certificate => crate::secure::untrusted_server_certificate_is_a_tls_error,
    secure_cli => crate::secure::cli_on_secured_servers,
}

#[cfg(feature = "zookeeper")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secure_zk_outsider_cannot_delete_a_holders_node() {
    if let Some(url) = crate::support::secure_url(crate::support::Kind::Zk) {
        crate::secure::zk_outsider_cannot_delete_a_holders_node(&url).await;
    }
}

#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secure_etcd_missing_client_certificate_is_a_tls_error() {
    if let Some(url) = crate::support::secure_url(crate::support::Kind::Etcd) {
        crate::secure::etcd_missing_client_certificate_is_a_tls_error(&url).await;
    }
}

#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secure_etcd_no_permission_leaves_no_lease() {
    if let Some(url) = crate::support::secure_url(crate::support::Kind::Etcd) {
        crate::secure::etcd_no_permission_leaves_no_lease(&url).await;
    }
}

/// Curator authenticated with the same digest credentials, over the same TLS, shares the
/// lock with dlock in both directions (the plain-URL test, on the secured ZooKeeper).
#[cfg(feature = "zookeeper")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secure_curator_mutex_interop() {
    if let Some(url) = crate::support::secure_url(crate::support::Kind::Zk) {
        // The chroot must exist with dlock's ACL before Curator creates under it.
        let _first = crate::support::client(&url).await;
        crate::curator::mutex_interop(&url).await;
    }
}

// Not on mem either, below: etcdctl interop (another program, etcd's own keys), server
// faults (they kill, pause or cut off real server processes, which mem does not model:
// its own fault hooks are tested in dlock-testkit), and the ZooKeeper-only tests, which
// are written for ZooKeeper itself (Curator interop in a JVM, znodes read and deleted
// through the client crate, the herd counts' expectations of ZooKeeper's queue, CLI
// processes).

// etcd only: interop with etcd's own lock, and leader failover.
mod etcdctl_lock_blocks_dlock {
    backend_tests!(etcd, crate::support::Kind::Etcd, "etcd"; crate::faults::etcdctl_lock_blocks_dlock);
}
mod dlock_blocks_etcdctl_lock {
    backend_tests!(etcd, crate::support::Kind::Etcd, "etcd"; crate::faults::dlock_blocks_etcdctl_lock);
}
mod etcdctl_elect_interop {
    backend_tests!(etcd, crate::support::Kind::Etcd, "etcd"; crate::etcd_election::etcdctl_elect_interop);
}
mod etcd_lost_enqueue_reply_leaves_one_raw_candidate {
    backend_tests!(etcd, crate::support::Kind::Etcd, "etcd"; crate::etcd_election::lost_enqueue_reply_leaves_one_raw_candidate);
}
mod etcd_mixed_permit_counts_never_share_beyond_a_holders_count {
    backend_tests!(etcd, crate::support::Kind::Etcd, "etcd"; crate::semaphore::mixed_permit_counts_never_share_beyond_a_holders_count);
}
mod etcd_a_smaller_count_far_ahead_is_watched {
    backend_tests!(etcd, crate::support::Kind::Etcd, "etcd"; crate::semaphore::a_smaller_count_far_ahead_is_watched);
}
mod etcd_semaphore_is_one_ranked_queue {
    backend_tests!(etcd, crate::support::Kind::Etcd, "etcd"; crate::semaphore::etcd_semaphore_is_one_ranked_queue);
}
mod etcd_leader_kill_keeps_the_lock {
    backend_tests!(etcd, crate::support::Kind::Etcd, "etcd"; crate::faults::etcd_leader_kill_keeps_the_lock);
}

/// A multi-lock over names on three Redis Cluster masters.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_multilock_spans_masters() {
    if let Some(url) = crate::support::url(crate::support::Kind::RedisCluster) {
        crate::redis_cluster::multilock_spans_masters(&url).await;
    }
}

/// Server-side faults on a 3-node cluster: they stop servers, so they run alone.
macro_rules! exclusive {
    ($($test:ident => $kind:expr, $feature:literal, $path:path),* $(,)?) => {
        $(
            #[cfg(all(feature = "etcd", feature = "zookeeper", feature = $feature))]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                let _cluster = crate::support::cluster_exclusive().await;
                if let Some(url) = crate::support::url($kind) {
                    $path(&url).await;
                }
            }
        )*
    };
}

exclusive! {
    etcd_leader_paused_shorter_than_the_lease => crate::support::Kind::Etcd, "etcd", crate::server_faults::etcd_leader_paused_shorter_than_the_lease,
    etcd_leader_paused_longer_than_the_lease => crate::support::Kind::Etcd, "etcd", crate::server_faults::etcd_leader_paused_longer_than_the_lease,
    zk_leader_paused_longer_than_the_session => crate::support::Kind::Zk, "zookeeper", crate::server_faults::zk_leader_paused_longer_than_the_session,
    zk_leader_cut_from_the_quorum => crate::support::Kind::Zk, "zookeeper", crate::server_faults::zk_leader_cut_from_the_quorum,
    etcd_holder_cut_off => crate::support::Kind::Etcd, "etcd", crate::server_faults::etcd_holder_cut_off,
    zk_holder_cut_off => crate::support::Kind::Zk, "zookeeper", crate::server_faults::zk_holder_cut_off,
    sentinel_holder_behind_a_stale_sentinel => crate::support::Kind::RedisSentinel, "redis", crate::server_faults::sentinel_holder_behind_a_stale_sentinel,
    sentinel_fresh_client_behind_a_stale_sentinel => crate::support::Kind::RedisSentinel, "redis", crate::server_faults::sentinel_fresh_client_behind_a_stale_sentinel,
    sentinel_reconnect_to_the_old_primary_is_checked => crate::support::Kind::RedisSentinel, "redis", crate::server_faults::sentinel_reconnect_to_the_old_primary_is_checked,
    sentinel_client_that_missed_the_failover_is_moved => crate::support::Kind::RedisSentinel, "redis", crate::server_faults::sentinel_client_that_missed_the_failover_is_moved,
    etcd_resumed_leader_and_a_lease_kept_alive_elsewhere => crate::support::Kind::Etcd, "etcd", crate::server_faults::etcd_resumed_leader_and_a_lease_kept_alive_elsewhere,
    etcd_late_enqueue_leaves_no_orphan => crate::support::Kind::Etcd, "etcd", crate::server_faults::etcd_late_enqueue_leaves_no_orphan,
    etcd_late_candidate_enqueue_leaves_one_entry_and_no_orphan => crate::support::Kind::Etcd, "etcd", crate::server_faults::etcd_late_candidate_enqueue_leaves_one_entry_and_no_orphan,
    etcd_candidate_key_recreated_during_its_enqueue_is_not_orphaned => crate::support::Kind::Etcd, "etcd", crate::server_faults::etcd_candidate_key_recreated_during_its_enqueue_is_not_orphaned,
    redis_waiter_whose_entry_was_wiped_never_grants_itself => crate::support::Kind::Redis, "redis", crate::redis_faults::waiter_whose_entry_was_wiped_never_grants_itself,
    redis_waiter_whose_entry_key_was_deleted_never_holds => crate::support::Kind::Redis, "redis", crate::redis_faults::waiter_whose_entry_key_was_deleted_never_holds,
}

/// ZooKeeper-only tests: Curator interop, herd counting, faults. `shared` tests run
/// beside others; `exclusive` ones take servers down and run alone.
macro_rules! zk_only {
    ($($mode:ident $test:ident => $path:path),* $(,)?) => {
        #[cfg(feature = "zookeeper")]
        mod zk_only {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    let _cluster = zk_only!(@lock $mode);
                    if let Some(url) = crate::support::url(crate::support::Kind::Zk) {
                        $path(&url).await;
                    }
                }
            )*
        }
    };
    (@lock shared) => { crate::support::cluster_shared().await };
    (@lock exclusive) => { crate::support::cluster_exclusive().await };
}

zk_only! {
    shared curator_mutex_interop => crate::curator::mutex_interop,
    shared curator_rwlock_interop => crate::curator::rwlock_interop,
    shared curator_semaphore_interop => crate::curator::semaphore_interop,
    shared curator_shared_count_interop => crate::curator::shared_count_interop,
    shared curator_leader_latch_interop => crate::curator::leader_latch_interop,
    shared no_herd_mutex_queue_of_50 => crate::zk_herd::mutex_queue_of_50,
    shared no_herd_readers_behind_writer => crate::zk_herd::readers_behind_writer,
    shared container_parents_are_reaped => crate::zk_scenarios::container_parents_are_reaped,
    shared semaphore_interrupted_acquire_leaves_no_orphans => crate::zk_scenarios::semaphore_interrupted_acquire_leaves_no_orphans,
    shared semaphore_deleted_internal_lock_is_a_typed_error => crate::zk_scenarios::semaphore_deleted_internal_lock_is_a_typed_error,
    shared semaphore_lease_added_outside_the_mutex_is_counted => crate::zk_scenarios::semaphore_lease_added_outside_the_mutex_is_counted,
    shared guard_lost_fires_on_session_expiry => crate::zk_faults::guard_lost_fires_on_session_expiry,
    shared cli_sigstop_past_session_exits_70 => crate::zk_faults::cli_sigstop_past_session_exits_70,
    shared revoke_between_dlock_clients => crate::zk_revoke::revoke_between_dlock_clients,
    shared revoke_interop_with_curator => crate::zk_revoke::revoke_interop_with_curator,
    shared cli_revoke => crate::zk_revoke::cli_revoke,
    shared revoke_never_asks_an_election_leader => crate::zk_revoke::revoke_never_asks_an_election_leader,
    exclusive locks_survive_leader_kill => crate::zk_faults::locks_survive_leader_kill,
    exclusive follower_cut_from_leader_loses_before_the_next_grant => crate::zk_faults::follower_cut_from_leader_loses_before_the_next_grant,
    exclusive verify_never_confirms_from_a_lagging_follower => crate::zk_faults::verify_never_confirms_from_a_lagging_follower,
    exclusive borrowed_session_proof_is_taken_on_one_connection => crate::zk_faults::borrowed_session_proof_is_taken_on_one_connection,
    shared borrowed_session_without_a_tick_keeps_its_locks => crate::zk_faults::borrowed_session_without_a_tick_keeps_its_locks,
}

/// On the backends whose semaphores are ranked: etcd, and mem with its ranking on.
mod ranked_waiter_hearing_removals_out_of_order_is_not_granted {
    #[cfg(feature = "etcd")]
    mod etcd {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn run() {
            let _cluster = crate::support::cluster_shared().await;
            if let Some(url) = crate::support::url(crate::support::Kind::Etcd) {
                crate::semaphore::ranked_waiter_hearing_removals_out_of_order_is_not_granted(
                    || crate::support::client(&url),
                )
                .await;
            }
        }
    }

    mod mem {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn run() {
            let server = dlock_testkit::mem::MemServer::new();
            server.rank_semaphores(true);
            crate::semaphore::ranked_waiter_hearing_removals_out_of_order_is_not_granted(
                || async {
                    let backend = server
                        .connect(dlock::SessionOptions::default())
                        .await
                        .expect("connect to the in-memory server");
                    dlock::Client::new(backend as std::sync::Arc<dyn dlock::DynBackend>)
                },
            )
            .await;
        }
    }
}

/// Redlock only: its own key deletions touch nothing but its lock's keys, so it runs
/// beside the others.
mod redlock_verify_needs_the_entry_on_a_majority {
    backend_tests!(redlock, crate::support::Kind::Redlock, "redis"; crate::redis_faults::redlock_verify_needs_the_entry_on_a_majority);
}

/// One Redis master: a part's entry lost alone (its key deleted) is a loss of that part
/// only, which the backends with session-wide losses cannot stage.
mod multilock_with_a_part_lost_meanwhile_is_not_granted {
    backend_tests!(redis, crate::support::Kind::Redis, "redis"; crate::redis_faults::multilock_with_a_part_lost_meanwhile_is_not_granted);
}

/// One Redis master: the URL's database is checked by the server.
mod a_database_the_server_lacks_is_a_url_error {
    backend_tests!(redis, crate::support::Kind::Redis, "redis"; crate::redis_faults::a_database_the_server_lacks_is_a_url_error);
}

/// One Redis master: an ACL user of the test's own refuses the holder's release.
mod a_release_the_server_refused_is_retried_until_it_goes {
    backend_tests!(redis, crate::support::Kind::Redis, "redis"; crate::redis_faults::a_release_the_server_refused_is_retried_until_it_goes);
}

/// The CLI's own signal handling, the same on every backend: one server is enough.
mod cli_continue_right_after_a_stop_cancels_it {
    backend_tests!(redis, crate::support::Kind::Redis, "redis"; crate::cli_signals::cli_continue_right_after_a_stop_cancels_it);
}

/// One Redis master: the holder's renewals refused by an ACL user of the test's own.
mod cli_default_grace_ends_before_the_next_holder {
    backend_tests!(redis, crate::support::Kind::Redis, "redis"; crate::redis_faults::cli_default_grace_ends_before_the_next_holder);
}
