//! The pin directory must live on a bpffs: pinned maps and links outlive
//! the process only there (a restart adopts them). Where neither it nor its
//! parent is one (a node without /sys/fs/bpf mounted, or a container given a plain
//! directory), one is mounted as Cilium does; where that is not allowed
//! (a container has no CAP_SYS_ADMIN), the error says what to do.
use super::EbpfError;
use std::{ffi::CString, os::unix::ffi::OsStrExt, path::Path};
use tracing::info;

/// `BPF_FS_MAGIC` from linux/magic.h.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

fn is_bpffs(path: &Path) -> Result<bool, std::io::Error> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: statfs(2) on a NUL-terminated path into a zeroed struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.f_type as i64 == BPF_FS_MAGIC)
}

fn mount_bpffs(path: &Path) -> Result<(), std::io::Error> {
    let target = CString::new(path.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let (source, fstype, data) = (c"bpf", c"bpf", c"mode=0700");
    // SAFETY: mount(2) with NUL-terminated strings.
    let rc = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            data.as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Makes sure `pin_dir` is on a bpffs: itself (a directory of the host's
/// bpffs mounted in, as the chart mounts it), or its parent (mounting one
/// there if it is not and we may), so that what is pinned survives a
/// restart.
pub fn ensure(pin_dir: &Path) -> Result<(), EbpfError> {
    if pin_dir.is_dir() && is_bpffs(pin_dir).map_err(super::io(pin_dir))? {
        return Ok(());
    }
    let parent = pin_dir.parent().unwrap_or(Path::new("/"));
    std::fs::create_dir_all(parent).map_err(super::io(parent))?;
    if is_bpffs(parent).map_err(super::io(parent))? {
        return Ok(());
    }
    match mount_bpffs(parent) {
        Ok(()) => {
            info!(path = %parent.display(), "mounted a bpffs for the pinned maps and links");
            Ok(())
        }
        Err(source) => Err(EbpfError::NoBpffs {
            path: pin_dir.to_path_buf(),
            source,
        }),
    }
}
