//! What the nftables datapath's calls fail with.
use crate::netlink::NetlinkError;

#[derive(Debug, thiserror::Error)]
pub enum NftError {
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error("decoding the kernel's answer: {0}")]
    Decode(#[from] DecodeError),
}

impl crate::datapath::ErrorKind for NftError {
    fn kind(&self) -> &'static str {
        match self {
            NftError::Netlink(e) => crate::datapath::ErrorKind::kind(e),
            NftError::Decode(_) => "decode",
        }
    }
}

/// An answer of the kernel that does not have the shape we wrote.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("an element of set {set} has no key")]
    ElementWithoutKey { set: String },
    #[error("an element of set {set} has {len} address bytes, expected {expected}")]
    ElementSize {
        set: &'static str,
        len: usize,
        expected: usize,
    },
    #[error("an allowed_ports key has {len} bytes")]
    PortKey { len: usize },
    #[error("a guard_paths key has {len} bytes")]
    PathKey { len: usize },
}
