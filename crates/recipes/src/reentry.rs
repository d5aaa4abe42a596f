//! Reentrancy: which code may re-enter a lock it holds.
//!
//! A hold is re-entered only by code that provably runs inside it:
//! - through the guard itself ([`crate::LockGuard::reenter`]), or
//! - inside a future the guard scopes ([`crate::LockGuard::scope`]): a tokio task-local
//!   carries the holds of the scopes the current code runs in.
//!
//! # Why not the task (or the thread)
//! Curator counts holds per Java thread, and dlock used to count them per tokio task.
//! Both are wrong for async code: `join!`, `select!`, `FuturesUnordered`,
//! `for_each_concurrent` and `buffer_unordered` poll many futures in one task, so a
//! sibling future's `lock()` "re-entered" a hold it had nothing to do with, and two
//! critical sections ran at once under one fencing token. A scope is entered only by
//! the future it wraps (and what that future polls), so a sibling waits like any other
//! contender, and a task that spawns gives the spawned task no scope at all. A scope
//! also belongs to the tokio task it was set in: a `LocalSet` driven inside it runs its
//! own tasks inside the poll of the future it is given, where the task-local is set,
//! and those tasks are not in the scope. (An executor that is not tokio's, run inside a
//! scope, polls its tasks under the enclosing tokio task's id: they are in the scope, as
//! `join!`'s futures are. Do not run one inside a scope.)

use std::any::Any;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use dlock_core::LockName;

/// Identifies one [`crate::Client`] (and its clones): holds re-enter only through the
/// client that took them, as they did with the old per-client table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ClientId(u64);

impl ClientId {
    /// A new identity, never handed out before in this process.
    pub(crate) fn next() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        ClientId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// Which recipe a hold belongs to, so a read hold and a write hold of one name are told
/// apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Recipe {
    Mutex,
    Read,
    Write,
    SemaphoreMutex,
}

/// A hold as scopes know it: which client took which recipe of which lock.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct HoldKey {
    pub(crate) client: ClientId,
    pub(crate) lock: LockName,
    pub(crate) recipe: Recipe,
}

impl HoldKey {
    /// The same client and lock under another recipe.
    pub(crate) fn with_recipe(&self, recipe: Recipe) -> HoldKey {
        HoldKey {
            recipe,
            ..self.clone()
        }
    }
}

tokio::task_local! {
    /// The holds of the scopes the current future runs in, innermost last.
    static SCOPE: Scope;
}

/// The holds a piece of code runs inside. Values are the holds themselves
/// (`Arc<Held<B>>`), type-erased because a task-local cannot be generic.
#[derive(Clone, Default)]
pub(crate) struct Scope {
    holds: Vec<(HoldKey, Arc<dyn Any + Send + Sync>)>,
    /// The tokio task whose poll the scope was set in. A task-local is set for the whole
    /// of one poll, and an executor polled inside it runs other tasks in that poll
    /// (`LocalSet::run_until` ticks its tasks there): those tasks see the task-local
    /// too, and must not be taken for code inside the scope.
    task: Option<tokio::task::Id>,
}

impl Scope {
    /// The scope the current code runs in (empty outside every scope, and in a task
    /// other than the one that set the scope).
    pub(crate) fn current() -> Scope {
        SCOPE
            .try_with(|s| s.ours().then(|| s.clone()))
            .ok()
            .flatten()
            .unwrap_or_default()
    }

    /// Whether the current code runs in the task that set this scope.
    fn ours(&self) -> bool {
        self.task == tokio::task::try_id()
    }

    /// This scope plus one more hold, set in the current task.
    pub(crate) fn with(mut self, key: HoldKey, held: Arc<dyn Any + Send + Sync>) -> Scope {
        self.holds.push((key, held));
        self.task = tokio::task::try_id();
        self
    }

    /// Runs `fut` inside this scope. Only `fut` and what it polls see it: not a future
    /// polled beside it, not a task it spawns.
    #[cfg(test)]
    pub(crate) fn run<F: Future>(self, fut: F) -> impl Future<Output = F::Output> {
        SCOPE.scope(self, fut)
    }

    /// Runs `fut` with `hold` added to the scope it is polled in, read afresh at every
    /// poll: a future polled inside some scope once and later outside it takes nothing
    /// of that scope along. Only `fut` and what it polls see the hold: not a future
    /// polled beside it, not a task it spawns.
    pub(crate) fn holding<F: Future>(
        hold: Option<(HoldKey, Arc<dyn Any + Send + Sync>)>,
        fut: F,
    ) -> impl Future<Output = F::Output> {
        let mut fut = Box::pin(fut);
        std::future::poll_fn(move |cx| {
            let around = Scope::current();
            let scope = match &hold {
                Some((k, held)) => around.with(k.clone(), held.clone()),
                None => around,
            };
            SCOPE.sync_scope(scope, || fut.as_mut().poll(cx))
        })
    }

    /// The innermost hold of `key` the current code runs inside, if any.
    pub(crate) fn find<T: Any + Send + Sync>(key: &HoldKey) -> Option<Arc<T>> {
        SCOPE
            .try_with(|s| {
                if !s.ours() {
                    return None;
                }
                s.holds
                    .iter()
                    .rev()
                    .find(|(k, _)| k == key)
                    .map(|(_, h)| h.clone())
            })
            .ok()
            .flatten()
            .and_then(|h| h.downcast::<T>().ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlock_core::NameRules;

    fn key(client: ClientId, recipe: Recipe) -> HoldKey {
        HoldKey {
            client,
            lock: LockName::new("a", NameRules::common()).expect("name"),
            recipe,
        }
    }

    #[tokio::test]
    async fn only_the_scoped_future_sees_the_hold() {
        let c = ClientId::next();
        let k = key(c, Recipe::Mutex);
        let held: Arc<dyn Any + Send + Sync> = Arc::new(7u32);
        assert!(Scope::find::<u32>(&k).is_none(), "outside every scope");
        let inside = Scope::current()
            .with(k.clone(), held)
            .run(async { Scope::find::<u32>(&k).map(|v| *v) });
        // A sibling future joined beside the scoped one does not see the hold.
        let sibling = async { Scope::find::<u32>(&k).map(|v| *v) };
        let (a, b) = tokio::join!(inside, sibling);
        assert_eq!(a, Some(7));
        assert_eq!(b, None);
        // Nor does another client's, or another recipe's, lookup.
        let other = Scope::current()
            .with(k.clone(), Arc::new(7u32))
            .run(async {
                (
                    Scope::find::<u32>(&key(ClientId::next(), Recipe::Mutex)).is_some(),
                    Scope::find::<u32>(&k.with_recipe(Recipe::Write)).is_some(),
                )
            })
            .await;
        assert_eq!(other, (false, false));
    }

    #[tokio::test]
    async fn a_spawned_task_starts_outside_every_scope() {
        let k = key(ClientId::next(), Recipe::Mutex);
        let k2 = k.clone();
        let seen = Scope::current()
            .with(k.clone(), Arc::new(1u32))
            .run(async move {
                tokio::spawn(async move { Scope::find::<u32>(&k2).is_some() })
                    .await
                    .expect("task")
            })
            .await;
        assert!(!seen);
    }

    #[tokio::test]
    async fn nested_scopes_keep_the_outer_holds() {
        let c = ClientId::next();
        let (kw, kr) = (key(c, Recipe::Write), key(c, Recipe::Read));
        let both = Scope::current()
            .with(kw.clone(), Arc::new(1u32))
            .run(async {
                Scope::current()
                    .with(kr.clone(), Arc::new(2u32))
                    .run(async {
                        (
                            Scope::find::<u32>(&kw).map(|v| *v),
                            Scope::find::<u32>(&kr).map(|v| *v),
                        )
                    })
                    .await
            })
            .await;
        assert_eq!(both, (Some(1), Some(2)));
    }
}
