//! A minimal RESP2 client over one TCP connection: enough for the Redis ceiling (SET NX
//! PX + EVALSHA, the fewest round trips a Redis lock can make) and for reading `INFO
//! commandstats`. No client library sits between the bench and the wire, so the ceiling
//! is the server's and the loopback's, not a library's.

use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::TcpStream;

/// A reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `+OK`.
    Simple(String),
    /// `-ERR ...`.
    Error(String),
    /// `:1`.
    Int(i64),
    /// `$n`, or `None` for the null bulk string.
    Bulk(Option<Vec<u8>>),
    /// `*n`, or `None` for the null array.
    Array(Option<Vec<Reply>>),
}

/// One connection.
pub struct Conn {
    io: BufReader<TcpStream>,
    buf: Vec<u8>,
}

impl Conn {
    /// Connects to `addr` (`host:port`), with TCP_NODELAY like every Redis client.
    ///
    /// # Errors
    /// The connect error, as text.
    pub async fn connect(addr: &str) -> Result<Conn, String> {
        let s = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("redis connect {addr}: {e}"))?;
        s.set_nodelay(true)
            .map_err(|e| format!("redis nodelay: {e}"))?;
        Ok(Conn {
            io: BufReader::new(s),
            buf: Vec::with_capacity(256),
        })
    }

    /// Sends one command and reads its reply. A `-ERR` reply is an `Err`.
    ///
    /// # Errors
    /// I/O errors, protocol errors and error replies, as text.
    pub async fn cmd(&mut self, args: &[&[u8]]) -> Result<Reply, String> {
        self.buf.clear();
        self.buf
            .extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
        for a in args {
            self.buf
                .extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            self.buf.extend_from_slice(a);
            self.buf.extend_from_slice(b"\r\n");
        }
        self.io
            .get_mut()
            .write_all(&self.buf)
            .await
            .map_err(|e| format!("redis write: {e}"))?;
        match read_reply(&mut self.io).await? {
            Reply::Error(e) => Err(format!("redis error reply: {e}")),
            r => Ok(r),
        }
    }
}

async fn read_line(io: &mut BufReader<TcpStream>) -> Result<String, String> {
    let mut line = String::new();
    let n = io
        .read_line(&mut line)
        .await
        .map_err(|e| format!("redis read: {e}"))?;
    if n == 0 {
        return Err("redis closed the connection".into());
    }
    Ok(line.trim_end_matches(['\r', '\n']).to_owned())
}

fn read_reply(
    io: &mut BufReader<TcpStream>,
) -> futures::future::BoxFuture<'_, Result<Reply, String>> {
    Box::pin(async move {
        let line = read_line(io).await?;
        let (kind, rest) = line.split_at(line.len().min(1));
        let num = || {
            rest.parse::<i64>()
                .map_err(|_| format!("redis: bad length in {line:?}"))
        };
        match kind {
            "+" => Ok(Reply::Simple(rest.to_owned())),
            "-" => Ok(Reply::Error(rest.to_owned())),
            ":" => Ok(Reply::Int(num()?)),
            "$" => {
                let n = num()?;
                if n < 0 {
                    return Ok(Reply::Bulk(None));
                }
                let n = usize::try_from(n).map_err(|e| e.to_string())?;
                let mut data = vec![0; n + 2];
                io.read_exact(&mut data)
                    .await
                    .map_err(|e| format!("redis read: {e}"))?;
                data.truncate(n);
                Ok(Reply::Bulk(Some(data)))
            }
            "*" => {
                let n = num()?;
                if n < 0 {
                    return Ok(Reply::Array(None));
                }
                let mut items = Vec::new();
                for _ in 0..n {
                    items.push(read_reply(io).await?);
                }
                Ok(Reply::Array(Some(items)))
            }
            _ => Err(format!("redis: unexpected reply line {line:?}")),
        }
    })
}

/// The total of `calls=` over every command in an `INFO commandstats` text, without
/// the `info` calls the bench itself makes.
pub fn commandstats_calls(info: &str) -> u64 {
    info.lines()
        .filter(|l| l.starts_with("cmdstat_") && !l.starts_with("cmdstat_info:"))
        .filter_map(|l| l.split("calls=").nth(1))
        .filter_map(|rest| rest.split(',').next())
        .filter_map(|n| n.parse::<u64>().ok())
        .sum()
}

/// `INFO commandstats` as command (`set`, `evalsha`, `client|id`...) → (calls, usec),
/// without the `info` calls the bench itself makes.
pub fn commandstats_table(info: &str) -> std::collections::HashMap<String, (u64, u64)> {
    let field = |rest: &str, key: &str| -> Option<u64> {
        rest.split(',')
            .find_map(|kv| kv.strip_prefix(key))
            .and_then(|v| v.parse().ok())
    };
    info.lines()
        .filter_map(|l| l.trim_end().strip_prefix("cmdstat_"))
        .filter_map(|l| l.split_once(':'))
        .filter(|(cmd, _)| *cmd != "info")
        .filter_map(|(cmd, rest)| {
            Some((
                cmd.to_owned(),
                (field(rest, "calls=")?, field(rest, "usec=")?),
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_commandstats() {
        let info = "# Commandstats\r\ncmdstat_set:calls=10,usec=5,usec_per_call=0.5\r\n\
                    cmdstat_evalsha:calls=7,usec=1\r\ncmdstat_info:calls=3,usec=1\r\n";
        assert_eq!(commandstats_calls(info), 17);
        let t = commandstats_table(info);
        assert_eq!(t.get("set"), Some(&(10, 5)));
        assert_eq!(t.get("evalsha"), Some(&(7, 1)));
        assert!(!t.contains_key("info"));
    }
}
