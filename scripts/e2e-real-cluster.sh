#!/usr/bin/env bash
# End-to-end check of cozy-proxy on a REAL Kubernetes cluster.
#
# THIS SCRIPT CANNOT RUN ON THE PROJECT'S DEVELOPMENT OR CI MACHINES: they
# have no container engine, no kind and no kube-apiserver. It is shipped for
# operators and for machines that have a cluster; the same scenarios run here
# against the in-process API stand-in (cozy-proxy/tests/kube_source.rs and
# the kube_nft scenario suite).
#
# Needs: kubectl and helm pointing at a cluster (KUBECONFIG), the cozy-proxy
# image pushed where the cluster can pull it (IMAGE=...), a LoadBalancer
# implementation that hands out IPs (MetalLB, cloud LB ...), and a client
# machine outside the cluster that can reach those IPs (this one).
# Usage: IMAGE=registry/cozy-proxy:tag BACKEND=ebpf|nft scripts/e2e-real-cluster.sh
set -euo pipefail
: "${IMAGE:?set IMAGE to a pullable cozy-proxy image}"
BACKEND="${BACKEND:-auto}"
NS=cozy-proxy-e2e
here="$(cd "$(dirname "$0")/.." && pwd)"

cleanup() {
  kubectl delete namespace "$NS" --ignore-not-found --wait=false >/dev/null 2>&1 || true
}
trap cleanup EXIT

echo "== installing cozy-proxy (backend=$BACKEND)"
helm upgrade --install cozy-proxy "$here/charts/cozy-proxy" -n kube-system \
  --set backend="$BACKEND" --set image.repository="${IMAGE%:*}" --set image.tag="${IMAGE##*:}" --wait

echo "== a pod and a whole-IP Service"
kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f -
kubectl -n "$NS" apply -f - <<'YAML'
apiVersion: v1
kind: Pod
metadata: {name: vm1, labels: {app: vm1}}
spec:
  containers:
  - name: web
    image: registry.k8s.io/e2e-test-images/agnhost:2.53
    args: ["netexec", "--http-port=8080", "--udp-port=8081"]
---
apiVersion: v1
kind: Service
metadata:
  name: vm1
  labels: {service.kubernetes.io/service-proxy-name: cozy-proxy}
  annotations: {networking.cozystack.io/wholeIP: "true"}
spec:
  type: LoadBalancer
  selector: {app: vm1}
  ports: [{port: 8080, name: http}]
YAML
kubectl -n "$NS" wait --for=condition=Ready pod/vm1 --timeout=120s
for _ in $(seq 60); do
  LB=$(kubectl -n "$NS" get svc vm1 -o jsonpath='{.status.loadBalancer.ingress[0].ip}')
  [ -n "$LB" ] && break
  sleep 2
done
[ -n "${LB:-}" ] || { echo "no LoadBalancer IP"; exit 1; }
echo "LB IP: $LB"

echo "== scenario 2: any port reaches the pod"
curl -fsS --max-time 5 "http://$LB:8080/hostname" | grep -q vm1

if [ -n "${ECHO_URL:-}" ]; then
  echo "== scenario 4: the pod's egress carries the LB IP (ECHO_URL answers with the caller's address)"
  kubectl -n "$NS" exec vm1 -- wget -qO- "$ECHO_URL" | grep -q "$LB"
fi

echo "== scenario 12: wholeIP=false filters"
kubectl -n "$NS" annotate svc vm1 networking.cozystack.io/wholeIP=false --overwrite
sleep 2
curl -fsS --max-time 5 "http://$LB:8080/hostname" >/dev/null
if curl -fsS --max-time 3 "http://$LB:8081/" >/dev/null 2>&1; then echo "port 8081 should be filtered"; exit 1; fi

echo "== scenario 18: two ready endpoints -> Warning Event"
kubectl -n "$NS" run vm1b --image=registry.k8s.io/e2e-test-images/agnhost:2.53 --labels=app=vm1 -- netexec --http-port=8080
kubectl -n "$NS" wait --for=condition=Ready pod/vm1b --timeout=120s
sleep 3
kubectl -n "$NS" get events --field-selector reason=MultipleEndpoints | grep -q vm1

echo "== metrics"
pod=$(kubectl -n kube-system get pods -l app.kubernetes.io/name=cozy-proxy -o jsonpath='{.items[0].metadata.name}')
kubectl -n kube-system exec "$pod" -- wget -qO- http://127.0.0.1:9402/metrics | grep cozy_proxy_services

echo "e2e: all checks passed"
