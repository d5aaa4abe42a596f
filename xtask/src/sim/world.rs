//! One seed of the simulation: an in-memory server whose replies, heartbeats and watch
//! events fail as the seed draws, workers that take one recipe again and again, a fault
//! task that cuts workers off and lets them back, and the verdict.
//!
//! Every random choice comes from the seed, on a current-thread runtime with paused time:
//! one seed is one schedule, replayed exactly.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dlock::{Client, DynBackend, Entry, Error, LockGuard, SessionOptions, TicketSource};
use dlock_core::{driver, LockName, NameRules, QueuePath};
use dlock_testkit::mem::{FaultPlan, MemServer, SessionId};
use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};
use tokio::time::Instant;

use crate::chaos::history::{check, Mode, Record, Rules, WriteOutcome};
use crate::chaos::Recipe;

/// Every session's timeout (virtual time).
const SESSION: Duration = Duration::from_secs(2);
/// Acquires per worker.
const TURNS: u32 = 6;
/// How long one acquire may wait (virtual time).
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);
/// The semaphore's permits; it has one worker more.
const PERMITS: u32 = 2;

/// What one seed found.
pub(crate) struct Outcome {
    /// Sections begun.
    pub(crate) sections: u64,
    /// Workers cut off from the server.
    pub(crate) faults: u64,
    /// Waiters' entries deleted from outside.
    pub(crate) deleted: u64,
    /// What went wrong; empty when the seed passed.
    pub(crate) violations: Vec<String>,
}

/// The history every worker appends to, with times in virtual microseconds.
#[derive(Clone)]
struct History {
    start: Instant,
    records: Arc<Mutex<Vec<Record>>>,
}

impl History {
    fn now_us(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    fn push(&self, r: Record) {
        self.records.lock().push(r);
    }

    fn begin(&self, worker: u32, token: u64, mode: Mode) {
        let at_us = self.now_us();
        self.push(Record::Begin {
            worker,
            pid: 0,
            token,
            at_us,
            mode,
        });
    }

    fn end(&self, worker: u32, token: u64) {
        let at_us = self.now_us();
        self.push(Record::End {
            worker,
            pid: 0,
            token,
            at_us,
            write: WriteOutcome::None,
        });
    }

    fn lost(&self, worker: u32, reason: &Error) {
        let at_us = self.now_us();
        self.push(Record::Lost {
            worker,
            at_us,
            reason: reason.to_string(),
        });
    }
}

/// One worker's view of its current session, for the fault task to cut.
type Sessions = Arc<Mutex<HashMap<u32, SessionId>>>;

/// Runs one seed of `recipe`.
pub(crate) async fn run_seed(seed: u64, recipe: Recipe) -> anyhow::Result<Outcome> {
    let mut rng = StdRng::seed_from_u64(seed);
    let plan = FaultPlan {
        drop_reply: rng.gen_range(0.0..0.05),
        delay_reply: rng.gen_range(0.0..0.2),
        max_reply_delay: Duration::from_millis(rng.gen_range(1..80)),
        lose_watch_event: rng.gen_range(0.0..0.1),
        delay_watch_event: rng.gen_range(0.0..0.2),
        max_watch_delay: Duration::from_millis(rng.gen_range(1..150)),
        ..FaultPlan::new(seed)
    };
    let server = MemServer::with_faults(plan);
    // Half the seeds run the semaphores as on etcd (one ranked queue), half as on
    // ZooKeeper (Curator's internal mutex); drawn apart from the faults' generator so the
    // faults of a seed stay what they were.
    let ranked = StdRng::seed_from_u64(seed ^ 0x5EED_5EED).gen_bool(0.5);
    server.rank_semaphores(ranked);
    let history = History {
        start: Instant::now(),
        records: Arc::new(Mutex::new(Vec::new())),
    };
    let sessions: Sessions = Arc::new(Mutex::new(HashMap::new()));
    let name = format!("sim/{}", recipe.label());
    let workers = if recipe == Recipe::Semaphore {
        PERMITS + 1
    } else {
        3
    };
    let mut tasks = Vec::new();
    for w in 0..workers {
        let worker = Worker {
            id: w,
            recipe,
            name: name.clone(),
            server: server.clone(),
            history: history.clone(),
            sessions: sessions.clone(),
            rng: StdRng::seed_from_u64(rng.gen()),
        };
        tasks.push(tokio::spawn(worker.run()));
    }
    let cut_count = Arc::new(AtomicU64::new(0));
    let cuts = tokio::spawn(cut_off_workers(
        server.clone(),
        sessions.clone(),
        StdRng::seed_from_u64(rng.gen()),
        cut_count.clone(),
    ));
    // Its own generator too, so the other faults of a seed stay what they were.
    let deleted = Arc::new(AtomicU64::new(0));
    let deletes = tokio::spawn(delete_waiters(
        server.clone(),
        waiting_queues(&name, recipe, ranked),
        StdRng::seed_from_u64(seed ^ 0xDE1E_7E0F),
        deleted.clone(),
    ));
    let mut violations = Vec::new();
    for t in tasks {
        if let Err(e) = t.await {
            violations.push(format!("a worker panicked: {e}"));
        }
    }
    cuts.abort();
    let _ = cuts.await;
    deletes.abort();
    let _ = deletes.await;
    let faults = cut_count.load(Ordering::Relaxed);
    // Every worker closed its client; a session cut off before that ends by expiry.
    tokio::time::sleep(SESSION * 2).await;
    let left = leftovers(&server, &name, recipe).await;
    if left != 0 {
        violations.push(format!("{left} entries left after every session ended"));
    }
    let records = history.records.lock().clone();
    let run_end_us = history.now_us();
    let permits = if recipe == Recipe::Semaphore {
        PERMITS
    } else {
        1
    };
    let verdict = check(
        &records,
        &[],
        &HashMap::new(),
        run_end_us,
        Rules {
            permits,
            pause_hold_us: 0,
        },
    );
    if verdict.overlaps > 0 {
        violations.push(format!(
            "{} section(s) began while another holder held the lock",
            verdict.overlaps
        ));
    }
    if verdict.token_violations > 0 {
        violations.push(format!(
            "{} exclusive section(s) had a token not above an earlier one's",
            verdict.token_violations
        ));
    }
    if verdict.sections == 0 {
        violations.push("no worker ever got the lock".to_owned());
    }
    Ok(Outcome {
        sections: verdict.sections,
        faults,
        deleted: deleted.load(Ordering::Relaxed),
        violations,
    })
}

/// Which entries of a queue are waiting, as the server's own queue shows them.
#[derive(Debug, Clone, Copy)]
enum Waiting {
    /// Those with a conflicting entry ahead ([`driver::decide`]): a mutex, a read/write
    /// lock, an election, the internal mutex of Curator's semaphore.
    Blocked,
    /// Those behind the first `n`: a ranked semaphore's permits.
    BeyondPermits(usize),
}

impl Waiting {
    fn holds(self, queue: &[Entry], i: usize) -> bool {
        match self {
            Waiting::Blocked => !matches!(
                driver::decide(queue, &queue[i].name),
                driver::Decision::Wait(_)
            ),
            Waiting::BeyondPermits(n) => i < n,
        }
    }
}

/// The queues of the lock `name` whose waiters [`delete_waiters`] may delete, and how
/// it tells them from holders.
fn waiting_queues(name: &str, recipe: Recipe, ranked: bool) -> Vec<(QueuePath, Waiting)> {
    let lock =
        |n: &str| LockName::new(n, NameRules::common()).expect("the simulation's names are valid");
    let permits = match recipe {
        Recipe::Semaphore => Some(PERMITS as usize),
        Recipe::SemaphoreMutex => Some(1),
        _ => None,
    };
    match (recipe, permits) {
        (Recipe::MultiLock, _) => ["a", "b"]
            .iter()
            .map(|part| {
                (
                    QueuePath::root(lock(&format!("{name}/{part}"))),
                    Waiting::Blocked,
                )
            })
            .collect(),
        (_, Some(n)) if ranked => vec![(
            QueuePath::sub(lock(name), "permits"),
            Waiting::BeyondPermits(n),
        )],
        // Curator's layout: a lease is only ever a holder's; the internal mutex's
        // waiters are the ones still queued for a turn.
        (_, Some(_)) => vec![(QueuePath::sub(lock(name), "locks"), Waiting::Blocked)],
        _ => vec![(QueuePath::root(lock(name)), Waiting::Blocked)],
    }
}

/// Now and then deletes one waiter's entry from outside, as an operator's delete or a
/// revoked lease would, until aborted; counts the deletions in `count`. Only waiters': a
/// holder's entry deleted from outside is a lost lock that no client can be told of
/// before the next contender holds (docs/safety.md), which no lock survives. The pick
/// and the delete are one atomic step on the server, so the entry is a waiter's at that
/// moment; its own client must then never hold on it.
async fn delete_waiters(
    server: Arc<MemServer>,
    queues: Vec<(QueuePath, Waiting)>,
    mut rng: StdRng,
    count: Arc<AtomicU64>,
) {
    loop {
        tokio::time::sleep(Duration::from_millis(rng.gen_range(100..2_000))).await;
        let (q, waiting) = &queues[rng.gen_range(0..queues.len())];
        let draw: usize = rng.gen();
        let deleted = server.delete_from_outside(q, |queue| {
            let waiters: Vec<usize> = (0..queue.len())
                .filter(|&i| !waiting.holds(queue, i))
                .collect();
            (!waiters.is_empty()).then(|| waiters[draw % waiters.len()])
        });
        if deleted.is_some() {
            count.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Cuts a random worker off (its session stops reaching the server) for a random while,
/// then lets it back, until aborted; counts the cuts in `cuts`.
async fn cut_off_workers(
    server: Arc<MemServer>,
    sessions: Sessions,
    mut rng: StdRng,
    cuts: Arc<AtomicU64>,
) {
    loop {
        tokio::time::sleep(Duration::from_millis(rng.gen_range(200..3_000))).await;
        let victim = {
            let s = sessions.lock();
            let mut ids: Vec<(u32, SessionId)> = s.iter().map(|(w, id)| (*w, *id)).collect();
            ids.sort();
            if ids.is_empty() {
                continue;
            }
            ids[rng.gen_range(0..ids.len())].1
        };
        server.partition(victim);
        cuts.fetch_add(1, Ordering::Relaxed);
        let for_ms = rng.gen_range(50..(3 * SESSION.as_millis() as u64));
        tokio::time::sleep(Duration::from_millis(for_ms)).await;
        server.heal(victim);
    }
}

/// How many entries the lock's queues still hold, read by a fresh session.
async fn leftovers(server: &Arc<MemServer>, name: &str, recipe: Recipe) -> usize {
    let names: Vec<String> = match recipe {
        Recipe::MultiLock => vec![format!("{name}/a"), format!("{name}/b")],
        _ => vec![name.to_owned()],
    };
    // The observer's own replies may be dropped by the plan: ask a few times.
    for _ in 0..20 {
        let Ok(b) = server.connect(SessionOptions::default()).await else {
            continue;
        };
        let c = Client::new(b as Arc<dyn DynBackend>);
        let mut total = 0;
        let mut answered = true;
        for n in &names {
            match c.participants(n).await {
                Ok(p) => total += p.len(),
                Err(_) => answered = false,
            }
        }
        let _ = c.close().await;
        if answered {
            return total;
        }
    }
    usize::MAX
}

/// One simulated process: one client at a time, taking its recipe [`TURNS`] times.
struct Worker {
    id: u32,
    recipe: Recipe,
    name: String,
    server: Arc<MemServer>,
    history: History,
    sessions: Sessions,
    rng: StdRng,
}

impl Worker {
    async fn run(mut self) {
        let mut client: Option<Client> = None;
        for turn in 0..TURNS {
            let c = match &client {
                Some(c) => c.clone(),
                None => {
                    let opts = SessionOptions::default().with_session_timeout(SESSION);
                    match self.server.connect(opts).await {
                        Ok(b) => {
                            self.sessions.lock().insert(self.id, b.session());
                            // Tickets from the seed too, so entry names repeat per seed.
                            let draws = Mutex::new(StdRng::seed_from_u64(self.rng.gen()));
                            let tickets = TicketSource::from_fn(move || draws.lock().gen());
                            let c = Client::new(b as Arc<dyn DynBackend>).with_tickets(tickets);
                            client = Some(c.clone());
                            c
                        }
                        Err(_) => {
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                    }
                }
            };
            if !self.turn(&c, turn).await {
                // Lost, or the client is in doubt: start over on a new session, as a
                // real process would.
                let _ = c.close().await;
                self.sessions.lock().remove(&self.id);
                client = None;
            }
            let pause = self.rng.gen_range(0..100);
            tokio::time::sleep(Duration::from_millis(pause)).await;
        }
        if let Some(c) = client {
            let _ = c.close().await;
        }
        self.sessions.lock().remove(&self.id);
    }

    /// One acquire, section(s) and release. False when the client should be replaced.
    async fn turn(&mut self, c: &Client, turn: u32) -> bool {
        let t = ACQUIRE_TIMEOUT;
        let name = self.name.as_str();
        match self.recipe {
            Recipe::Mutex => match c.mutex(name) {
                Ok(m) => match m.lock_timeout(ACQUIRE_TIMEOUT).await {
                    Ok(g) => self.held(g, Mode::Exclusive).await,
                    Err(e) => acquire_failed(&e),
                },
                Err(_) => false,
            },
            Recipe::ReentrantMutex => match c.mutex(name) {
                Ok(m) => match m.lock_timeout(ACQUIRE_TIMEOUT).await {
                    Ok(mut outer) => {
                        let ok = match outer.reenter() {
                            Ok(inner) => self.held(inner, Mode::Exclusive).await,
                            Err(_) => false,
                        };
                        outer.release().await.is_ok() && ok
                    }
                    Err(e) => acquire_failed(&e),
                },
                Err(_) => false,
            },
            Recipe::SemaphoreMutex => match c.semaphore_mutex(name) {
                Ok(m) => match m.lock_timeout(t).await {
                    Ok(g) => self.held(g, Mode::Exclusive).await,
                    Err(e) => acquire_failed(&e),
                },
                Err(_) => false,
            },
            Recipe::RwLock => {
                let Ok(rw) = c.rwlock(name) else {
                    return false;
                };
                if (self.id + turn) % 2 == 1 {
                    return match rw.read_timeout(t).await {
                        Ok(g) => self.held(g, Mode::Shared).await,
                        Err(e) => acquire_failed(&e),
                    };
                }
                let mut write = match rw.write_timeout(t).await {
                    Ok(g) => g,
                    Err(e) => return acquire_failed(&e),
                };
                if !self.section(&write, Mode::Exclusive).await {
                    let _ = write.release().await;
                    return false;
                }
                let read = rw.downgrade(&write).await;
                let released = write.release().await.is_ok();
                match read {
                    Ok(r) => self.held(r, Mode::Shared).await && released,
                    Err(_) => false,
                }
            }
            Recipe::Semaphore => match c.semaphore(name, PERMITS) {
                Ok(s) => match s.acquire_timeout(t).await {
                    Ok(g) => self.held(g, Mode::Permit).await,
                    Err(e) => acquire_failed(&e),
                },
                Err(_) => false,
            },
            Recipe::MultiLock => {
                let multi = c
                    .multi()
                    .mutex(&format!("{name}/a"))
                    .and_then(|m| m.mutex(&format!("{name}/b")));
                let Ok(multi) = multi else {
                    return false;
                };
                let mut g = match multi.acquire_timeout(t).await {
                    Ok(g) => g,
                    Err(e) => return acquire_failed(&e),
                };
                let token = g
                    .tokens()
                    .iter()
                    .find(|(n, _)| n.as_str().ends_with("/a"))
                    .map_or(0, |(_, t)| t.get());
                let lost = g.lost();
                let ok = self.hold(token, Mode::Exclusive, lost).await;
                g.release().await.is_ok() && ok
            }
            Recipe::Election => {
                let Ok(election) = c.election(name) else {
                    return false;
                };
                let leadership = match election
                    .campaign_timeout(format!("worker-{}", self.id), t)
                    .await
                {
                    Ok(l) => l,
                    Err(e) => return acquire_failed(&e),
                };
                // The leader's section, fenced by its term.
                let term = leadership.term().get();
                let ok = self.hold(term, Mode::Exclusive, leadership.lost()).await;
                leadership.resign().await.is_ok() && ok
            }
        }
    }

    /// One section on `guard`, then its release.
    async fn held(&mut self, mut guard: LockGuard, mode: Mode) -> bool {
        let ok = self.section(&guard, mode).await;
        guard.release().await.is_ok() && ok
    }

    /// One section on `guard` (not released). False if its lost signal fired.
    async fn section(&mut self, guard: &LockGuard, mode: Mode) -> bool {
        self.hold(guard.token().get(), mode, guard.lost()).await
    }

    /// Holds for a drawn while, or until `lost` fires (logged, as the chaos workers
    /// log it, the moment it fires). False if it fired.
    async fn hold(
        &mut self,
        token: u64,
        mode: Mode,
        lost: impl std::future::Future<Output = Error>,
    ) -> bool {
        self.history.begin(self.id, token, mode);
        let work = Duration::from_millis(self.rng.gen_range(1..400));
        tokio::select! {
            () = tokio::time::sleep(work) => {
                self.history.end(self.id, token);
                true
            }
            e = lost => {
                self.history.lost(self.id, &e);
                false
            }
        }
    }
}

/// Whether the worker keeps its client after a failed acquire: a timeout or a refusal
/// leaves it usable; anything else (lost, unreachable) replaces it.
fn acquire_failed(e: &Error) -> bool {
    matches!(e, Error::Timeout(_) | Error::WouldBlock)
}
