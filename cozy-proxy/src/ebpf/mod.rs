//! The eBPF datapath. For now: the embedded TC object and a load check that
//! proves the object passes the kernel's verifier on this machine.
use aya::{programs::SchedClassifier, Ebpf};

/// The object built from `cozy-proxy-ebpf` by build.rs.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(env!("COZY_PROXY_EBPF_OBJ"));

#[derive(Debug, thiserror::Error)]
pub enum EbpfError {
    #[error("loading the eBPF object: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("program {name}: {source}")]
    Program {
        name: String,
        source: aya::programs::ProgramError,
    },
}

/// Loads every program of the embedded object into the kernel (and unloads
/// them again); returns their names.
pub fn load_check() -> Result<Vec<String>, EbpfError> {
    let mut ebpf = Ebpf::load(OBJECT)?;
    let mut names = Vec::new();
    for (name, program) in ebpf.programs_mut() {
        let err = |source| EbpfError::Program {
            name: name.to_string(),
            source,
        };
        let tc: &mut SchedClassifier = program.try_into().map_err(err)?;
        tc.load().map_err(err)?;
        names.push(name.to_string());
    }
    names.sort();
    Ok(names)
}
