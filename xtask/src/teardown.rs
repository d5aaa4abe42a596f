//! Tearing servers down when the user presses Ctrl-C or the task gets SIGTERM.
//!
//! Normal exits and panics are covered by `dlock_testkit::Cluster`'s `Drop`. A signal is
//! not: the default action ends the process without unwinding. The handler here reads the
//! registered state files and kills what they record, then exits with 130.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Mutex, Once};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

static STATE_FILES: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
static SCRATCH_DIRS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
static CHILD_GROUP: AtomicI32 = AtomicI32::new(0);
static INSTALL: Once = Once::new();

/// Makes a Ctrl-C / SIGTERM kill the servers recorded in `state_file`.
pub(crate) fn on_signal_tear_down(state_file: &Path) -> anyhow::Result<()> {
    STATE_FILES
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(state_file.to_path_buf());
    let mut result = Ok(());
    INSTALL.call_once(|| result = ctrlc::set_handler(handler));
    Ok(result?)
}

/// Makes a Ctrl-C / SIGTERM also kill the clusters that tests started themselves and
/// recorded in `dir` (see `dlock_testkit::scratch_state_path`).
pub(crate) fn on_signal_reap(dir: &Path) {
    SCRATCH_DIRS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(dir.to_path_buf());
}

/// Records the process group of a long-running child (the test run) so a signal reaches it
/// too: it runs in its own group, so the terminal's Ctrl-C only reaches us.
pub(crate) fn set_child_group(pgid: u32) {
    CHILD_GROUP.store(i32::try_from(pgid).unwrap_or(0), Ordering::SeqCst);
}

fn handler() {
    // Held until exit: no server can be spawned after we read the state files.
    let _spawn_guard = dlock_testkit::spawn_lock();
    eprintln!("\nxtask: interrupted; stopping servers");
    let group = CHILD_GROUP.load(Ordering::SeqCst);
    if group > 0 {
        let _ = killpg(Pid::from_raw(group), Signal::SIGKILL);
    }
    let files = STATE_FILES.lock().map(|f| f.clone()).unwrap_or_default();
    for file in files {
        // A missing file means nothing was recorded yet, or it is already torn down.
        if let Ok(state) = dlock_testkit::State::load(&file) {
            if let Err(e) = state.down() {
                eprintln!("xtask: tearing down {}: {e}", file.display());
            }
        }
    }
    let dirs = SCRATCH_DIRS.lock().map(|d| d.clone()).unwrap_or_default();
    for dir in dirs {
        dlock_testkit::reap_scratch_clusters(&dir);
    }
    std::process::exit(130);
}
