//! [`datapath_suite!`]: one `#[test]` per scenario, family and datapath,
//! the same test names in every binary (`nft::v4::s01_ping`,
//! `bridge::ebpf_fast::v6::s25_vm_to_vm`); [`cases!`]: one `#[test]` per
//! named case of a matrix.

/// Declares the tests of a scenario list. Each test calls the binary's
/// runner: `RUN(ARGS.., family, module::scenario)`.
///
/// - `datapath_suite!(RUN(ARGS..); module::scenario, ..)`: modules `v4`
///   and `v6`, one test per scenario in each.
/// - `datapath_suite!(@datapaths RUN(ARGS..); ..)`: modules `nft`, `ebpf`
///   and `ebpf_fast`, each as above with its [`crate::Backend`] put first
///   in ARGS.
/// - `datapath_suite!(@tests RUN(ARGS..); ..)`: no module, one test per
///   scenario (a subset run one way: in a container, through the API).
///
/// Each generated module imports its parent's names (`use super::*`), so
/// RUN, ARGS and the scenario modules are written as at the call site.
#[macro_export]
macro_rules! datapath_suite {
    (@datapaths $run:ident($($arg:expr),*); $($module:ident :: $name:ident),+ $(,)?) => {
        mod nft {
            use super::*;
            $crate::datapath_suite!($run($crate::Backend::Nft $(, $arg)*); $($module::$name),+);
        }
        mod ebpf {
            use super::*;
            $crate::datapath_suite!($run($crate::Backend::Ebpf $(, $arg)*); $($module::$name),+);
        }
        mod ebpf_fast {
            use super::*;
            $crate::datapath_suite!($run($crate::Backend::EbpfFast $(, $arg)*); $($module::$name),+);
        }
    };
    ($run:ident($($arg:expr),*); $($module:ident :: $name:ident),+ $(,)?) => {
        mod v4 {
            use super::*;
            $crate::datapath_suite!(@tests $run($($arg,)* $crate::nodes::net::Fam::V4); $($module::$name),+);
        }
        mod v6 {
            use super::*;
            $crate::datapath_suite!(@tests $run($($arg,)* $crate::nodes::net::Fam::V6); $($module::$name),+);
        }
    };
    (@tests $run:ident $args:tt; $($module:ident :: $name:ident),+) => {
        $(
            #[test]
            fn $name() {
                $crate::datapath_suite!(@call $run $args, $module::$name);
            }
        )+
    };
    (@call $run:ident($($arg:expr),*), $scenario:path) => {
        $run($($arg,)* $scenario)
    };
}

/// One `#[test]` per named case: `cases!(RUN; name: ARGS..; ..)` calls
/// `RUN(ARGS..)` and fails with the error's whole chain.
#[macro_export]
macro_rules! cases {
    ($run:path; $($name:ident: $($arg:expr),+;)*) => {
        $(
            #[test]
            fn $name() {
                if let Err(e) = $run($($arg),+) {
                    panic!("{e:#}");
                }
            }
        )*
    };
}
