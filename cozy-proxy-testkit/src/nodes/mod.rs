//! Nodes and their networks, each a set of network namespaces the test
//! creates and removes: one node with its pods wired in the shapes the
//! common CNIs build (`topology`: routed veths, a bridge, VXLAN, Kube-OVN's
//! gateway and its node-local segment), two nodes behind one outside
//! router (`cluster`), the addresses they use (`net`), a VM whose
//! interface moves from one node to the other (`migration`), and real
//! nodes: a kubelet, containerd and the CNI plugins per node namespace
//! (`kubelet`, their images `images`), two of them joined to a real
//! control plane on the cluster's LAN (`real_cluster`).
//!
//! What the namespace nodes do not model: a kubelet, a container runtime
//! or a CNI plugin (the tests wire the pods as those would, with `ip`;
//! the real nodes run them), Open vSwitch
//! (Kube-OVN's switch is a Linux bridge or routed veths here), and a VM's
//! memory copy (the migrating VM is a namespace whose interface moves).
pub mod cluster;
pub mod images;
pub mod kubelet;
pub mod migration;
pub mod net;
pub mod real_cluster;
pub mod topology;
