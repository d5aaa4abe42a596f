//! A real Apache Curator client as a child process: `tests/curator/CuratorPeer.java`,
//! compiled with `javac` once per test run and driven over stdin/stdout lines.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc;

use crate::support::{skip_or_fail, zk_hosts};

/// Curator 5.4 from Debian's `libcurator-recipes-java`; its manifest pulls in the
/// framework, the client, guava, slf4j-api and ZooKeeper.
pub const CURATOR_JAR: &str = "/usr/share/java/curator-recipes.jar";

/// How long any one reply may take. Generous: a JVM on a loaded 2-core machine.
const REPLY_LIMIT: Duration = Duration::from_secs(60);

static CLASSES: tokio::sync::OnceCell<Result<PathBuf, String>> = tokio::sync::OnceCell::const_new();

/// Compiles the peer once per test process. `Err` means a prerequisite is missing (no
/// JDK, no Curator jar); a compile error of the peer itself panics.
async fn compile() -> Result<PathBuf, String> {
    if !Path::new(CURATOR_JAR).exists() {
        return Err(format!(
            "{CURATOR_JAR} not found (apt-get install libcurator-recipes-java)"
        ));
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("curator-peer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let src = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/curator/CuratorPeer.java"
    );
    let out = Command::new("javac")
        .arg("-d")
        .arg(&dir)
        .args(["-cp", CURATOR_JAR, src])
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| format!("javac cannot be run (apt-get install default-jdk-headless): {e}"))?;
    assert!(
        out.status.success(),
        "javac failed on {src}:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(dir)
}

/// One Curator session in a child JVM. Killed when dropped.
pub struct Peer {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::UnboundedReceiver<String>,
    /// Lines read but not yet claimed by [`Peer::reply`].
    pending: Vec<String>,
}

/// The Java client's connect string (hosts and chroot), its system properties for TLS,
/// and the digest credentials (`user:password`, empty for none) of a dlock ZooKeeper URL.
fn connect_args(url: &str) -> (String, Vec<String>, String) {
    if url.starts_with("zk://") {
        return (zk_hosts(url).to_owned(), Vec::new(), String::new());
    }
    let parsed = dlock::BackendUrl::parse(url).expect("a ZooKeeper URL");
    let dlock::Servers::ZooKeeper { hosts, chroot } = parsed.servers else {
        panic!("not a ZooKeeper URL: {url}")
    };
    let connect = format!("{}{}", hosts.join(","), chroot.unwrap_or_default());
    let digest = parsed
        .credentials
        .map(|c| format!("{}:{}", c.user.unwrap_or_default(), c.password.expose()))
        .unwrap_or_default();
    let mut flags = Vec::new();
    if let Some(tls) = parsed.tls {
        flags.push(
            "-Dzookeeper.clientCnxnSocket=org.apache.zookeeper.ClientCnxnSocketNetty".to_owned(),
        );
        flags.push("-Dzookeeper.client.secure=true".to_owned());
        if let Some(ca) = tls.ca {
            flags.push(format!(
                "-Dzookeeper.ssl.trustStore.location={}",
                ca.display()
            ));
            flags.push("-Dzookeeper.ssl.trustStore.type=PEM".to_owned());
        }
        if let (Some(cert), Some(key)) = (tls.cert, tls.key) {
            // Java's PEM key store wants the key and the certificate in one file. The
            // testkit's PKI writes one beside the client key (`client.pem`, in the
            // cluster's directory, which goes with it); for a key from elsewhere one is
            // made in a temp dir.
            let beside = key.with_file_name("client.pem");
            let pem = if beside.exists() {
                beside
            } else {
                let pem = crate::support::tempdir("curator-pem").join("client.pem");
                let both = [
                    std::fs::read(key).expect("key"),
                    std::fs::read(cert).expect("cert"),
                ]
                .concat();
                std::fs::write(&pem, both).expect("writing the PEM key store");
                pem
            };
            flags.push(format!(
                "-Dzookeeper.ssl.keyStore.location={}",
                pem.display()
            ));
            flags.push("-Dzookeeper.ssl.keyStore.type=PEM".to_owned());
        }
    }
    (connect, flags, digest)
}

impl Peer {
    /// Starts a peer on the ZooKeeper of `url` (`zk://h:p,...`), or returns `None` after
    /// the skip/fail rule when Java or Curator is missing.
    pub async fn start(url: &str) -> Option<Peer> {
        let classes = match CLASSES.get_or_init(compile).await {
            Ok(dir) => dir.clone(),
            Err(why) => {
                skip_or_fail(&format!("Curator interop needs Java and Curator: {why}"));
                return None;
            }
        };
        let log = classes.join(format!(
            "peer-{}.log",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        ));
        let stderr = std::fs::File::create(&log).expect("peer log file");
        let (connect, jvm_flags, digest) = connect_args(url);
        let mut classpath = format!("{}:{CURATOR_JAR}", classes.display());
        if !jvm_flags.is_empty() {
            // The Netty client socket TLS needs; Curator's manifest leaves these out.
            classpath
                .push_str(":/usr/share/java/netty-codec.jar:/usr/share/java/netty-resolver.jar");
        }
        let mut child = Command::new("java")
            .args(jvm_flags)
            .arg("-cp")
            .arg(classpath)
            .arg("-Xmx128m")
            .arg("CuratorPeer")
            .arg(connect)
            .arg("10000")
            .env("DLOCK_CURATOR_DIGEST", digest)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .kill_on_drop(true)
            .spawn()
            .expect("java cannot be run");
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut out = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = out.next_line().await {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut peer = Peer {
            child,
            stdin,
            lines,
            pending: Vec::new(),
        };
        let ready = peer.reply("-").await;
        assert_eq!(
            ready,
            "READY",
            "Curator peer did not start; see {}",
            log.display()
        );
        Some(peer)
    }

    /// Sends `<id> <command>` without waiting for the reply.
    pub async fn send(&mut self, id: &str, command: &str) {
        let line = format!("{id} {command}\n");
        self.stdin
            .write_all(line.as_bytes())
            .await
            .expect("writing to the Curator peer");
        self.stdin.flush().await.expect("flushing the Curator peer");
    }

    /// Sends a command and waits for its reply.
    pub async fn cmd(&mut self, id: &str, command: &str) -> String {
        self.send(id, command).await;
        self.reply(id).await
    }

    /// The next reply of `id` (the text after `<id> `), waiting up to a minute.
    ///
    /// # Panics
    /// On an `ERROR` reply, when the peer exits, or after a minute without a reply.
    pub async fn reply(&mut self, id: &str) -> String {
        let deadline = tokio::time::Instant::now() + REPLY_LIMIT;
        loop {
            if let Some(text) = self.take_pending(id) {
                return text;
            }
            match tokio::time::timeout_at(deadline, self.lines.recv()).await {
                Ok(Some(line)) => self.pending.push(line),
                Ok(None) => panic!("the Curator peer exited while {id} waited for a reply"),
                Err(_) => panic!("no reply for {id} from the Curator peer within {REPLY_LIMIT:?}"),
            }
        }
    }

    /// A reply of `id` that has already arrived, without waiting.
    pub fn try_reply(&mut self, id: &str) -> Option<String> {
        while let Ok(line) = self.lines.try_recv() {
            self.pending.push(line);
        }
        self.take_pending(id)
    }

    /// The next line of any id, as `(id, text)`; `None` if the peer exited.
    /// Cancel-safe: a dropped call loses no line.
    pub async fn next_line(&mut self) -> Option<(String, String)> {
        let line = if self.pending.is_empty() {
            self.lines.recv().await?
        } else {
            self.pending.remove(0)
        };
        let (id, text) = line.split_once(' ').unwrap_or((line.as_str(), ""));
        assert!(
            !text.starts_with("ERROR"),
            "the Curator peer failed: {line}"
        );
        Some((id.to_owned(), text.to_owned()))
    }

    fn take_pending(&mut self, id: &str) -> Option<String> {
        let prefix = format!("{id} ");
        let at = self.pending.iter().position(|l| l.starts_with(&prefix))?;
        let line = self.pending.remove(at);
        let text = line[prefix.len()..].to_owned();
        assert!(
            !text.starts_with("ERROR"),
            "the Curator peer failed: {line}"
        );
        Some(text)
    }

    /// Closes the Curator session (its nodes go at once) and waits for the JVM to exit.
    pub async fn quit(mut self) {
        let _ = self.cmd("-", "quit").await;
        let _ = tokio::time::timeout(REPLY_LIMIT, self.child.wait()).await;
    }
}
