//! The tc filters on an interface's clsact hooks, as the kernel lists them
//! (RTM_GETTFILTER): how the legacy attachment (kernels before tcx) finds
//! what runs beside our own filter, and in which order. Layouts from
//! <linux/rtnetlink.h> (`struct tcmsg`) and <linux/pkt_cls.h> (TCA_BPF_*).
use super::socket::{next_seq, NetlinkError, NlSocket};
use super::wire::{attr, attr_str, Writer, NLM_F_DUMP};

const TCMSG_LEN: usize = 20;
const TCA_KIND: u16 = 1;
const TCA_OPTIONS: u16 = 2;
const TCA_BPF_NAME: u16 = 7;
const TCA_BPF_ID: u16 = 11;

/// clsact's hooks, as a filter's parent: TC_H_MAKE(TC_H_CLSACT,
/// TC_H_MIN_INGRESS / TC_H_MIN_EGRESS).
pub const PARENT_INGRESS: u32 = 0xffff_fff2;
pub const PARENT_EGRESS: u32 = 0xffff_fff3;

/// One filter of a hook.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Filter {
    /// Lower runs first.
    pub priority: u16,
    /// The protocol it applies to (ETH_P_*, host order; 3 is every one).
    pub protocol: u16,
    pub handle: u32,
    /// The classifier ("bpf", "u32", "flower", ...).
    pub kind: String,
    /// A bpf filter's program: its name and id.
    pub program: Option<(String, u32)>,
}

/// The filters on `ifindex`'s hook `parent`, in the order the kernel runs
/// them: by priority, and within one priority as the classifier lists
/// them (cls_bpf runs its list in order). An interface without clsact
/// has none.
pub fn filters(sock: &NlSocket, ifindex: u32, parent: u32) -> Result<Vec<Filter>, NetlinkError> {
    let seq = next_seq();
    let mut w = Writer::new();
    let mut tcmsg = [0u8; TCMSG_LEN];
    tcmsg[4..8].copy_from_slice(&ifindex.to_ne_bytes());
    tcmsg[12..16].copy_from_slice(&parent.to_ne_bytes());
    w.message(libc::RTM_GETTFILTER, NLM_F_DUMP, seq, &tcmsg, |_| {});
    let answers = match sock.dump(&w.into_bytes(), seq, "tc filter dump") {
        Ok(a) => a,
        // No clsact qdisc (EINVAL) or no such device: nothing runs there.
        Err(e) if matches!(e.errno(), Some(libc::EINVAL | libc::ENODEV | libc::ENOENT)) => {
            return Ok(Vec::new())
        }
        Err(e) => return Err(e),
    };
    Ok(answers.iter().filter_map(|a| parse(a)).collect())
}

fn parse(a: &[u8]) -> Option<Filter> {
    if a.len() < TCMSG_LEN {
        return None;
    }
    let word = |at: usize| u32::from_ne_bytes([a[at], a[at + 1], a[at + 2], a[at + 3]]);
    let (handle, info) = (word(8), word(16));
    // Handle 0: the classifier instance of a priority itself, no filter.
    if handle == 0 {
        return None;
    }
    let body = &a[TCMSG_LEN..];
    let kind = attr_str(body, TCA_KIND).unwrap_or_default();
    let program = attr(body, TCA_OPTIONS).and_then(|o| {
        let id = attr(o, TCA_BPF_ID)
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map(u32::from_ne_bytes)?;
        Some((attr_str(o, TCA_BPF_NAME).unwrap_or_default(), id))
    });
    Some(Filter {
        priority: (info >> 16) as u16,
        protocol: u16::from_be(info as u16),
        handle,
        kind,
        program,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bpf_filter_is_read_with_its_program() {
        let mut w = Writer::new();
        let mut tcmsg = [0u8; TCMSG_LEN];
        tcmsg[8..12].copy_from_slice(&0xc0u32.to_ne_bytes());
        let info = (1u32 << 16) | u32::from(3u16.to_be());
        tcmsg[16..20].copy_from_slice(&info.to_ne_bytes());
        w.message(libc::RTM_NEWTFILTER, 0, 1, &tcmsg, |w| {
            w.put_str(TCA_KIND, "bpf");
            w.nest(TCA_OPTIONS, |w| {
                w.put_str(TCA_BPF_NAME, "cil_from_netdev");
                w.put_u32_ne(TCA_BPF_ID, 42);
            });
        });
        let bytes = w.into_bytes();
        let msg = super::super::wire::messages(&bytes)
            .next()
            .expect("one message");
        let f = parse(msg.payload).expect("a filter");
        assert_eq!(
            f,
            Filter {
                priority: 1,
                protocol: 3,
                handle: 0xc0,
                kind: "bpf".into(),
                program: Some(("cil_from_netdev".into(), 42)),
            }
        );
        // The priority's own entry (handle 0) is no filter.
        let mut head = tcmsg;
        head[8..12].copy_from_slice(&0u32.to_ne_bytes());
        assert_eq!(parse(&head), None);
    }
}
