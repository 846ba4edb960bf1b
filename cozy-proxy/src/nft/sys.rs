//! nf_tables and netfilter constants. Values are kernel ABI.
//!
//! - Where the `libc` crate defines a constant, it is taken from there.
//! - The rest are not in `libc` (it has no NFTA_* attribute numbers): they
//!   are copied from the Linux UAPI headers <linux/netfilter/nf_tables.h>
//!   (NFTA_*, NFT_PAYLOAD_L4CSUM_PSEUDOHDR) and
//!   <linux/netfilter/nf_conntrack_common.h> (the ct state bits), and from
//!   nftables' and libnftnl's own sources where they are the user-space
//!   conventions `nft` reads back (data type ids, the rule comment).
#![allow(dead_code)]

// From libc.
pub const NFT_CT_DST_IP: u32 = libc::NFT_CT_DST_IP as u32;
pub const NFT_NAT_DNAT: u32 = libc::NFT_NAT_DNAT as u32;
pub const NFT_SET_INTERVAL: u32 = libc::NFT_SET_INTERVAL as u32;
pub const NFT_SET_ELEM_INTERVAL_END: u32 = libc::NFT_SET_ELEM_INTERVAL_END as u32;
pub const NFT_META_IIF: u32 = libc::NFT_META_IIF as u32;
pub const NFT_META_PROTOCOL: u32 = libc::NFT_META_PROTOCOL as u32;
pub const NF_INET_LOCAL_OUT: u32 = libc::NF_INET_LOCAL_OUT as u32;
pub const NFNL_SUBSYS_NFTABLES: u16 = libc::NFNL_SUBSYS_NFTABLES as u16;
pub const NFNL_MSG_BATCH_BEGIN: u16 = libc::NFNL_MSG_BATCH_BEGIN as u16;
pub const NFNL_MSG_BATCH_END: u16 = libc::NFNL_MSG_BATCH_END as u16;
pub const NFT_MSG_NEWTABLE: u16 = libc::NFT_MSG_NEWTABLE as u16;
pub const NFT_MSG_GETTABLE: u16 = libc::NFT_MSG_GETTABLE as u16;
pub const NFT_MSG_DELTABLE: u16 = libc::NFT_MSG_DELTABLE as u16;
pub const NFT_MSG_NEWCHAIN: u16 = libc::NFT_MSG_NEWCHAIN as u16;
pub const NFT_MSG_GETCHAIN: u16 = libc::NFT_MSG_GETCHAIN as u16;
pub const NFT_MSG_DELCHAIN: u16 = libc::NFT_MSG_DELCHAIN as u16;
pub const NFT_MSG_NEWRULE: u16 = libc::NFT_MSG_NEWRULE as u16;
pub const NFT_MSG_GETRULE: u16 = libc::NFT_MSG_GETRULE as u16;
pub const NFT_MSG_DELRULE: u16 = libc::NFT_MSG_DELRULE as u16;
pub const NFT_MSG_NEWSET: u16 = libc::NFT_MSG_NEWSET as u16;
pub const NFT_MSG_GETSET: u16 = libc::NFT_MSG_GETSET as u16;
pub const NFT_MSG_DELSET: u16 = libc::NFT_MSG_DELSET as u16;
pub const NFT_MSG_NEWSETELEM: u16 = libc::NFT_MSG_NEWSETELEM as u16;
pub const NFT_MSG_GETSETELEM: u16 = libc::NFT_MSG_GETSETELEM as u16;
pub const NFT_MSG_DELSETELEM: u16 = libc::NFT_MSG_DELSETELEM as u16;
pub const NFT_MSG_GETGEN: u16 = libc::NFT_MSG_GETGEN as u16;
pub const NFT_PAYLOAD_NETWORK_HEADER: u32 = libc::NFT_PAYLOAD_NETWORK_HEADER as u32;
pub const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = libc::NFT_PAYLOAD_TRANSPORT_HEADER as u32;
pub const NFT_PAYLOAD_CSUM_NONE: u32 = libc::NFT_PAYLOAD_CSUM_NONE as u32;
pub const NFT_PAYLOAD_CSUM_INET: u32 = libc::NFT_PAYLOAD_CSUM_INET as u32;
pub const NFT_LOOKUP_F_INV: u32 = libc::NFT_LOOKUP_F_INV as u32;
pub const NFT_META_L4PROTO: u32 = libc::NFT_META_L4PROTO as u32;
pub const NFT_CMP_EQ: u32 = libc::NFT_CMP_EQ as u32;
pub const NFT_CMP_NEQ: u32 = libc::NFT_CMP_NEQ as u32;
pub const NFT_CT_STATE: u32 = libc::NFT_CT_STATE as u32;
pub const NFT_REG_VERDICT: u32 = libc::NFT_REG_VERDICT as u32;
pub const NFT_REG32_00: u32 = libc::NFT_REG32_00 as u32;
pub const NFT_SET_MAP: u32 = libc::NFT_SET_MAP as u32;
pub const NF_INET_PRE_ROUTING: u32 = libc::NF_INET_PRE_ROUTING as u32;
pub const NFPROTO_IPV4: u8 = libc::NFPROTO_IPV4 as u8;
pub const NFPROTO_IPV6: u8 = libc::NFPROTO_IPV6 as u8;
pub const NFPROTO_UNSPEC: u8 = libc::NFPROTO_UNSPEC as u8;
pub const NFPROTO_INET: u8 = libc::NFPROTO_INET as u8;
pub const NF_ACCEPT: u32 = libc::NF_ACCEPT as u32;
pub const NF_DROP: u32 = libc::NF_DROP as u32;
pub const NFNETLINK_V0: u8 = libc::NFNETLINK_V0 as u8;
pub const NFT_CMP_LTE: u32 = libc::NFT_CMP_LTE as u32;
pub const NFT_CMP_GTE: u32 = libc::NFT_CMP_GTE as u32;

// From <linux/netfilter/nf_tables.h> and <linux/netfilter/nf_conntrack_common.h>.
pub const NFTA_TABLE_NAME: u16 = 1;
pub const NFTA_GEN_ID: u16 = 1;
pub const NFTA_TABLE_FLAGS: u16 = 2;
/// A dormant table's base chains are not on their hooks.
pub const NFT_TABLE_F_DORMANT: u32 = 1;
pub const NFTA_TABLE_USERDATA: u16 = 6;
pub const NFTA_CHAIN_TABLE: u16 = 1;
pub const NFTA_CHAIN_NAME: u16 = 3;
pub const NFTA_CHAIN_HOOK: u16 = 4;
pub const NFTA_CHAIN_POLICY: u16 = 5;
pub const NFTA_CHAIN_TYPE: u16 = 7;
pub const NFTA_HOOK_HOOKNUM: u16 = 1;
pub const NFTA_HOOK_PRIORITY: u16 = 2;
pub const NFTA_RULE_TABLE: u16 = 1;
pub const NFTA_RULE_CHAIN: u16 = 2;
pub const NFTA_RULE_HANDLE: u16 = 3;
pub const NFTA_RULE_EXPRESSIONS: u16 = 4;
pub const NFTA_RULE_USERDATA: u16 = 7;
pub const NFTA_LIST_ELEM: u16 = 1;
pub const NFTA_EXPR_NAME: u16 = 1;
pub const NFTA_EXPR_DATA: u16 = 2;
pub const NFTA_SET_TABLE: u16 = 1;
pub const NFTA_SET_NAME: u16 = 2;
pub const NFTA_SET_FLAGS: u16 = 3;
pub const NFTA_SET_KEY_TYPE: u16 = 4;
pub const NFTA_SET_KEY_LEN: u16 = 5;
pub const NFTA_SET_DATA_TYPE: u16 = 6;
pub const NFTA_SET_DATA_LEN: u16 = 7;
pub const NFTA_SET_ID: u16 = 10;
pub const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
pub const NFTA_SET_ELEM_LIST_SET: u16 = 2;
pub const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
pub const NFTA_SET_ELEM_KEY: u16 = 1;
pub const NFTA_SET_ELEM_DATA: u16 = 2;
pub const NFTA_DATA_VALUE: u16 = 1;
pub const NFTA_DATA_VERDICT: u16 = 2;
pub const NFTA_VERDICT_CODE: u16 = 1;
pub const NFTA_PAYLOAD_DREG: u16 = 1;
pub const NFTA_PAYLOAD_BASE: u16 = 2;
pub const NFTA_PAYLOAD_OFFSET: u16 = 3;
pub const NFTA_PAYLOAD_LEN: u16 = 4;
pub const NFTA_PAYLOAD_SREG: u16 = 5;
pub const NFTA_PAYLOAD_CSUM_TYPE: u16 = 6;
pub const NFTA_PAYLOAD_CSUM_OFFSET: u16 = 7;
pub const NFTA_PAYLOAD_CSUM_FLAGS: u16 = 8;
pub const NFT_PAYLOAD_L4CSUM_PSEUDOHDR: u32 = 1;
pub const NFTA_LOOKUP_SET: u16 = 1;
pub const NFTA_LOOKUP_SREG: u16 = 2;
pub const NFTA_LOOKUP_DREG: u16 = 3;
pub const NFTA_LOOKUP_SET_ID: u16 = 4;
pub const NFTA_LOOKUP_FLAGS: u16 = 5;
pub const NFTA_META_DREG: u16 = 1;
pub const NFTA_META_KEY: u16 = 2;
pub const NFTA_CMP_SREG: u16 = 1;
pub const NFTA_CMP_OP: u16 = 2;
pub const NFTA_CMP_DATA: u16 = 3;
pub const NFTA_CT_DREG: u16 = 1;
pub const NFTA_CT_KEY: u16 = 2;
pub const NFTA_BITWISE_SREG: u16 = 1;
pub const NFTA_BITWISE_DREG: u16 = 2;
pub const NFTA_BITWISE_LEN: u16 = 3;
pub const NFTA_BITWISE_MASK: u16 = 4;
pub const NFTA_BITWISE_XOR: u16 = 5;
pub const NFTA_IMMEDIATE_DREG: u16 = 1;
pub const NFTA_IMMEDIATE_DATA: u16 = 2;
pub const NFTA_COUNTER_BYTES: u16 = 1;
pub const NFTA_COUNTER_PACKETS: u16 = 2;
pub const CT_STATE_ESTABLISHED: u32 = 2;
pub const CT_STATE_RELATED: u32 = 4;

pub const NFTA_CT_DIRECTION: u16 = 3;
pub const NFT_CT_DST_IP6: u32 = 22;
pub const NFTA_NAT_TYPE: u16 = 1;
pub const NFTA_NAT_FAMILY: u16 = 2;
pub const NFTA_NAT_REG_ADDR_MIN: u16 = 3;
pub const NFTA_FIB_DREG: u16 = 1;
pub const NFTA_FIB_RESULT: u16 = 2;
pub const NFTA_FIB_FLAGS: u16 = 3;
pub const NFT_FIB_RESULT_ADDRTYPE: u32 = 3;
pub const NFTA_FIB_F_DADDR: u32 = 2;
pub const NFT_SET_CONCAT: u32 = 0x80;
pub const NFTA_SET_DESC: u16 = 9;
pub const NFTA_SET_DESC_SIZE: u16 = 1;
pub const NFTA_SET_DESC_CONCAT: u16 = 2;
pub const NFTA_SET_FIELD_LEN: u16 = 1;
pub const NFTA_SET_ELEM_FLAGS: u16 = 3;
pub const NFTA_SET_ELEM_KEY_END: u16 = 10;
/// <linux/rtnetlink.h>: the address type `fib daddr type` yields.
pub const RTN_UNICAST: u32 = 1;

// User-space conventions of nftables (src/datatype.h) and libnftnl.
/// nftables' own data type ids (nftables src/datatype.h), so that `nft list` can print our sets.
pub const TYPE_IPADDR: u32 = 7;
pub const TYPE_IP6ADDR: u32 = 8;
pub const TYPE_INET_PROTOCOL: u32 = 12;
pub const TYPE_INET_SERVICE: u32 = 13;
pub const TYPE_IFINDEX: u32 = 20;
/// Bits per type in a concatenated key type (nftables TYPE_BITS).
pub const TYPE_BITS: u32 = 6;
/// libnftnl's rule comment in NFTA_RULE_USERDATA (NFTNL_UDATA_RULE_COMMENT).
pub const UDATA_RULE_COMMENT: u8 = 0;
/// Our rule fingerprint in NFTA_RULE_USERDATA: a type libnftnl does not
/// define, which nft skips when it lists the rule.
pub const UDATA_RULE_FINGERPRINT: u8 = 0x7c;

// <linux/netfilter/nf_tables.h>, <linux/netfilter.h>: the hairpin chains.
pub const NF_INET_FORWARD: u32 = 2;
pub const NF_INET_POST_ROUTING: u32 = 4;
pub const NFT_META_MARK: u32 = 3;
pub const NFT_META_OIFKIND: u32 = 27;
pub const NFTA_META_SREG: u16 = 3;
pub const NFT_CT_STATUS: u32 = 2;
/// <linux/netfilter/nf_conntrack_common.h> IPS_DST_NAT.
pub const IPS_DST_NAT: u32 = 1 << 5;
pub const NFT_FIB_RESULT_OIF: u32 = 1;
pub const NFTA_FIB_F_IIF: u32 = 1 << 3;
