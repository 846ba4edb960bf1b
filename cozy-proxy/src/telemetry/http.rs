//! A minimal HTTP/1.1 server for `/metrics`, `/healthz` and `/readyz`:
//! one request per connection, no dependencies beyond tokio.
use super::Telemetry;
use std::time::Duration;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};
use tracing::{debug, info, warn};

/// Serves until the task is dropped.
pub async fn serve(listener: TcpListener, telemetry: Telemetry) {
    if let Ok(addr) = listener.local_addr() {
        info!(%addr, "serving /metrics, /healthz, /readyz");
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
        let telemetry = telemetry.clone();
        tokio::spawn(async move {
            if let Err(e) = answer(stream, &telemetry).await {
                debug!(error = %e, "metrics connection");
            }
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
        "/healthz" => ("200 OK", "ok\n".to_string()),
        "/readyz" if telemetry.is_ready() => ("200 OK", "ready\n".to_string()),
        "/readyz" => (
            "503 Service Unavailable",
            "waiting for the first sync\n".to_string(),
        ),
        _ => ("404 Not Found", "not found\n".to_string()),
    };
    let content_type = if path == "/metrics" {
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    } else {
        "text/plain; charset=utf-8"
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}
