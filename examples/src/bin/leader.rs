//! A singleton scheduler: three machines run the same service, and only the elected leader
//! dispatches the periodic jobs ([`dlock::Election`]).
//!
//! Every machine campaigns with its address as the value; the first leads, the others
//! queue behind it (FIFO, each watching only the candidate ahead). The leader dispatches
//! one job per tick to the job ledger, and every dispatch carries the leader's term
//! ([`dlock::Leadership::term`]) as its fencing token: the ledger refuses a term older
//! than one it has seen, so a deposed leader that wakes up late cannot dispatch twice.
//!
//! The story: machine 0 leads and dispatches; it crashes (its task stops, its session
//! ends; closing the session keeps the run short where a real crash waits out the session
//! timeout), and machine 1 takes over with a higher term. A dispatch machine 0 had in
//! flight arrives late with its old term: the ledger rejects it. Machine 1 steps down
//! (resigns), machine 2 takes over, and when it resigns nobody leads. Anyone can ask who
//! leads ([`dlock::Election::leader`]; `dlock leader NAME` from a shell).
//!
//! Each machine is its own [`dlock::Client`], so its own session, as separate processes
//! would be; from a shell the same singleton is
//! `dlock elect jobs/scheduler --value "$(hostname)" -- ./scheduler` on every machine.
//!
//! ```sh
//! cargo run -p dlock-examples --bin leader -- --url zk://127.0.0.1:2181
//! ```

use std::process::ExitCode;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use clap::Parser;
use dlock::{FenceGate, FencingToken};
use dlock_examples::{run_id, storage_round_trip, Common, Report};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

#[derive(Debug, Parser)]
#[command(about = "A singleton scheduler: only the elected leader dispatches jobs")]
struct Args {
    #[command(flatten)]
    common: Common,
    /// Jobs each leader dispatches before the next step of the story.
    #[arg(long, default_value_t = 5)]
    jobs: usize,
}

/// The interval between two dispatches of the leader.
const TICK: Duration = Duration::from_millis(20);

/// How long any step may take: several session timeouts.
const STEP: Duration = Duration::from_secs(60);

/// A dispatch the ledger refused: its term is older than one it has seen.
#[derive(Debug)]
struct StaleTerm {
    term: FencingToken,
    highest: Option<FencingToken>,
}

/// The job ledger every dispatch goes to, fenced by the dispatching leader's term.
#[derive(Default)]
struct Ledger {
    /// The gate and the jobs change together, under one storage-side lock: a check and a
    /// write in two steps would let a stale dispatch slip in between.
    inner: StdMutex<(FenceGate, Vec<(usize, FencingToken)>)>,
}

impl Ledger {
    /// Records the next job as dispatched by `machine` in `term`; returns its number.
    async fn dispatch(&self, machine: usize, term: FencingToken) -> Result<usize, StaleTerm> {
        storage_round_trip().await;
        let mut inner = self.inner.lock().map_err(|_| StaleTerm {
            term,
            highest: None,
        })?;
        let (gate, jobs) = &mut *inner;
        if !gate.admit(term) {
            return Err(StaleTerm {
                term,
                highest: gate.highest(),
            });
        }
        jobs.push((machine, term));
        Ok(jobs.len() - 1)
    }

    fn jobs(&self) -> Vec<(usize, FencingToken)> {
        self.inner.lock().map(|i| i.1.clone()).unwrap_or_default()
    }

    fn count_by(&self, machine: usize) -> usize {
        self.jobs().iter().filter(|(m, _)| *m == machine).count()
    }
}

/// Which machine runs the scheduler now: set when a leader starts acting, cleared when it
/// stops; finding another machine's mark is two schedulers at once.
#[derive(Default)]
struct Acting {
    inner: StdMutex<(Option<usize>, usize)>,
}

impl Acting {
    fn start(&self, machine: usize) {
        if let Ok(mut a) = self.inner.lock() {
            if a.0.is_some() {
                a.1 += 1;
            }
            a.0 = Some(machine);
        }
    }

    fn stop(&self, machine: usize) {
        if let Ok(mut a) = self.inner.lock() {
            if a.0 == Some(machine) {
                a.0 = None;
            }
        }
    }

    fn overlaps(&self) -> usize {
        self.inner.lock().map(|a| a.1).unwrap_or(usize::MAX)
    }
}

/// What a machine reports to the story.
#[derive(Debug)]
enum Event {
    Leads { machine: usize, term: FencingToken },
}

/// One machine of the fleet: its session, its candidacy, and the way to stop it.
struct Machine {
    client: dlock::Client,
    task: JoinHandle<Result<(), dlock::Error>>,
    step_down: Option<oneshot::Sender<()>>,
}

/// The service each machine runs: campaign, then dispatch one job per tick while leading,
/// until the leadership is lost (stop at once) or the machine steps down (resign).
#[allow(clippy::too_many_arguments)]
async fn service(
    machine: usize,
    client: dlock::Client,
    name: String,
    ledger: Arc<Ledger>,
    acting: Arc<Acting>,
    events: mpsc::UnboundedSender<Event>,
    step_down: oneshot::Receiver<()>,
) -> Result<(), dlock::Error> {
    let election = client.election(&name)?;
    let leadership = election
        .campaign(format!("scheduler-{machine}.example:8080"))
        .await?;
    let term = leadership.term();
    acting.start(machine);
    let _ = events.send(Event::Leads { machine, term });
    let lost = leadership.lost();
    tokio::pin!(lost, step_down);
    let mut tick = tokio::time::interval(TICK);
    loop {
        tokio::select! {
            e = &mut lost => {
                // Lost (or maybe lost): stop acting as leader now, before anything else.
                acting.stop(machine);
                return Err(e);
            }
            _ = &mut step_down => {
                acting.stop(machine);
                return leadership.resign().await;
            }
            _ = tick.tick() => {
                if let Err(StaleTerm { term, .. }) = ledger.dispatch(machine, term).await {
                    // Someone with a newer term dispatched: this machine is not the
                    // leader any more, whatever it believes.
                    acting.stop(machine);
                    return Err(dlock::Error::LockLost(format!("the ledger refused term {term}")));
                }
            }
        }
    }
}

/// Waits for the next `Leads` event.
async fn next_leader(
    events: &mut mpsc::UnboundedReceiver<Event>,
) -> Result<(usize, FencingToken), dlock::Error> {
    match tokio::time::timeout(STEP, events.recv()).await {
        Ok(Some(Event::Leads { machine, term })) => Ok((machine, term)),
        Ok(None) => Err(dlock::Error::backend(
            "leader example",
            "every machine stopped",
        )),
        Err(_) => Err(dlock::Error::Timeout(STEP)),
    }
}

/// Waits until `machine` has dispatched `n` jobs.
async fn dispatched(ledger: &Ledger, machine: usize, n: usize) -> Result<(), dlock::Error> {
    let wait = async {
        while ledger.count_by(machine) < n {
            tokio::time::sleep(TICK).await;
        }
    };
    tokio::time::timeout(STEP, wait)
        .await
        .map_err(|_| dlock::Error::Timeout(STEP))
}

async fn scenario(url: String, jobs: usize) -> Result<Report, dlock::Error> {
    let name = format!("examples/{}/jobs/scheduler", run_id());
    let ledger = Arc::new(Ledger::default());
    let acting = Arc::new(Acting::default());
    let (tx, mut events) = mpsc::unbounded_channel();
    let mut r = Report::new();

    // Three machines, started one after another so they queue in this order.
    let mut machines = Vec::new();
    for m in 0..3 {
        let client = dlock::connect(&url).await?;
        let (step_tx, step_rx) = oneshot::channel();
        let task = tokio::spawn(service(
            m,
            client.clone(),
            name.clone(),
            ledger.clone(),
            acting.clone(),
            tx.clone(),
            step_rx,
        ));
        machines.push(Machine {
            client,
            task,
            step_down: Some(step_tx),
        });
        if m == 0 {
            let (leader, term) = next_leader(&mut events).await?;
            r.check(leader == 0, format!("machine 0 leads first, term {term}"));
        } else {
            // Give its campaign time to queue before the next machine joins.
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let observer = dlock::connect(&url).await?;
    let election = observer.election(&name)?;
    let shown = election.leader().await?;
    r.check(
        shown.as_ref().and_then(|l| l.value_str()) == Some("scheduler-0.example:8080"),
        format!(
            "anyone can see who leads: {:?}",
            shown
                .as_ref()
                .map(|l| (l.value_str().unwrap_or("?"), l.term.get()))
        ),
    );
    dispatched(&ledger, 0, jobs).await?;

    // Machine 0 crashes: its process stops, its session ends.
    let (crashed_term, crashed) = {
        let m0 = &mut machines[0];
        // Marked stopped before the abort: the abort drops machine 0's leadership, whose
        // removal (spawned then) can let machine 1 lead while this task still awaits
        // the aborted one, and the task had stopped acting by then. Marked after, the
        // check counted that as two machines running at once (a CI run on Redlock).
        acting.stop(0);
        m0.task.abort();
        let _ = (&mut m0.task).await;
        let term = ledger
            .jobs()
            .iter()
            .rev()
            .find(|(m, _)| *m == 0)
            .map(|(_, t)| *t);
        m0.client.close().await?;
        (term, 0)
    };
    let (second, second_term) = next_leader(&mut events).await?;
    r.check(
        second == 1,
        format!("machine 1, next in line, takes over after machine {crashed}'s crash"),
    );
    if let Some(old) = crashed_term {
        r.check(
            second_term > old,
            format!("the new term {second_term} is higher than the crashed leader's {old}"),
        );
    }
    dispatched(&ledger, 1, jobs).await?;

    // A dispatch machine 0 had in flight arrives late, with its old term.
    if let Some(old) = crashed_term {
        match ledger.dispatch(0, old).await {
            Err(StaleTerm { term, highest }) => r.check(
                true,
                format!(
                    "the crashed leader's late dispatch with term {term} is rejected (the ledger has seen {})",
                    highest.map_or("none".into(), |h| h.to_string())
                ),
            ),
            Ok(job) => r.check(false, format!("a stale term dispatched job {job}")),
        }
    }

    // Machine 1 steps down; machine 2 takes over.
    if let Some(s) = machines[1].step_down.take() {
        let _ = s.send(());
    }
    let (third, third_term) = next_leader(&mut events).await?;
    r.check(
        third == 2 && third_term > second_term,
        format!("machine 1 resigns: machine 2 leads with term {third_term}"),
    );
    dispatched(&ledger, 2, jobs).await?;
    if let Some(s) = machines[2].step_down.take() {
        let _ = s.send(());
    }
    for m in &mut machines[1..] {
        match (&mut m.task).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(e) => return Err(dlock::Error::backend("leader example", e.to_string())),
        }
    }
    r.check(
        election.leader().await?.is_none(),
        "after the last leader resigned nobody leads",
    );

    // The ledger: one scheduler at a time, each leader's jobs in one run, terms rising.
    let all = ledger.jobs();
    let runs = all.windows(2).filter(|w| w[0].0 != w[1].0).count() + 1;
    r.check(
        acting.overlaps() == 0,
        "never two machines running the scheduler at once",
    );
    r.check(
        runs == 3 && all.windows(2).all(|w| w[0].1 <= w[1].1),
        format!(
            "{} jobs dispatched by 3 leaders in turn, terms never going back",
            all.len()
        ),
    );
    for m in machines.drain(1..) {
        m.client.close().await?;
    }
    observer.close().await?;
    Ok(r)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let jobs = args.jobs;
    dlock_examples::run("leader", &args.common, |url| scenario(url, jobs)).await
}
