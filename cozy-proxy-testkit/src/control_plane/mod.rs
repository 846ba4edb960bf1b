//! The real Kubernetes control plane (etcd, kube-apiserver,
//! kube-controller-manager, kube-proxy, kubectl and helm, built from their
//! Go modules by `cargo xtask setup`) in the node's namespace (`k8s`), and
//! a real MetalLB in layer 2 (`metallb`): its controller, and a speaker per
//! node announcing to the outside router.
//!
//! What they do not model: kubelets and container runtimes (pods are
//! network namespaces; their status is patched as a kubelet would), and a
//! scheduler.
pub mod k8s;
pub mod metallb;
