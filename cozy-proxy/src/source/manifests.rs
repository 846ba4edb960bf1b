//! The standalone source: Services and EndpointSlices from YAML or JSON
//! manifests in a directory (multi-document YAML allowed).
use super::Snapshot;
use serde::Deserialize;
use std::sync::Arc;
use std::{
    fs,
    path::{Path, PathBuf},
};

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A document that could not be used; the rest of the directory still is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skipped {
    pub file: PathBuf,
    pub document: usize,
    pub reason: String,
}

/// Everything read from the directory.
#[derive(Clone, Debug, Default)]
pub struct Loaded {
    pub snapshot: Snapshot,
    pub skipped: Vec<Skipped>,
}

fn is_manifest(path: &Path) -> bool {
    matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("yaml" | "yml" | "json")
    )
}

/// The manifest files of `dir`, sorted by name.
pub fn manifest_files(dir: &Path) -> Result<Vec<PathBuf>, ManifestError> {
    let io = |source| ManifestError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        if path.is_file() && is_manifest(&path) {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// The largest manifest file read: a Service and its EndpointSlice take a
/// few KiB; a file this large is a mistake (a log, a dump) and reading it
/// would only cost memory.
pub const MAX_FILE_BYTES: u64 = 4 << 20;

/// The directory's manifests: their names and contents (compared between
/// polls to notice any change), and the files refused for their size.
pub type Contents = (Vec<(PathBuf, Vec<u8>)>, Vec<Skipped>);

/// Reads the directory's manifests, each up to [`MAX_FILE_BYTES`]; larger
/// ones are skipped (the rest of the directory still counts).
pub fn read_manifests(dir: &Path) -> Result<Contents, ManifestError> {
    use std::io::Read;
    let (mut files, mut skipped) = (Vec::new(), Vec::new());
    for path in manifest_files(dir)? {
        let io = |source| ManifestError::Io {
            path: path.clone(),
            source,
        };
        let mut bytes = Vec::new();
        // Bounded even if the file grows while it is read.
        fs::File::open(&path)
            .and_then(|f| f.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes))
            .map_err(io)?;
        if bytes.len() as u64 > MAX_FILE_BYTES {
            skipped.push(Skipped {
                file: path,
                document: 0,
                reason: format!("larger than {MAX_FILE_BYTES} bytes; not read"),
            });
        } else {
            files.push((path, bytes));
        }
    }
    Ok((files, skipped))
}

/// The manifests of `dir` within the size cap (see [`read_manifests`]).
pub fn fingerprint(dir: &Path) -> Result<Vec<(PathBuf, Vec<u8>)>, ManifestError> {
    read_manifests(dir).map(|(files, _)| files)
}

/// Parses manifests (as returned by [`fingerprint`]).
pub fn parse(files: &[(PathBuf, Vec<u8>)]) -> Loaded {
    let mut loaded = Loaded::default();
    for (file, bytes) in files {
        let text = String::from_utf8_lossy(bytes);
        for (i, doc) in serde_yaml::Deserializer::from_str(&text).enumerate() {
            let skip = |reason: String| Skipped {
                file: file.clone(),
                document: i,
                reason,
            };
            let value = match serde_yaml::Value::deserialize(doc) {
                Ok(serde_yaml::Value::Null) => continue,
                Ok(v) => v,
                Err(e) => {
                    loaded.skipped.push(skip(format!("not YAML: {e}")));
                    // A syntax error ends the stream of this file.
                    break;
                }
            };
            if let Err(reason) = add_object(&mut loaded.snapshot, value) {
                loaded.skipped.push(skip(reason));
            }
        }
    }
    loaded
}

fn add_object(snapshot: &mut Snapshot, value: serde_yaml::Value) -> Result<(), String> {
    let kind = value
        .get("kind")
        .and_then(|k| k.as_str())
        .unwrap_or("")
        .to_string();
    let api_version = value
        .get("apiVersion")
        .and_then(|k| k.as_str())
        .unwrap_or("")
        .to_string();
    match (api_version.as_str(), kind.as_str()) {
        ("v1", "Service") => {
            let svc = serde_yaml::from_value(value).map_err(|e| format!("invalid Service: {e}"))?;
            snapshot.services.push(Arc::new(svc));
        }
        ("discovery.k8s.io/v1", "EndpointSlice") => {
            let slice =
                serde_yaml::from_value(value).map_err(|e| format!("invalid EndpointSlice: {e}"))?;
            snapshot.endpoint_slices.push(Arc::new(slice));
        }
        ("v1", "Node") => {
            let node = serde_yaml::from_value(value).map_err(|e| format!("invalid Node: {e}"))?;
            snapshot.nodes.push(node);
        }
        ("networking.k8s.io/v1", "ServiceCIDR") => {
            let cidr =
                serde_yaml::from_value(value).map_err(|e| format!("invalid ServiceCIDR: {e}"))?;
            snapshot.service_cidrs.push(cidr);
        }
        ("v1", "List") => {
            let items = value
                .get("items")
                .and_then(|i| i.as_sequence())
                .cloned()
                .unwrap_or_default();
            for item in items {
                add_object(snapshot, item)?;
            }
        }
        _ => return Err(format!("ignored object {api_version}/{kind}")),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_over_the_size_cap_are_skipped_and_the_rest_is_read() {
        let dir = std::env::temp_dir().join(format!("cozy-proxy-cap-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(dir.join("a.yaml"), "kind: Service\n").expect("a");
        let big = vec![b'#'; (super::MAX_FILE_BYTES + 1) as usize];
        std::fs::write(dir.join("big.yaml"), big).expect("big");
        let (files, skipped) = super::read_manifests(&dir).expect("read");
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(files.len(), 1);
        assert!(files[0].0.ends_with("a.yaml"));
        assert_eq!(skipped.len(), 1);
        assert!(skipped[0].file.ends_with("big.yaml"));
        assert!(skipped[0].reason.contains("larger than"));
    }

    #[test]
    fn reads_multi_document_yaml_and_reports_bad_documents() {
        let yaml = br#"
apiVersion: v1
kind: Service
metadata: {name: a, namespace: ns}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: a-1, namespace: ns, labels: {kubernetes.io/service-name: a}}
addressType: IPv4
endpoints: [{addresses: ["192.0.2.11"]}]
---
apiVersion: v1
kind: ConfigMap
metadata: {name: c}
---
apiVersion: v1
kind: Service
metadata: {name: 42}
spec: {ports: "not a list"}
"#;
        let loaded = parse(&[(PathBuf::from("x.yaml"), yaml.to_vec())]);
        assert_eq!(loaded.snapshot.services.len(), 1);
        assert_eq!(loaded.snapshot.endpoint_slices.len(), 1);
        assert_eq!(loaded.skipped.len(), 2, "{:?}", loaded.skipped);
        assert!(loaded.skipped[0].reason.contains("ConfigMap"));
        assert!(loaded.skipped[1].reason.contains("invalid Service"));
    }

    #[test]
    fn a_syntax_error_skips_the_rest_of_that_file_only() {
        let bad = b"apiVersion: v1\nkind: Service\nmetadata: {name: [\n".to_vec();
        let good = b"apiVersion: v1\nkind: Service\nmetadata: {name: b}\n".to_vec();
        let loaded = parse(&[
            (PathBuf::from("a.yaml"), bad),
            (PathBuf::from("b.yaml"), good),
        ]);
        assert_eq!(loaded.snapshot.services.len(), 1);
        assert_eq!(loaded.skipped.len(), 1);
    }
}
