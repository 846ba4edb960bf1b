//! Services and EndpointSlices written as YAML files into the directory the
//! controller watches, the way an operator would write them.
use anyhow::{Context, Result};
use std::{
    fs,
    path::{Path, PathBuf},
};

pub use cozy_proxy::fixtures::{Slice, Svc};

/// The YAML of an EndpointSlice of `service` (namespace `default`) with
/// `(address, ready)` endpoints: [`Slice`] in one call.
pub fn slice(service: &str, address_type: &str, endpoints: &[(String, Option<bool>)]) -> String {
    let endpoints: Vec<(&str, Option<bool>)> =
        endpoints.iter().map(|(a, r)| (a.as_str(), *r)).collect();
    Slice::new(service, address_type, &endpoints).yaml()
}

/// The watched directory, removed when dropped.
pub struct ManifestDir {
    pub path: PathBuf,
}

impl ManifestDir {
    pub fn new(prefix: &str) -> Result<ManifestDir> {
        let path = std::env::temp_dir().join(format!("{prefix}-manifests"));
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(ManifestDir { path })
    }

    /// Writes (or replaces, atomically) `name.yaml`.
    pub fn put(&self, name: &str, yaml: &str) -> Result<()> {
        let tmp = self.path.join(format!(".{name}.tmp"));
        fs::write(&tmp, yaml)?;
        fs::rename(&tmp, self.file(name))?;
        Ok(())
    }

    /// Removes `name.yaml`. The last one removed leaves the marker that
    /// says "empty on purpose" (an emptied directory otherwise keeps the
    /// last state: `cozy_proxy::source::EMPTY_MARKER`).
    pub fn remove(&self, name: &str) -> Result<()> {
        fs::remove_file(self.file(name)).with_context(|| format!("removing {name}"))?;
        let left = cozy_proxy::source::manifests::manifest_files(&self.path)?;
        if left.is_empty() {
            fs::write(self.path.join(cozy_proxy::source::EMPTY_MARKER), "")?;
        }
        Ok(())
    }

    fn file(&self, name: &str) -> PathBuf {
        self.path.join(format!("{name}.yaml"))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ManifestDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.path);
    }
}

/// The `.yaml` files of a directory, sorted.
pub fn files_in(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    Ok(files)
}
