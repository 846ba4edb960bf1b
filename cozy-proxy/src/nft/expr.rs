//! nf_tables expressions, as the kernel receives them (what libnftnl would
//! encode for the equivalent `nft` syntax).
use super::sys::*;
use crate::netlink::wire::Writer;

#[derive(Clone, Debug)]
pub enum Expr {
    /// Load `len` bytes at `offset` of header `base` into `dreg`.
    Load {
        base: u32,
        offset: u32,
        len: u32,
        dreg: u32,
    },
    /// Write `len` bytes from `sreg` at `offset` of header `base`, fixing the
    /// checksum at `csum_offset` (network header) and, with `l4_pseudo`, the
    /// L4 checksum over the pseudo-header.
    Store {
        base: u32,
        offset: u32,
        len: u32,
        sreg: u32,
        csum_type: u32,
        csum_offset: u32,
        l4_pseudo: bool,
    },
    /// Look `sreg` up in a set; with `dreg`, a map whose value lands there.
    Lookup {
        set: &'static str,
        set_id: u32,
        sreg: u32,
        dreg: Option<u32>,
        invert: bool,
    },
    Meta {
        key: u32,
        dreg: u32,
    },
    /// A conntrack key; `original` for directional keys (addresses).
    Ct {
        key: u32,
        dreg: u32,
        original: bool,
    },
    /// `fib daddr type`: the route type (RTN_*) of the destination.
    FibDaddrType {
        dreg: u32,
    },
    /// `fib daddr . iif oif`: the interface the route to the destination
    /// takes if it is the one the packet came in on, else 0.
    FibDaddrIif {
        dreg: u32,
    },
    /// `meta key set` the value in `sreg`.
    MetaSet {
        key: u32,
        sreg: u32,
    },
    /// `masquerade`: the source becomes the output interface's address.
    Masquerade,
    /// `dnat to` the address in `reg` (stateful, through conntrack).
    Dnat {
        family: u8,
        reg: u32,
    },
    Bitwise {
        reg: u32,
        mask: Vec<u8>,
        xor: Vec<u8>,
    },
    Cmp {
        sreg: u32,
        op: u32,
        data: Vec<u8>,
    },
    Counter,
    Verdict(u32),
}

impl Expr {
    pub fn name(&self) -> &'static str {
        match self {
            Expr::Load { .. } | Expr::Store { .. } => "payload",
            Expr::Lookup { .. } => "lookup",
            Expr::Meta { .. } => "meta",
            Expr::Ct { .. } => "ct",
            Expr::FibDaddrType { .. } | Expr::FibDaddrIif { .. } => "fib",
            Expr::MetaSet { .. } => "meta",
            Expr::Masquerade => "masq",
            Expr::Dnat { .. } => "nat",
            Expr::Bitwise { .. } => "bitwise",
            Expr::Cmp { .. } => "cmp",
            Expr::Counter => "counter",
            Expr::Verdict(_) => "immediate",
        }
    }

    /// Writes `NFTA_LIST_ELEM { NFTA_EXPR_NAME, NFTA_EXPR_DATA { ... } }`.
    pub fn encode(&self, w: &mut Writer) {
        w.nest(NFTA_LIST_ELEM, |w| {
            w.put_str(NFTA_EXPR_NAME, self.name());
            w.nest(NFTA_EXPR_DATA, |w| self.encode_data(w));
        });
    }

    fn encode_data(&self, w: &mut Writer) {
        match self {
            Expr::Load {
                base,
                offset,
                len,
                dreg,
            } => {
                w.put_u32(NFTA_PAYLOAD_DREG, *dreg);
                w.put_u32(NFTA_PAYLOAD_BASE, *base);
                w.put_u32(NFTA_PAYLOAD_OFFSET, *offset);
                w.put_u32(NFTA_PAYLOAD_LEN, *len);
            }
            Expr::Store {
                base,
                offset,
                len,
                sreg,
                csum_type,
                csum_offset,
                l4_pseudo,
            } => {
                w.put_u32(NFTA_PAYLOAD_SREG, *sreg);
                w.put_u32(NFTA_PAYLOAD_BASE, *base);
                w.put_u32(NFTA_PAYLOAD_OFFSET, *offset);
                w.put_u32(NFTA_PAYLOAD_LEN, *len);
                w.put_u32(NFTA_PAYLOAD_CSUM_TYPE, *csum_type);
                w.put_u32(NFTA_PAYLOAD_CSUM_OFFSET, *csum_offset);
                if *l4_pseudo {
                    w.put_u32(NFTA_PAYLOAD_CSUM_FLAGS, NFT_PAYLOAD_L4CSUM_PSEUDOHDR);
                }
            }
            Expr::Lookup {
                set,
                set_id,
                sreg,
                dreg,
                invert,
            } => {
                w.put_str(NFTA_LOOKUP_SET, set);
                w.put_u32(NFTA_LOOKUP_SET_ID, *set_id);
                w.put_u32(NFTA_LOOKUP_SREG, *sreg);
                if let Some(dreg) = dreg {
                    w.put_u32(NFTA_LOOKUP_DREG, *dreg);
                }
                if *invert {
                    w.put_u32(NFTA_LOOKUP_FLAGS, NFT_LOOKUP_F_INV);
                }
            }
            Expr::Meta { key, dreg } => {
                w.put_u32(NFTA_META_KEY, *key);
                w.put_u32(NFTA_META_DREG, *dreg);
            }
            Expr::Ct {
                key,
                dreg,
                original,
            } => {
                w.put_u32(NFTA_CT_KEY, *key);
                w.put_u32(NFTA_CT_DREG, *dreg);
                if *original {
                    w.put(NFTA_CT_DIRECTION, &[0]);
                }
            }
            Expr::FibDaddrType { dreg } => {
                w.put_u32(NFTA_FIB_DREG, *dreg);
                w.put_u32(NFTA_FIB_RESULT, NFT_FIB_RESULT_ADDRTYPE);
                w.put_u32(NFTA_FIB_FLAGS, NFTA_FIB_F_DADDR);
            }
            Expr::FibDaddrIif { dreg } => {
                w.put_u32(NFTA_FIB_DREG, *dreg);
                w.put_u32(NFTA_FIB_RESULT, NFT_FIB_RESULT_OIF);
                w.put_u32(NFTA_FIB_FLAGS, NFTA_FIB_F_DADDR | NFTA_FIB_F_IIF);
            }
            Expr::MetaSet { key, sreg } => {
                w.put_u32(NFTA_META_KEY, *key);
                w.put_u32(NFTA_META_SREG, *sreg);
            }
            Expr::Masquerade => {}
            Expr::Dnat { family, reg } => {
                w.put_u32(NFTA_NAT_TYPE, NFT_NAT_DNAT);
                w.put_u32(NFTA_NAT_FAMILY, *family as u32);
                w.put_u32(NFTA_NAT_REG_ADDR_MIN, *reg);
            }
            Expr::Bitwise { reg, mask, xor } => {
                w.put_u32(NFTA_BITWISE_SREG, *reg);
                w.put_u32(NFTA_BITWISE_DREG, *reg);
                w.put_u32(NFTA_BITWISE_LEN, mask.len() as u32);
                w.put_data(NFTA_BITWISE_MASK, mask);
                w.put_data(NFTA_BITWISE_XOR, xor);
            }
            Expr::Cmp { sreg, op, data } => {
                w.put_u32(NFTA_CMP_SREG, *sreg);
                w.put_u32(NFTA_CMP_OP, *op);
                w.put_data(NFTA_CMP_DATA, data);
            }
            Expr::Counter => {}
            Expr::Verdict(code) => {
                w.put_u32(NFTA_IMMEDIATE_DREG, NFT_REG_VERDICT);
                w.nest(NFTA_IMMEDIATE_DATA, |w| {
                    w.nest(NFTA_DATA_VERDICT, |w| w.put_u32(NFTA_VERDICT_CODE, *code));
                });
            }
        }
    }
}
