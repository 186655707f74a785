{{/*
Names are fixed (gpushare-extender, nats, postgres, ...) as in k8s/base: the services, the inspect plugin and
the scheduler configurations find each other by them, and a cluster installed with kustomize can move to the
chart without renaming anything (tests/deploy/test_chart.py compares the two). Service ports name their protocol
(TCP, the apiserver's default): Kubernetes 1.20's server-side apply, Helm v4's default, refuses a port without.
*/}}

{{/* Labels on every object: the kustomize tree's, plus Helm's own (metadata only, never in a selector). */}}
{{- define "gpushare.labels" -}}
app.kubernetes.io/part-of: gpushare
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | quote }}
{{- end }}

{{/* Selector (and pod template) labels of one component: (list . "gpushare-extender"). */}}
{{- define "gpushare.selector" -}}
app.kubernetes.io/name: {{ index . 1 }}
app.kubernetes.io/part-of: gpushare
{{- end }}

{{/* metadata.labels of one component's objects: (list . "gpushare-extender"). */}}
{{- define "gpushare.componentLabels" -}}
app.kubernetes.io/name: {{ index . 1 }}
{{ include "gpushare.labels" (index . 0) }}
{{- end }}

{{/* The gpushare image: repository[:tag][@digest], the tag defaulting to the chart's appVersion. */}}
{{- define "gpushare.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}:{{ $tag }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ $tag }}
{{- end -}}
{{- end }}

{{/* Pod spec lines every gpushare container's pod shares: pull secrets. */}}
{{- define "gpushare.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The migration Job's name: one per release (gpushare-migrate-0-2-0), so each release's Job is a new object. */}}
{{- define "gpushare.migrateJobName" -}}
gpushare-migrate-{{ .Chart.AppVersion | replace "." "-" | replace "+" "-" | lower }}
{{- end }}

{{/* Whether the ServiceMonitor is rendered: true/false, or with "auto" whether the cluster serves
     monitoring.coreos.com/v1 (`helm template`: pass --api-versions monitoring.coreos.com/v1/ServiceMonitor). */}}
{{- define "gpushare.serviceMonitor" -}}
{{- $value := .Values.monitoring.serviceMonitor.enabled -}}
{{- if eq (toString $value) "auto" -}}
{{- if or (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/ServiceMonitor") (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1") }}true{{ end -}}
{{- else if $value -}}
true
{{- end -}}
{{- end }}

{{/* Whether the admission policy is rendered: true/false, or with "auto" whether the cluster is Kubernetes 1.30+
     (admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy; `helm template`: --kube-version). */}}
{{- define "gpushare.admissionPolicy" -}}
{{- $value := .Values.admissionPolicy.enabled -}}
{{- if eq (toString $value) "auto" -}}
{{- if semverCompare ">=1.30.0-0" .Capabilities.KubeVersion.Version }}true{{ end -}}
{{- else if $value -}}
true
{{- end -}}
{{- end }}

{{/* PodDisruptionBudget's API: policy/v1 (1.21+), policy/v1beta1 on a cluster that serves only that (1.20). */}}
{{- define "gpushare.pdbApiVersion" -}}
{{- if or (.Capabilities.APIVersions.Has "policy/v1") (not (.Capabilities.APIVersions.Has "policy/v1beta1")) -}}
policy/v1
{{- else -}}
policy/v1beta1
{{- end -}}
{{- end }}

{{/* host:port/database of the ledger: the value given, else the in-cluster PostgreSQL (the StatefulSet's Service, or
     the CloudNativePG Cluster's read-write Service, which follows the primary; the instances serve TLS with the
     operator's certificates, and a connection that reaches a server that is not the primary is refused and retried). */}}
{{- define "gpushare.databaseServer" -}}
{{- if .Values.database.server -}}
{{ .Values.database.server }}
{{- else if and .Values.postgresql.enabled (eq .Values.postgresql.mode "cloudnativepg") -}}
gpushare-db-rw:5432/gpushare?sslmode=require&target_session_attrs=read-write
{{- else if and .Values.postgresql.enabled .Values.singleMachine.enabled -}}
{{ include "gpushare.listen" (list . "postgres") }}/gpushare
{{- else if .Values.postgresql.enabled -}}
postgres:5432/gpushare
{{- else -}}
{{ fail "database.server is required with postgresql.enabled=false: host:port/database[?sslmode=verify-full] of your PostgreSQL" }}
{{- end -}}
{{- end }}

{{/*
One credential, base64: the value given, else the installed Secret's (read with `lookup`, so an upgrade keeps
it), else 32 random letters and digits. (list . "secret-name" "key" value)
`helm template` and client-side dry runs cannot look up: they show fresh random values.
*/}}
{{- define "gpushare.credential" -}}
{{- $ctx := index . 0 -}}{{- $name := index . 1 -}}{{- $key := index . 2 -}}{{- $given := index . 3 -}}
{{- $installed := lookup "v1" "Secret" $ctx.Release.Namespace $name -}}
{{- if $given -}}
{{ $given | b64enc }}
{{- else if and $installed $installed.data (hasKey $installed.data $key) -}}
{{ index $installed.data $key }}
{{- else -}}
{{ randAlphaNum 32 | b64enc }}
{{- end -}}
{{- end }}

{{/*
A PodDisruptionBudget that keeps one replica of a replicated workload through voluntary disruptions (a node drain),
rendered only from two replicas on: with one, `minAvailable: 1` would block every drain of its node.
(list . "gpushare-binder" replicas)
*/}}
{{- define "gpushare.pdb" -}}
{{- $ctx := index . 0 -}}{{- $app := index . 1 -}}
{{- if ge (int (index . 2)) 2 }}
---
apiVersion: {{ include "gpushare.pdbApiVersion" $ctx }}
kind: PodDisruptionBudget
metadata:
  name: {{ $app }}
  namespace: {{ $ctx.Release.Namespace }}
  labels:
    {{- include "gpushare.labels" $ctx | nindent 4 }}
spec:
  minAvailable: 1
  selector:
    matchLabels:
      {{- include "gpushare.selector" (list $ctx $app) | nindent 6 }}
{{- end }}
{{- end }}

{{/*
The objects of one of k8s/'s files (files/ links to them: one copy of each rule), as the chart installs them: in the
release's namespace (the file's gpushare-system, wherever it is written: RoleBinding subjects, ServiceAccount names
in CEL, the webhook's Service), with the chart's labels. "gpushare.fileObjectList" gives them as a JSON list (for a
template that changes one), "gpushare.fileObjects" as YAML documents. (list . "files/rbac.yaml")
*/}}
{{- define "gpushare.fileObjectList" -}}
{{- $ctx := index . 0 -}}
{{- $text := $ctx.Files.Get (index . 1) | replace "gpushare-system" $ctx.Release.Namespace -}}
{{- $objects := list -}}
{{- range $doc := regexSplit "(?m)^---\\s*$" $text -1 }}
{{- $obj := fromYaml $doc }}
{{- if $obj }}
{{- $labels := include "gpushare.labels" $ctx | fromYaml }}
{{- $_ := set $obj.metadata "labels" (merge $labels ($obj.metadata.labels | default dict)) }}
{{- if has $obj.kind (list "ServiceAccount" "Role" "RoleBinding") }}
{{- $_ := set $obj.metadata "namespace" $ctx.Release.Namespace }}
{{- end }}
{{- $objects = append $objects $obj }}
{{- end }}
{{- end }}
{{- toJson $objects }}
{{- end }}

{{- define "gpushare.fileObjects" -}}
{{- range $obj := include "gpushare.fileObjectList" . | fromJsonArray }}
---
{{ toYaml $obj }}
{{- end }}
{{- end }}

{{/*
The webhook certificate of gpushare admission (dra.enabled), as JSON {crt, key, ca}, each base64 of the PEM: the
values given (dra.admission.tls), else the installed Secret gpushare-admission-tls's (read with `lookup`, so an
upgrade keeps them), else a new CA and a serving certificate it signs, for gpushare-extender.<namespace>.svc.
Worked out once per render and kept in .Values (the Secret, the webhook's caBundle and the extender's restart
checksum must agree); `helm template` and client-side dry runs cannot look up: they show a new one each time.
*/}}
{{- define "gpushare.admissionTls" -}}
{{- $admission := .Values.dra.admission -}}
{{- if not (hasKey $admission "_rendered") -}}
{{- $given := $admission.tls -}}
{{- $installed := lookup "v1" "Secret" .Release.Namespace "gpushare-admission-tls" -}}
{{- $tls := dict -}}
{{- if $given.certificate -}}
{{- $tls = dict "crt" ($given.certificate | b64enc) "key" ($given.key | b64enc) "ca" ($given.caBundle | b64enc) -}}
{{- else if and $installed $installed.data (hasKey $installed.data "tls.crt") (hasKey $installed.data "tls.key") (hasKey $installed.data "caBundle") -}}
{{- $tls = dict "crt" (index $installed.data "tls.crt") "key" (index $installed.data "tls.key") "ca" $installed.data.caBundle -}}
{{- else -}}
{{- $host := printf "gpushare-extender.%s.svc" .Release.Namespace -}}
{{- $days := int $admission.certificateDays -}}
{{- $ca := genCA "gpushare-admission-ca" $days -}}
{{- $cert := genSignedCert $host nil (list $host (printf "%s.cluster.local" $host)) $days $ca -}}
{{- $tls = dict "crt" ($cert.Cert | b64enc) "key" ($cert.Key | b64enc) "ca" ($ca.Cert | b64enc) -}}
{{- end -}}
{{- $_ := set $admission "_rendered" $tls -}}
{{- end -}}
{{- toJson (get $admission "_rendered") -}}
{{- end }}

{{/*
The single-machine install (singleMachine.enabled; values.yaml and docs/install.md say what it is for).
"gpushare.singleMachine.check" refuses what cannot share one machine's ports or needs a cluster network, naming the
value to change. "gpushare.listen" is a server's host:port there: (list . "accounting"). "gpushare.hostNetwork"
gives a pod spec the host network and the one node, "gpushare.apiServerEnv" the API server's address for
in-cluster clients (env list entries), "gpushare.deploymentStrategy" a Deployment's rollout.
*/}}
{{- define "gpushare.singleMachine.check" -}}
{{- $v := .Values -}}
{{- if $v.singleMachine.enabled -}}
{{- range $name := list "extender" "binder" "accounting" -}}
{{- if gt (int (index $v $name).replicas) 1 -}}
{{- fail (printf "singleMachine.enabled: every %s replica would listen on %s:%v; set %s.replicas=1" $name $v.singleMachine.address (index $v.singleMachine.ports $name) $name) -}}
{{- end -}}
{{- end -}}
{{- if ne (int $v.config.streamReplicas) 1 -}}
{{- fail "singleMachine.enabled runs one NATS server: set config.streamReplicas=1 (a stream cannot have more replicas than servers)" -}}
{{- end -}}
{{- if and $v.postgresql.enabled (ne $v.postgresql.mode "statefulset") -}}
{{- fail "singleMachine.enabled: the CloudNativePG cluster needs a cluster network; use postgresql.mode=statefulset, or postgresql.enabled=false with database.server" -}}
{{- end -}}
{{- if ne $v.scheduler.mode "default" -}}
{{- fail "singleMachine.enabled: the second scheduler reaches the extender through its Service; use scheduler.mode=default and point the cluster's kube-scheduler at the extender's address" -}}
{{- end -}}
{{- if $v.dra.enabled -}}
{{- fail "singleMachine.enabled: the DRA admission webhook is called through the extender's Service; leave dra.enabled=false" -}}
{{- end -}}
{{- if $v.extender.gpushareCompat.enabled -}}
{{- fail "singleMachine.enabled already runs the extender on the host network: leave extender.gpushareCompat.enabled=false" -}}
{{- end -}}
{{- if $v.extender.tls.enabled -}}
{{- fail "singleMachine.enabled serves the extender over HTTP on its address: leave extender.tls.enabled=false" -}}
{{- end -}}
{{- end -}}
{{- end }}

{{- define "gpushare.listen" -}}
{{- $ctx := index . 0 -}}
{{ $ctx.Values.singleMachine.address }}:{{ index $ctx.Values.singleMachine.ports (index . 1) }}
{{- end }}

{{- define "gpushare.hostNetwork" -}}
{{- if .Values.singleMachine.enabled -}}
# the single-machine install: on the host network, listening on {{ .Values.singleMachine.address }} only
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- with .Values.singleMachine.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
{{- end }}

{{- define "gpushare.apiServerEnv" -}}
{{- with .Values.singleMachine -}}
{{- if and .enabled .apiServer.host -}}
# the API server itself: the `kubernetes` Service's ClusterIP leads nowhere without kube-proxy
- name: KUBERNETES_SERVICE_HOST
  value: {{ .apiServer.host | quote }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ .apiServer.port | quote }}
{{- end -}}
{{- end -}}
{{- end }}

{{- define "gpushare.deploymentStrategy" -}}
{{- if .Values.singleMachine.enabled -}}
# one port on one machine: the old pod leaves before the new one starts
type: Recreate
{{- else -}}
type: RollingUpdate
rollingUpdate:
  maxUnavailable: 0
  maxSurge: 1
{{- end -}}
{{- end }}
