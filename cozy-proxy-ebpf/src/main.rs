//! cozy-proxy TC programs: a stateless 1:1 NAT between LoadBalancer IPs and
//! pods, and the port filter. See docs/ebpf-datapath.md for the hook points.
//!
//! - `cozy_ingress` (TC ingress of every interface): drops traffic to
//!   unmapped LB IPs; rewrites the source of a mapped pod's packets to its
//!   LB IP (before conntrack, like the nft backend's raw-priority chain).
//! - `cozy_egress` (TC egress of every interface): rewrites the destination
//!   LB IP to the pod (after conntrack and routing: the controller routes
//!   each LB IP via its pod), then applies the port filter to forwarded
//!   packets toward filtered pods.
#![no_std]
#![no_main]

mod filter;
mod hdr;
mod maps;
mod nat;
mod parse;

use aya_ebpf::{
    bindings::{TC_ACT_SHOT, TC_ACT_UNSPEC},
    macros::classifier,
    programs::TcContext,
};
use cozy_proxy_common::{Counter, DropReason, IpKey, ServiceCounters};
use maps::{DROP_STATS, FILTERED_PODS, POD_SVC, SVC_POD, SVC_STATS, UNMAPPED_LBS};
use nat::{rewrite, Field};
use parse::{is_neighbour_discovery, parse};

/// Let the packet continue (next TC program, or the stack).
const PASS: i32 = TC_ACT_UNSPEC;
const DROP: i32 = TC_ACT_SHOT as i32;

#[inline(always)]
fn count_drop(ctx: &TcContext, reason: DropReason) -> i32 {
    if let Some(c) = DROP_STATS.get_ptr_mut(reason as u32) {
        // SAFETY: per-CPU slot, only this CPU writes it.
        unsafe {
            (*c).packets += 1;
            (*c).bytes += ctx.len() as u64;
        }
    }
    DROP
}

#[inline(always)]
fn count_service(ctx: &TcContext, lb: &IpKey, ingress: bool) {
    let mut slot = SVC_STATS.get_ptr_mut(lb);
    if slot.is_none() {
        let _ = SVC_STATS.insert(lb, ServiceCounters::default(), 0);
        slot = SVC_STATS.get_ptr_mut(lb);
    }
    if let Some(s) = slot {
        // SAFETY: per-CPU value, only this CPU writes it.
        let c: &mut Counter = unsafe {
            if ingress {
                &mut (*s).ingress
            } else {
                &mut (*s).egress
            }
        };
        c.packets += 1;
        c.bytes += ctx.len() as u64;
    }
}

#[classifier]
pub fn cozy_ingress(mut ctx: TcContext) -> i32 {
    let Some(p) = parse(&ctx) else { return PASS };
    if UNMAPPED_LBS.get_ptr(&p.dst).is_some() {
        return count_drop(&ctx, DropReason::UnmappedLb);
    }
    let Some(lb) = POD_SVC.get_ptr(&p.src) else { return PASS };
    if is_neighbour_discovery(&ctx, &p) {
        return PASS;
    }
    // SAFETY: a map value; userspace replaces values whole.
    let lb = unsafe { *lb };
    if FILTERED_PODS.get_ptr(&p.src).is_some() {
        filter::remember_outbound(&ctx, &p);
    }
    if rewrite(&mut ctx, &p, Field::Src, &p.src, &lb).is_err() {
        return PASS;
    }
    count_service(&ctx, &lb, false);
    PASS
}

#[classifier]
pub fn cozy_egress(mut ctx: TcContext) -> i32 {
    let Some(mut p) = parse(&ctx) else { return PASS };
    if let Some(pod) = SVC_POD.get_ptr(&p.dst) {
        if is_neighbour_discovery(&ctx, &p) {
            return PASS;
        }
        // SAFETY: a map value; userspace replaces values whole.
        let pod = unsafe { *pod };
        let lb = p.dst;
        if rewrite(&mut ctx, &p, Field::Dst, &lb, &pod).is_err() {
            return PASS;
        }
        p.dst = pod;
        count_service(&ctx, &lb, true);
    }
    // Only forwarded traffic is filtered (as the nft backend's prerouting
    // chain): the node's own probes to the pod are not.
    // SAFETY: reading a field of the context the kernel passed us.
    let forwarded = unsafe { (*ctx.skb.skb).ingress_ifindex } != 0;
    if !forwarded {
        return PASS;
    }
    let Some(policy) = FILTERED_PODS.get_ptr(&p.dst) else { return PASS };
    // SAFETY: a map value; userspace replaces values whole.
    let policy = unsafe { *policy };
    match filter::admit(&ctx, &p, &policy) {
        Ok(()) => PASS,
        Err(reason) => count_drop(&ctx, reason),
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
