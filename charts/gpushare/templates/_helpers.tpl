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

{{/* host:port/database of the ledger. */}}
{{- define "gpushare.databaseServer" -}}
{{- if .Values.database.server -}}
{{ .Values.database.server }}
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
