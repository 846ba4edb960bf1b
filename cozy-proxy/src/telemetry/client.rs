//! `cozy-proxy dump`'s question to the running controller: its word on
//! the mappings several nodes hold (`/hosting`), over plain HTTP/1.1 on
//! the node's loopback. A controller that does not answer within
//! [`DEADLINE`] leaves `dump` with what the kernel holds.
use crate::datapath::SharedMapping;
use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    time::Duration,
};

/// For the connection, and again for each read and write.
pub const DEADLINE: Duration = Duration::from_secs(2);

/// The answer is a handful of mappings; more is not the controller's.
const MAX_ANSWER: u64 = 1 << 20;

/// Why the controller's word could not be had.
#[derive(Debug, thiserror::Error)]
pub enum AskError {
    #[error("{0}: not an address:port")]
    Address(String),
    #[error("{addr}: {source}")]
    Io {
        addr: String,
        source: std::io::Error,
    },
    #[error("{addr}: answered {status:?}")]
    Status { addr: String, status: String },
    #[error("{addr}: its answer is not the list of shared mappings: {source}")]
    Body {
        addr: String,
        source: serde_json::Error,
    },
}

/// GET `/hosting` from the controller serving at `addr` (its health or
/// metrics address).
pub fn read_hosting(addr: &str) -> Result<Vec<SharedMapping>, AskError> {
    let sock: SocketAddr = addr.parse().map_err(|_| AskError::Address(addr.into()))?;
    let io = |source| AskError::Io {
        addr: addr.into(),
        source,
    };
    let mut stream = TcpStream::connect_timeout(&sock, DEADLINE).map_err(io)?;
    stream.set_read_timeout(Some(DEADLINE)).map_err(io)?;
    stream.set_write_timeout(Some(DEADLINE)).map_err(io)?;
    let request = format!("GET /hosting HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).map_err(io)?;
    let mut answer = String::new();
    (stream.take(MAX_ANSWER))
        .read_to_string(&mut answer)
        .map_err(io)?;
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let status = head.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1) != Some("200") {
        return Err(AskError::Status {
            addr: addr.into(),
            status: status.into(),
        });
    }
    serde_json::from_str(body).map_err(|source| AskError::Body {
        addr: addr.into(),
        source,
    })
}
