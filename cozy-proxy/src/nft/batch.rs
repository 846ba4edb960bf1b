//! nfnetlink framing for nf_tables: transactions (batches) and dump requests.
use super::sys::{
    NFNETLINK_V0, NFNL_MSG_BATCH_BEGIN, NFNL_MSG_BATCH_END, NFNL_SUBSYS_NFTABLES, NFPROTO_UNSPEC,
    NFTA_GEN_ID, NFT_MSG_GETGEN,
};
use crate::netlink::{
    socket::{next_seq, NetlinkError, NlSocket},
    wire::{attrs, Writer, NLM_F_ACK, NLM_F_DUMP},
};

/// The nfgenmsg header.
fn nfgen(family: u8, res_id: u16) -> [u8; 4] {
    let r = res_id.to_be_bytes();
    [family, NFNETLINK_V0, r[0], r[1]]
}

/// A batch of nf_tables messages applied as one transaction: all or nothing.
pub struct Batch {
    writer: Writer,
    /// (sequence number, what the message does) of every message.
    pending: Vec<(u32, String)>,
}

impl Batch {
    pub fn new() -> Self {
        Self::with_capacity(0)
    }

    /// A batch with room for `bytes` of messages.
    pub fn with_capacity(bytes: usize) -> Self {
        let mut writer = Writer::with_capacity(bytes);
        writer.message(
            NFNL_MSG_BATCH_BEGIN,
            0,
            next_seq(),
            &nfgen(NFPROTO_UNSPEC, NFNL_SUBSYS_NFTABLES),
            |_| {},
        );
        Batch {
            writer,
            pending: Vec::new(),
        }
    }

    /// Adds one nf_tables message (`msg` is NFT_MSG_*), acknowledged.
    pub fn add(
        &mut self,
        msg: u16,
        flags: u16,
        family: u8,
        what: impl Into<String>,
        body: impl FnOnce(&mut Writer),
    ) {
        let seq = next_seq();
        self.writer.message(
            (NFNL_SUBSYS_NFTABLES << 8) | msg,
            flags | NLM_F_ACK,
            seq,
            &nfgen(family, 0),
            body,
        );
        self.pending.push((seq, what.into()));
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// The size of the messages so far, and the room made for them.
    pub fn bytes_len(&self) -> (usize, usize) {
        (self.writer.len(), self.writer.capacity())
    }

    pub fn message_count(&self) -> usize {
        self.pending.len()
    }

    /// The messages so far (BATCH_BEGIN and the added ones).
    #[cfg(test)]
    pub fn bytes(&self) -> &[u8] {
        self.writer.as_bytes()
    }

    /// Sends the batch and checks every acknowledgement.
    pub fn apply(mut self, sock: &NlSocket) -> Result<(), NetlinkError> {
        if self.is_empty() {
            return Ok(());
        }
        self.writer.message(
            NFNL_MSG_BATCH_END,
            0,
            next_seq(),
            &nfgen(NFPROTO_UNSPEC, NFNL_SUBSYS_NFTABLES),
            |_| {},
        );
        sock.transact(&self.writer.into_bytes(), self.pending)
    }
}

impl Default for Batch {
    fn default() -> Self {
        Batch::new()
    }
}

/// Dumps nf_tables objects (`msg` is NFT_MSG_GET*); returns each answer's
/// payload after nlmsghdr.
pub fn dump(
    sock: &NlSocket,
    msg: u16,
    family: u8,
    body: impl FnOnce(&mut Writer),
) -> Result<Vec<Vec<u8>>, NetlinkError> {
    let seq = next_seq();
    let mut w = Writer::new();
    w.message(
        (NFNL_SUBSYS_NFTABLES << 8) | msg,
        NLM_F_DUMP | NLM_F_ACK,
        seq,
        &nfgen(family, 0),
        body,
    );
    sock.dump(&w.into_bytes(), seq, &format!("nf_tables dump {msg}"))
}

/// The ruleset's generation: it goes up by one with every committed
/// transaction, ours or anyone else's.
pub fn generation(sock: &NlSocket) -> Result<u32, NetlinkError> {
    let seq = next_seq();
    let mut w = Writer::new();
    w.message(
        (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETGEN,
        NLM_F_ACK,
        seq,
        &nfgen(NFPROTO_UNSPEC, 0),
        |_| {},
    );
    let answers = sock.dump(&w.into_bytes(), seq, "nf_tables generation")?;
    answers
        .iter()
        .find_map(|a| {
            let (_, id) = attrs(a.get(4..)?).find(|(t, _)| *t == NFTA_GEN_ID)?;
            Some(u32::from_be_bytes(id.get(..4)?.try_into().ok()?))
        })
        .ok_or_else(|| {
            NetlinkError::Io(std::io::Error::other(
                "no NFTA_GEN_ID in the nf_tables generation answer",
            ))
        })
}
