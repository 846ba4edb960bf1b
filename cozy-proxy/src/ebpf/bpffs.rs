//! The pin directory must live on a bpffs: pinned maps and links outlive
//! the process only there (a restart adopts them). Where neither it nor its
//! parent is one (a node without /sys/fs/bpf mounted, or a container given a
//! plain directory), one is mounted on the pin directory itself, as Cilium
//! mounts its own, and only where that directory is empty: a mount hides what a
//! directory holds, and the pin directory is ours while its parent is not.
//! Where that is not allowed (a container has no CAP_SYS_ADMIN) or the
//! directory is not empty, the error says what to do.
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
/// bpffs mounted in, as the chart mounts it), or its parent; else a bpffs
/// is mounted on `pin_dir`, created if missing, if it is empty and we may,
/// so that what is pinned survives a restart.
pub fn ensure(pin_dir: &Path) -> Result<(), EbpfError> {
    if pin_dir.is_dir() && is_bpffs(pin_dir).map_err(super::error::io(pin_dir))? {
        return Ok(());
    }
    let parent = pin_dir.parent().unwrap_or(Path::new("/"));
    std::fs::create_dir_all(parent).map_err(super::error::io(parent))?;
    if is_bpffs(parent).map_err(super::error::io(parent))? {
        return Ok(());
    }
    std::fs::create_dir_all(pin_dir).map_err(super::error::io(pin_dir))?;
    let mut entries = std::fs::read_dir(pin_dir).map_err(super::error::io(pin_dir))?;
    if entries.next().is_some() {
        return Err(EbpfError::NoBpffs {
            path: pin_dir.to_path_buf(),
            source: std::io::Error::other(
                "it holds files, which a bpffs mounted on it would hide; give an empty or a new directory",
            ),
        });
    }
    match mount_bpffs(pin_dir) {
        Ok(()) => {
            info!(path = %pin_dir.display(), "mounted a bpffs for the pinned maps and links");
            Ok(())
        }
        Err(source) => Err(EbpfError::NoBpffs {
            path: pin_dir.to_path_buf(),
            source,
        }),
    }
}

/// Needs root: mounts in a mount namespace of the test's thread.
#[cfg(test)]
mod kernel_tests {
    use super::*;

    /// Runs `f` on a thread in a private mount namespace of its own.
    fn in_own_mounts(f: impl FnOnce() + Send + 'static) {
        std::thread::spawn(move || {
            // SAFETY: unshare(2) and mount(2) on this thread only.
            unsafe {
                assert_eq!(libc::unshare(libc::CLONE_NEWNS), 0, "unshare");
                let root = c"/";
                let none = c"none";
                assert_eq!(
                    libc::mount(
                        none.as_ptr(),
                        root.as_ptr(),
                        std::ptr::null(),
                        libc::MS_REC | libc::MS_PRIVATE,
                        std::ptr::null()
                    ),
                    0,
                    "make-rprivate"
                );
            }
            f();
        })
        .join()
        .expect("the test thread");
    }

    /// A pin directory in a populated plain directory: the bpffs goes on
    /// the pin directory, the parent's files stay in sight; a pin
    /// directory that holds files is refused, not hidden.
    #[test]
    fn a_bpffs_is_mounted_only_on_the_empty_pin_directory() {
        in_own_mounts(|| {
            let parent = std::env::temp_dir().join(format!("cozy-bpffs-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&parent);
            std::fs::create_dir_all(&parent).expect("parent");
            std::fs::write(parent.join("theirs"), "kept").expect("a file of the parent's");
            let pins = parent.join("pins");
            ensure(&pins).expect("mounted");
            assert!(
                is_bpffs(&pins).expect("statfs"),
                "no bpffs on the pin directory"
            );
            assert!(!is_bpffs(&parent).expect("statfs"), "a bpffs on the parent");
            assert!(parent.join("theirs").exists(), "the parent's file hidden");
            ensure(&pins).expect("adopted as it is");
            std::fs::create_dir_all(parent.join("held")).expect("held");
            std::fs::write(parent.join("held").join("file"), "x").expect("a file");
            let err = ensure(&parent.join("held")).expect_err("refused");
            assert!(err.to_string().contains("holds files"), "{err}");
        });
    }
}
