//! A process whose kernel refuses some `bpf(2)` commands: the real kernel
//! failing a call (EPERM through a seccomp filter), as it does for a
//! missing capability, a program type it will not attach or a link it
//! cannot update, so that a test sees what the controller does then.
use std::io;

/// `bpf(2)` commands (`enum bpf_cmd`).
pub const BPF_LINK_CREATE: u32 = 28;
pub const BPF_LINK_UPDATE: u32 = 29;

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xc000_003e;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xc000_00b7;

// Classic BPF opcodes and `struct seccomp_data` offsets.
const LD_W_ABS: u16 = 0x20;
const JEQ_K: u16 = 0x15;
const RET_K: u16 = 0x06;
const NR: u32 = 0;
const ARCH: u32 = 4;
/// The low 32 bits of the first argument (little-endian).
const ARG0: u32 = 16;

fn op(code: u16, jt: u8, jf: u8, k: u32) -> libc::sock_filter {
    libc::sock_filter { code, jt, jf, k }
}

/// The filter: `bpf(cmd, ...)` with `cmd` in `refused` fails with EPERM;
/// every other call (and any other architecture's) is allowed.
pub fn filter(refused: &[u32]) -> Vec<libc::sock_filter> {
    let n = refused.len() as u8;
    // Instructions after each jump up to the two returns: allow, then EPERM.
    let mut f = vec![
        op(LD_W_ABS, 0, 0, ARCH),
        op(JEQ_K, 0, 3 + n, AUDIT_ARCH),
        op(LD_W_ABS, 0, 0, NR),
        op(JEQ_K, 0, 1 + n, libc::SYS_bpf as u32),
        op(LD_W_ABS, 0, 0, ARG0),
    ];
    for (i, cmd) in refused.iter().enumerate() {
        let left = n - 1 - i as u8;
        f.push(op(JEQ_K, left + 1, 0, *cmd));
    }
    f.push(op(RET_K, 0, 0, libc::SECCOMP_RET_ALLOW));
    f.push(op(
        RET_K,
        0,
        0,
        libc::SECCOMP_RET_ERRNO | libc::EPERM as u32,
    ));
    f
}

/// Installs `filter` on the calling thread, for it and what it execs.
/// Only async-signal-safe calls: this runs between fork and exec.
pub fn install(filter: &[libc::sock_filter]) -> io::Result<()> {
    let prog = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: prctl with integer arguments, and a pointer to a filter that
    // outlives the call.
    unsafe {
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
            return Err(io::Error::last_os_error());
        }
        if libc::prctl(
            libc::PR_SET_SECCOMP,
            libc::SECCOMP_MODE_FILTER,
            &prog as *const libc::sock_fprog,
        ) != 0
        {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}
