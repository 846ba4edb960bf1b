//! A minimal HTTP/1.1 server for `/metrics`, `/healthz`, `/readyz` and
//! `/hosting`:
//! one request per connection, no dependencies beyond tokio. It sits on
//! the node's network: a request head is bounded (4 KiB), a connection
//! gets [`CONNECTION_DEADLINE`] for its whole exchange, and at most
//! [`MAX_CONNECTIONS`] are served at once (more are closed at once), so
//! slow or many clients cannot pile up tasks and memory.
use super::{Telemetry, HEALTH_STALL};
use std::{
    sync::Arc,
    time::{Duration, Instant},
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::Semaphore,
};
use tracing::{debug, info, warn};

/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 32;
/// The time a connection gets to send its request and take the answer.
pub const CONNECTION_DEADLINE: Duration = Duration::from_secs(5);

/// Serves until the task is dropped.
pub async fn serve(listener: TcpListener, telemetry: Telemetry) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    if let Ok(addr) = listener.local_addr() {
        info!(%addr, "serving /metrics, /healthz, /readyz, /hosting");
    }
    // Accept errors (EMFILE, ENOBUFS) persist until something frees up:
    // back off instead of spinning on them.
    let mut backoff = Duration::from_millis(10);
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => {
                backoff = Duration::from_millis(10);
                stream
            }
            Err(e) => {
                warn!(error = %e, retry_in = ?backoff, "accepting a metrics connection failed");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            debug!("metrics connections at their cap; closing one");
            continue;
        };
        let telemetry = telemetry.clone();
        tokio::spawn(async move {
            match tokio::time::timeout(CONNECTION_DEADLINE, answer(stream, &telemetry)).await {
                Ok(Err(e)) => debug!(error = %e, "metrics connection"),
                Err(_) => debug!("metrics connection too slow; closed"),
                Ok(Ok(())) => {}
            }
            drop(slot);
        });
    }
}

async fn answer(mut stream: TcpStream, telemetry: &Telemetry) -> std::io::Result<()> {
    let mut buf = vec![0u8; 4096];
    let mut len = 0;
    // Read the request head (we need only its first line).
    while len < buf.len() {
        let n = stream.read(&mut buf[len..]).await?;
        if n == 0 {
            break;
        }
        len += n;
        if buf[..len].windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
    }
    let head = String::from_utf8_lossy(&buf[..len]);
    let path = head
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or("/");
    let (status, body) = match path {
        "/metrics" => ("200 OK", telemetry.metrics.render()),
        "/healthz" => match telemetry.stalled_for(Instant::now(), HEALTH_STALL) {
            None => ("200 OK", "ok\n".to_string()),
            Some(age) => (
                "503 Service Unavailable",
                format!("the reconcile loop has not turned for {age:?}\n"),
            ),
        },
        "/hosting" => ("200 OK", telemetry.shared_json()),
        "/readyz" if telemetry.is_ready() => ("200 OK", "ready\n".to_string()),
        "/readyz" => (
            "503 Service Unavailable",
            "waiting for the first sync\n".to_string(),
        ),
        _ => ("404 Not Found", "not found\n".to_string()),
    };
    let content_type = match path {
        "/metrics" => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        "/hosting" => "application/json",
        _ => "text/plain; charset=utf-8",
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}
