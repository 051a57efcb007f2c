//! A TCP proxy on loopback between one process and PostgreSQL, which the run can cut and
//! restore: the process's path to the database, and only its, goes dark.
//!
//! A cut is a network partition, not a refusal: nothing is closed, bytes already sent wait (in
//! the sockets' buffers and here) and new connections are accepted but not forwarded, so the
//! process sees its statements hang, as it would behind a dead switch. When the path is restored
//! everything held flows on, late: the process's old statements reach the server after whatever
//! happened meanwhile.

use std::net::SocketAddr;

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// One proxy: listens on a loopback port and forwards to `upstream` while not cut.
pub struct DbProxy {
    addr: SocketAddr,
    cut: watch::Sender<bool>,
    accept: JoinHandle<()>,
}

impl DbProxy {
    /// Starts a proxy to `upstream` on a free loopback port.
    pub async fn start(upstream: SocketAddr) -> anyhow::Result<DbProxy> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding a database proxy")?;
        let addr = listener.local_addr()?;
        let (cut, cut_rx) = watch::channel(false);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(forward(client, upstream, cut_rx.clone()));
            }
        });
        Ok(DbProxy { addr, cut, accept })
    }

    /// Where the process connects.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Cuts the path: nothing passes until [`DbProxy::restore`].
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    pub fn restore(&self) {
        self.cut.send_replace(false);
    }
}

impl Drop for DbProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Waits while the path is cut; `false` when the proxy is gone.
async fn passable(cut: &mut watch::Receiver<bool>) -> bool {
    cut.wait_for(|c| !*c).await.is_ok()
}

async fn forward(client: TcpStream, upstream: SocketAddr, mut cut: watch::Receiver<bool>) {
    if !passable(&mut cut).await {
        return;
    }
    let Ok(server) = TcpStream::connect(upstream).await else {
        return; // PostgreSQL is down: the client sees its connection closed
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let _ = tokio::join!(
        pump(client_read, server_write, cut.clone()),
        pump(server_read, client_write, cut),
    );
}

/// Copies one direction, holding every chunk while the path is cut.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut cut: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if !passable(&mut cut).await {
            return Ok(());
        }
        let n = from.read(&mut buf).await?;
        if !passable(&mut cut).await {
            return Ok(());
        }
        if n == 0 {
            return to.shutdown().await;
        }
        to.write_all(&buf[..n]).await?;
    }
}
