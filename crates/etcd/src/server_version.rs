//! Which etcd server versions revoke live leases, and the warning at connect.
//!
//! etcd before 3.4.31 (3.4 line) and 3.5.13 (3.5 line) has etcd#15247: a leader that is
//! paused or stuck (SIGSTOP, a long fsync, CPU starvation) for longer than a lease's TTL
//! still believes it leads when it resumes, finds the leases expired by its own clock and
//! proposes their revocation; the new leader commits it. A lease that its client kept
//! alive through another member the whole time is revoked, and its keys (a holder's
//! entry) go at once: the next contender is granted while the holder has had no sign of
//! trouble, so its `lost()` fires only after its next keep-alive is refused. Measured on
//! Debian's 3.4.23: a lease kept alive through a follower was gone 0.5 s after the
//! leader, paused for 6 s, resumed. The fix (etcd PR 16822, backported as 17425 and 17465)
//! makes the old leader check that it still leads before it revokes.

/// True if an etcd server reporting `version` (e.g. `3.4.23`) revokes live leases when a
/// paused leader resumes (etcd#15247): 3.4 before 3.4.31, 3.5 before 3.5.13, and any
/// release before 3.4. A version that cannot be read counts as affected.
pub fn revokes_live_leases_on_leader_resume(version: &str) -> bool {
    let mut parts = version
        .trim()
        .trim_start_matches('v')
        .split(['.', '-', '+'])
        .map(|p| p.parse::<u32>().ok());
    let (Some(Some(major)), Some(Some(minor)), Some(Some(patch))) =
        (parts.next(), parts.next(), parts.next())
    else {
        return true;
    };
    match (major, minor) {
        (3, 4) => patch < 31,
        (3, 5) => patch < 13,
        (3, m) => m < 4,
        (m, _) => m < 3,
    }
}

/// Warns once per connect when a member's version has etcd#15247, saying what it means
/// for a lock and what to do about it.
pub(crate) async fn warn_if_affected(client: &mut etcd_client::Client) {
    let version = match client.status().await {
        Ok(status) => status.version().to_owned(),
        Err(e) => {
            tracing::debug!(error = %e, "could not read the etcd server version");
            return;
        }
    };
    if revokes_live_leases_on_leader_resume(&version) {
        tracing::warn!(
            %version,
            "etcd {version} revokes live leases when a paused or stalled leader resumes \
             (etcd#15247, fixed in 3.4.31 and 3.5.13): after such a stall a holder's entry \
             can vanish before its lost() fires, letting a second holder in; upgrade etcd, \
             and check the fencing token where you write"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::revokes_live_leases_on_leader_resume as affected;

    #[test]
    fn versions_before_the_fix_are_affected() {
        assert!(affected("3.4.23"));
        assert!(affected("v3.4.30"));
        assert!(!affected("3.4.31"));
        assert!(affected("3.5.12"));
        assert!(!affected("3.5.13"));
        assert!(!affected("3.6.0"));
        assert!(affected("3.3.27"));
        assert!(affected("2.3.8"));
        assert!(!affected("4.0.0"));
        assert!(affected(""));
        assert!(affected("garbage"));
        assert!(!affected("3.5.17-rc.0"));
    }
}
