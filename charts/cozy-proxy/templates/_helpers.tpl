{{- define "cozy-proxy.name" -}}cozy-proxy{{- end -}}

{{- define "cozy-proxy.labels" -}}
app.kubernetes.io/name: cozy-proxy
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "cozy-proxy.selector" -}}
app.kubernetes.io/name: cozy-proxy
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* eBPF may run: the bpffs mount and the BPF capabilities are needed. */}}
{{- define "cozy-proxy.ebpf" -}}
{{- if ne .Values.backend "nft" }}true{{- end -}}
{{- end -}}

{{/* The eBPF seccomp profile's path under the kubelet's seccomp directory. */}}
{{- define "cozy-proxy.seccompProfile" -}}
cozy-proxy/cozy-proxy-ebpf.json
{{- end }}
