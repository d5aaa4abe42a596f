//! The contract of the optional capabilities ([`super::Capability`]): what a backend
//! that claims one keeps, and how one that does not refuses it.

use std::time::Duration;

use dlock_core::entry::REVOKE_MESSAGE;
use dlock_core::{Capability, EntryKind, Error, Position};

use super::{add, eventually, fresh_queue, session, within, Connect};

/// [`super::Capability::Revocation`]: another session's `set_data` reaches the holder's
/// `wait_data_changed` and does not end a `wait_gone`; `wait_data_changed` returns at
/// once when the payload already differs and `None` once the entry is gone; `set_data`
/// on a gone entry succeeds.
pub async fn set_data_reaches_wait_data_changed_not_wait_gone(connect: Connect) {
    let holder = session(&connect).await;
    assert!(
        holder.supports(Capability::Revocation),
        "the backend does not claim it"
    );
    let revoker = session(&connect).await;
    let q = fresh_queue(&*holder, "revoke");
    let e = within(
        "enqueue",
        holder.enqueue(
            &q,
            &crate::ticket(),
            EntryKind::Lock,
            Position::Tail,
            b"owner",
        ),
    )
    .await
    .expect("enqueue")
    .mine;
    let changed = {
        let (holder, q, e) = (holder.clone(), q.clone(), e.clone());
        tokio::spawn(async move { holder.wait_data_changed(&q, &e, b"owner").await })
    };
    let gone = {
        let (revoker, q, e) = (revoker.clone(), q.clone(), e.clone());
        tokio::spawn(async move { revoker.wait_gone(&q, &e).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !changed.is_finished(),
        "wait_data_changed returned with no change"
    );
    within("set_data", revoker.set_data(&q, &e, REVOKE_MESSAGE))
        .await
        .expect("set_data");
    let got = within("the holder hears it", changed)
        .await
        .expect("join")
        .expect("wait_data_changed");
    assert_eq!(got.as_deref(), Some(REVOKE_MESSAGE));
    eventually("the revoker reads the new payload", || async {
        revoker.participants(&q).await.expect("participants")[0].data == REVOKE_MESSAGE
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !gone.is_finished(),
        "wait_gone returned on a payload change"
    );
    let again = within(
        "already different",
        holder.wait_data_changed(&q, &e, b"owner"),
    )
    .await
    .expect("wait_data_changed");
    assert_eq!(again.as_deref(), Some(REVOKE_MESSAGE));
    within("remove", holder.remove(&q, &e))
        .await
        .expect("remove");
    within("wait_gone after the remove", gone)
        .await
        .expect("join")
        .expect("wait_gone");
    let after = within(
        "gone entry",
        holder.wait_data_changed(&q, &e, REVOKE_MESSAGE),
    )
    .await
    .expect("wait_data_changed on a gone entry");
    assert_eq!(after, None);
    within(
        "set_data on a gone entry",
        revoker.set_data(&q, &e, REVOKE_MESSAGE),
    )
    .await
    .expect("set_data on a gone entry succeeds");
    within("close", holder.close()).await.expect("close");
    within("close", revoker.close()).await.expect("close");
}

/// Not claiming [`super::Capability::Revocation`]: the backend says so
/// ([`dlock_core::Backend::supports`]), and `set_data` and `wait_data_changed` fail with
/// [`Error::Unsupported`] (never succeed doing nothing) and leave the entry as it was;
/// a backend that claims [`super::Capability::Proclaim`] has `wait_data_changed`, which
/// must then report the entry's payload.
pub async fn revocation_unsupported_is_a_typed_error(connect: Connect) {
    let b = session(&connect).await;
    assert!(
        !b.supports(Capability::Revocation),
        "the backend claims revocation"
    );
    let q = fresh_queue(&*b, "no-revoke");
    let e = within(
        "enqueue",
        b.enqueue(
            &q,
            &crate::ticket(),
            EntryKind::Lock,
            Position::Tail,
            b"owner",
        ),
    )
    .await
    .expect("enqueue")
    .mine;
    let refused = |e: &Error| {
        matches!(
            e,
            Error::Unsupported {
                capability: Capability::Revocation,
                ..
            }
        )
    };
    let got = within("set_data", b.set_data(&q, &e, REVOKE_MESSAGE)).await;
    assert!(got.as_ref().is_err_and(refused), "set_data gave {got:?}");
    if b.supports(Capability::Proclaim) {
        // `wait_data_changed` is part of `Proclaim` too (an election watches its
        // leader's value): it reports the payload, at once when it differs from `seen`.
        let got = within("wait_data_changed", b.wait_data_changed(&q, &e, b"other")).await;
        assert_eq!(
            got.expect("wait_data_changed"),
            Some(b"owner".to_vec()),
            "the payload as enqueued"
        );
    } else {
        let got = within("wait_data_changed", b.wait_data_changed(&q, &e, b"owner")).await;
        assert!(
            got.as_ref().is_err_and(refused),
            "wait_data_changed gave {got:?}"
        );
    }
    let detail = within("participants", b.participants(&q))
        .await
        .expect("participants");
    assert_eq!(detail.len(), 1);
    assert_eq!(detail[0].data, b"owner");
    within("close", b.close()).await.expect("close");
}

/// [`super::Capability::SharedValue`]: `read_value` of a queue nobody set a value on is
/// `None`, before and after entries are queued there, and reading it changes nothing.
/// (Setting the value is not a `Backend` method: each adapter's own tests set it through
/// its client.)
pub async fn read_value_is_none_until_set(connect: Connect) {
    let b = session(&connect).await;
    assert!(
        b.supports(Capability::SharedValue),
        "the backend does not claim it"
    );
    let q = fresh_queue(&*b, "value");
    assert_eq!(
        within("read_value", b.read_value(&q))
            .await
            .expect("read_value"),
        None
    );
    let e = add(&*b, &q, EntryKind::Lock, "enqueue").await;
    assert_eq!(
        within("read_value", b.read_value(&q))
            .await
            .expect("read_value"),
        None
    );
    let now = within("queue", b.queue(&q)).await.expect("queue");
    assert_eq!(now.len(), 1);
    assert_eq!(now[0].name, e.mine.name);
    within("close", b.close()).await.expect("close");
}

/// Not claiming [`super::Capability::SharedValue`]: the backend says so, and
/// `read_value` fails with [`Error::Unsupported`] instead of answering "not set".
pub async fn shared_value_unsupported_is_a_typed_error(connect: Connect) {
    let b = session(&connect).await;
    assert!(
        !b.supports(Capability::SharedValue),
        "the backend claims a shared value"
    );
    let q = fresh_queue(&*b, "no-value");
    let got = within("read_value", b.read_value(&q)).await;
    assert!(
        matches!(
            got,
            Err(Error::Unsupported {
                capability: Capability::SharedValue,
                ..
            })
        ),
        "read_value gave {got:?}"
    );
    within("close", b.close()).await.expect("close");
}
