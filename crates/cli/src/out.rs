//! Printing that never panics.
//!
//! `println!` and `eprintln!` panic when the write fails: a closed pipe (`dlock list |
//! head -1`, a log reader that died), a full disk. A panic on the way to stopping a
//! command whose lock was lost would skip the stop and leave the command's group running
//! without the lock; elsewhere it turns a clean exit code into 101. So every line goes
//! through these, and a failed write is dropped: the exit code still says what happened.

use std::fmt;
use std::io::Write;

/// One line to stderr (`dlock: ...` messages); a failed write is ignored.
pub(crate) fn err_line(args: fmt::Arguments<'_>) {
    let _ = writeln!(std::io::stderr().lock(), "{args}");
}

/// One line to stdout; false if it could not be written (the reader is gone), so that a
/// loop that prints (`leader --watch`) can stop.
pub(crate) fn out_line(args: fmt::Arguments<'_>) -> bool {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{args}").and_then(|()| out.flush()).is_ok()
}

/// `eprintln!` that never panics.
macro_rules! say {
    ($($t:tt)*) => { $crate::out::err_line(format_args!($($t)*)) };
}

/// `println!` that never panics; evaluates to whether the line was written.
macro_rules! show {
    ($($t:tt)*) => { $crate::out::out_line(format_args!($($t)*)) };
}

pub(crate) use {say, show};
