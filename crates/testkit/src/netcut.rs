//! Server-side partitions on loopback: drop the packets of chosen TCP connections or
//! ports with nftables, while every other connection keeps working.
//!
//! A client-side cut (a proxy between a client and the servers) cannot reproduce the
//! faults that live between the servers: a ZooKeeper follower cut off from its leader
//! keeps answering its clients until it notices, while the leader expires their sessions.
//! A [`NetCut`] drops exactly the packets of the connections (or ports) it is told to,
//! in both directions, so the rest of the cluster, and the test's own clients, are
//! untouched. Dropping (not rejecting) is the point: neither end learns of the cut until
//! its own timeouts say so, as with a real partition.
//!
//! Each cut is one nftables table of its own (`inet dlock_cut_<pid>_<n>`), deleted when
//! the [`NetCut`] is dropped or [`NetCut::heal`]ed, so a cut never outlives its test and
//! never touches another process's rules. Needs root and the `nft` program (Debian's
//! `nftables`, which [`crate::ensure_installed`] installs).

use std::collections::HashSet;
use std::fmt::Write as _;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::error::io_ctx;
use crate::{Error, Result};

/// A set of dropped loopback packets, undone on drop.
#[derive(Debug)]
pub struct NetCut {
    table: String,
    live: bool,
}

impl NetCut {
    /// Drops, in both directions, every TCP packet between local port `a` and local
    /// port `b` on loopback (one connection, when one side is its ephemeral port), and
    /// every packet to or from each port in `ports` (whole servers' ports, including new
    /// connections).
    ///
    /// # Errors
    /// [`Error::Command`] if `nft` is missing or refuses the rules (not root, no
    /// nftables in the kernel).
    pub fn new(pairs: &[(u16, u16)], ports: &[u16]) -> Result<NetCut> {
        static N: AtomicU32 = AtomicU32::new(0);
        let table = format!(
            "dlock_cut_{}_{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let script = ruleset(&table, pairs, ports);
        nft_stdin(&script)?;
        Ok(NetCut { table, live: true })
    }

    /// Lets the packets through again.
    ///
    /// # Errors
    /// [`Error::Command`] if `nft` could not delete the table.
    pub fn heal(mut self) -> Result<()> {
        self.live = false;
        nft_stdin(&format!("delete table inet {}\n", self.table))
    }
}

impl Drop for NetCut {
    fn drop(&mut self) {
        if self.live {
            let _ = nft_stdin(&format!("delete table inet {}\n", self.table));
        }
    }
}

/// The nftables script of one cut: a table with an input and an output hook, each
/// dropping the listed pairs and ports.
fn ruleset(table: &str, pairs: &[(u16, u16)], ports: &[u16]) -> String {
    let mut rules = String::new();
    for (a, b) in pairs {
        let _ = writeln!(rules, "    tcp sport {a} tcp dport {b} drop");
        let _ = writeln!(rules, "    tcp sport {b} tcp dport {a} drop");
    }
    for p in ports {
        let _ = writeln!(rules, "    tcp dport {p} drop");
        let _ = writeln!(rules, "    tcp sport {p} drop");
    }
    let mut s = format!("table inet {table} {{\n");
    for hook in ["input", "output"] {
        let _ = writeln!(
            s,
            "  chain {hook} {{\n    type filter hook {hook} priority -10; policy accept;\n{rules}  }}"
        );
    }
    s.push_str("}\n");
    s
}

fn nft_stdin(script: &str) -> Result<()> {
    use std::io::Write as _;
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(io_ctx("running nft (install Debian's nftables)"))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .map_err(io_ctx("writing the nft script"))?;
    }
    let out = child
        .wait_with_output()
        .map_err(io_ctx("waiting for nft"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(Error::Command {
            command: "nft -f -".into(),
            detail: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        })
    }
}

/// The local ports of the established TCP connections that process `pid` has open to
/// `remote_port` (on any loopback address): the ephemeral ends of, e.g., a ZooKeeper
/// follower's connection to its leader's quorum port.
///
/// # Errors
/// [`Error::Io`] if `/proc` cannot be read for that process.
pub fn connections_of(pid: u32, remote_port: u16) -> Result<Vec<u16>> {
    let inodes = socket_inodes(pid)?;
    let mut out = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        out.extend(established_to(&text, remote_port, &inodes));
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

fn socket_inodes(pid: u32) -> Result<HashSet<u64>> {
    let dir = format!("/proc/{pid}/fd");
    let entries = std::fs::read_dir(&dir).map_err(io_ctx(format!("reading {dir}")))?;
    Ok(entries
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter_map(|target| {
            let t = target.to_string_lossy();
            t.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
        })
        .collect())
}

/// Parses a `/proc/net/tcp` table: the local ports of the established rows whose remote
/// port is `remote_port` and whose inode is one of `inodes`.
fn established_to(table: &str, remote_port: u16, inodes: &HashSet<u64>) -> Vec<u16> {
    const ESTABLISHED: &str = "01";
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            let (local, remote, state, inode) = (f.get(1)?, f.get(2)?, f.get(3)?, f.get(9)?);
            let port_of = |addr: &str| u16::from_str_radix(addr.rsplit(':').next()?, 16).ok();
            (*state == ESTABLISHED
                && port_of(remote)? == remote_port
                && inodes.contains(&inode.parse::<u64>().ok()?))
            .then(|| port_of(local))
            .flatten()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::time::Duration;

    #[test]
    fn ruleset_drops_both_directions_of_each_pair_and_port() {
        let s = ruleset("t", &[(40000, 2888)], &[3888]);
        for rule in [
            "tcp sport 40000 tcp dport 2888 drop",
            "tcp sport 2888 tcp dport 40000 drop",
            "tcp dport 3888 drop",
            "tcp sport 3888 drop",
        ] {
            assert_eq!(s.matches(rule).count(), 2, "{rule} in both hooks:\n{s}");
        }
        assert!(s.contains("type filter hook input") && s.contains("type filter hook output"));
    }

    #[test]
    fn established_rows_are_matched_by_remote_port_and_inode() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:9C40 0100007F:0B48 01 00000000:00000000 00:00000000 00000000     0        0 111 1
   1: 0100007F:9C41 0100007F:0B48 0A 00000000:00000000 00:00000000 00000000     0        0 112 1
   2: 0100007F:9C42 0100007F:0B48 01 00000000:00000000 00:00000000 00000000     0        0 999 1
   3: 0100007F:9C43 0100007F:0F3C 01 00000000:00000000 00:00000000 00000000     0        0 111 1";
        let inodes: HashSet<u64> = [111, 112].into_iter().collect();
        // 0x0B48 = 2888; only row 0 is established, ours and to that port.
        assert_eq!(established_to(table, 2888, &inodes), vec![0x9C40]);
    }

    /// Against the real kernel: a cut connection stops carrying bytes, another
    /// connection on the same ports does not, and healing lets the cut one through.
    /// Needs root and nft; skips loudly otherwise (fails under CI, which has both).
    #[test]
    fn a_cut_connection_carries_nothing_until_healed() {
        let Ok(listener) = TcpListener::bind("127.0.0.1:0") else {
            return;
        };
        let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
        let mut a = TcpStream::connect(("127.0.0.1", port)).expect("connect a");
        let (mut a_srv, _) = listener.accept().expect("accept a");
        let mut b = TcpStream::connect(("127.0.0.1", port)).expect("connect b");
        let (mut b_srv, _) = listener.accept().expect("accept b");
        let a_port = a.local_addr().expect("addr").port();
        let ours = connections_of(std::process::id(), port).expect("connections");
        assert!(ours.contains(&a_port), "{ours:?} lacks {a_port}");
        let cut = match NetCut::new(&[(a_port, port)], &[]) {
            Ok(c) => c,
            Err(e) => {
                if std::env::var_os("CI").is_some() {
                    panic!("nft is needed under CI: {e}");
                }
                eprintln!("SKIPPED: no nftables here: {e}");
                return;
            }
        };
        let timeout = Some(Duration::from_millis(500));
        a_srv.set_read_timeout(timeout).expect("timeout");
        b_srv.set_read_timeout(timeout).expect("timeout");
        a.write_all(b"x").expect("write a");
        b.write_all(b"y").expect("write b");
        let mut buf = [0u8; 1];
        assert_eq!(b_srv.read(&mut buf).expect("b is not cut"), 1);
        assert!(
            a_srv.read(&mut buf).is_err(),
            "the cut connection carried a byte"
        );
        cut.heal().expect("heal");
        // TCP retransmits the dropped byte once the path is back.
        a_srv
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        assert_eq!(a_srv.read(&mut buf).expect("healed"), 1);
        assert_eq!(&buf, b"x");
    }
}
