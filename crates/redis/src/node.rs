//! One Redis master: a command client and a subscriber client, configured for locks.

use std::time::Duration;

use dlock_core::Error;
use fred::clients::SubscriberClient;
use fred::prelude::{
    Builder, ClientLike, Config, ErrorKind, EventInterface, KeysInterface, PubsubInterface,
    ReconnectPolicy, Value,
};
use fred::types::scripts::Script;
use fred::types::ConnectHandle;
use tokio::time::Instant;

/// Client settings derived from the session options.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tuning {
    pub connect_timeout: Duration,
    pub command_timeout: Duration,
}

/// One master. Both clients reconnect forever (constant 200 ms policy); commands are never
/// replayed after a reconnect (`max_command_attempts = 1`, pitfall R1), and every command
/// times out after [`Tuning::command_timeout`] (fred's default is no timeout at all).
pub(crate) struct Node {
    pub addr: String,
    pub client: fred::prelude::Client,
    pub sub: SubscriberClient,
    conn_tasks: Vec<ConnectHandle>,
    resubscriber: tokio::task::AbortHandle,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node").field("addr", &self.addr).finish()
    }
}

/// Checks `host:port` and returns it unchanged.
pub(crate) fn check_addr(addr: &str) -> Result<&str, Error> {
    let bad = |reason: &str| Error::InvalidUrl {
        url: addr.to_owned(),
        reason: reason.to_owned(),
    };
    let (host, port) = addr
        .rsplit_once(':')
        .ok_or_else(|| bad("expected host:port"))?;
    if host.is_empty() || host.contains(['/', '@', ',', ' ']) {
        return Err(bad("bad host"));
    }
    port.parse::<u16>()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| bad("port must be a number in 1..=65535"))?;
    Ok(addr)
}

impl Node {
    /// Builds the clients and starts connecting them; does not wait for the connection.
    pub fn start(addr: &str, tuning: Tuning) -> Result<Node, Error> {
        let addr = check_addr(addr)?;
        let mut config =
            Config::from_url(&format!("redis://{addr}")).map_err(|e| Error::InvalidUrl {
                url: addr.to_owned(),
                reason: e.to_string(),
            })?;
        // Keep retrying a server that is down at start-up too: a Redlock minority may come
        // back later. The caller bounds the wait with the connect timeout.
        config.fail_fast = false;
        let mut b = Builder::from_config(config);
        b.with_performance_config(|p| p.default_command_timeout = tuning.command_timeout)
            .with_connection_config(|c| {
                c.connection_timeout = tuning.connect_timeout;
                c.internal_command_timeout = tuning.command_timeout;
                c.max_command_attempts = 1;
            })
            .set_policy(ReconnectPolicy::new_constant(0, 200));
        let client = b
            .build()
            .map_err(|e| Error::backend(format!("configuring client for {addr}"), e))?;
        let sub = b
            .build_subscriber_client()
            .map_err(|e| Error::backend(format!("configuring subscriber for {addr}"), e))?;
        let conn_tasks = vec![client.connect(), sub.connect()];
        // R3: only a SubscriberClient that manages its subscriptions re-subscribes after a
        // reconnect. The handle ends when the client quits.
        let resubscriber = sub.manage_subscriptions().abort_handle();
        Ok(Node {
            addr: addr.to_owned(),
            client,
            sub,
            conn_tasks,
            resubscriber,
        })
    }

    /// Waits until both clients are connected, or `deadline` passes.
    pub async fn wait_connected(&self, deadline: Instant) -> Result<(), Error> {
        // `wait_for_connect` can miss a connection that completes between its state check
        // and its subscription, so poll in short slices.
        loop {
            if self.client.is_connected() && self.sub.is_connected() {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Unreachable(format!(
                    "redis at {} did not accept a connection in time (client {:?}, subscriber {:?})",
                    self.addr,
                    self.client.state(),
                    self.sub.state()
                )));
            }
            let slice = (deadline - now).min(Duration::from_millis(50));
            let pending = if self.client.is_connected() {
                self.sub.wait_for_connect().await_in(slice).await
            } else {
                self.client.wait_for_connect().await_in(slice).await
            };
            if pending.is_err() {
                // Failed attempt: the reconnect policy retries; do not spin meanwhile.
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }

    /// Stops both clients: QUIT if connected, then ends their connection tasks so that a
    /// client of an unreachable server stops reconnecting.
    pub async fn shutdown(&self) {
        let quit = async {
            let _ = futures::join!(self.client.quit(), self.sub.quit());
        };
        let _ = tokio::time::timeout(Duration::from_secs(1), quit).await;
        self.abort_tasks();
    }

    pub fn abort_tasks(&self) {
        for t in &self.conn_tasks {
            t.abort();
        }
        self.resubscriber.abort();
    }

    /// Runs `script` with EVALSHA, loading it on NOSCRIPT.
    pub async fn eval(
        &self,
        what: &str,
        script: &Script,
        keys: Vec<String>,
        args: Vec<Value>,
    ) -> Result<Value, Error> {
        script
            .evalsha_with_reload::<Value, _, _>(&self.client, keys, args)
            .await
            .map_err(|e| self.map_err(what, e))
    }

    /// The time `key` has left in ms (-1: no TTL), or `None` if it does not exist.
    pub async fn pttl(&self, key: &str) -> Result<Option<i64>, Error> {
        let n: i64 = self
            .client
            .pttl(key)
            .await
            .map_err(|e| self.map_err("checking an entry", e))?;
        Ok((n != -2).then_some(n))
    }

    /// Sends SUBSCRIBE for `channel`. It is *not* in force yet: see
    /// [`Node::confirm_subscriptions`].
    pub async fn subscribe(&self, channel: &str) -> Result<(), Error> {
        self.sub
            .subscribe(channel)
            .await
            .map_err(|e| self.map_err("subscribing", e))
    }

    /// Returns once the server has processed every SUBSCRIBE sent before this call.
    ///
    /// fred resolves `subscribe` as soon as the command is *written* (its confirmation
    /// arrives out of band and is dropped), so a command sent next on the other
    /// connection, such as the waiter's existence check, could reach the server first,
    /// and a removal published between the two was never delivered (the benchmark's 1 s
    /// stalls). A PING on the subscriber connection is answered only after everything
    /// sent before it on that connection, the SUBSCRIBEs included.
    pub async fn confirm_subscriptions(&self) -> Result<(), Error> {
        self.sub
            .ping::<Value>(None)
            .await
            .map(|_| ())
            .map_err(|e| self.map_err("confirming a subscription", e))
    }

    pub async fn unsubscribe(&self, channel: &str) -> Result<(), Error> {
        self.sub
            .unsubscribe(channel)
            .await
            .map_err(|e| self.map_err("unsubscribing", e))
    }

    /// Maps a fred error: connection trouble and timeouts are [`Error::Unreachable`],
    /// everything else (a script error, a protocol surprise) is [`Error::Backend`].
    pub fn map_err(&self, what: &str, e: fred::error::Error) -> Error {
        match e.kind() {
            ErrorKind::IO
            | ErrorKind::Timeout
            | ErrorKind::Canceled
            | ErrorKind::Routing
            | ErrorKind::Backpressure
            | ErrorKind::Cluster => {
                Error::Unreachable(format!("redis at {} while {what}: {e}", self.addr))
            }
            _ => Error::backend(format!("{what} on redis at {}", self.addr), e),
        }
    }

    /// Calls `on_reconnect` after every reconnection of the command client (and the first
    /// connection), and `on_resubscribe` after every reconnection of the subscriber.
    pub fn on_reconnect(
        &self,
        on_reconnect: impl Fn() + Send + Sync + 'static,
        on_resubscribe: impl Fn() + Send + Sync + 'static,
    ) -> Vec<tokio::task::JoinHandle<fred::prelude::FredResult<()>>> {
        let on_reconnect = std::sync::Arc::new(on_reconnect);
        let on_resubscribe = std::sync::Arc::new(on_resubscribe);
        let a = self.client.on_reconnect(move |server| {
            let f = on_reconnect.clone();
            async move {
                tracing::info!(%server, "redis connection (re)established; re-checking live entries");
                f();
                Ok(())
            }
        });
        let b = self.sub.on_reconnect(move |server| {
            let f = on_resubscribe.clone();
            async move {
                tracing::debug!(%server, "subscriber (re)connected; waking waiters to re-check");
                f();
                Ok(())
            }
        });
        vec![a, b]
    }
}

/// `timeout` as a method, to keep the connect loop readable.
trait AwaitIn: std::future::Future<Output = fred::prelude::FredResult<()>> + Sized {
    async fn await_in(self, d: Duration) -> Result<(), ()> {
        match tokio::time::timeout(d, self).await {
            Ok(Ok(())) => Ok(()),
            _ => Err(()),
        }
    }
}

impl<F: std::future::Future<Output = fred::prelude::FredResult<()>>> AwaitIn for F {}
