{{/*
A gpushare service's Deployment (binder, accounting): its own ServiceAccount, PostgreSQL role and NATS user, the
shared settings, /readyz and /healthz on its HTTP port. (dict "ctx" . "name" "binder" "port" 8081
"values" .Values.binder "extraEnv" list-of-env-maps)
*/}}
{{- define "gpushare.serviceDeployment" -}}
{{- $ctx := .ctx -}}
{{- $app := printf "gpushare-%s" .name -}}
{{- $single := $ctx.Values.singleMachine.enabled -}}
{{- $port := ternary (index $ctx.Values.singleMachine.ports .name) .port $single -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $app }}
  namespace: {{ $ctx.Release.Namespace }}
  labels:
    {{- include "gpushare.componentLabels" (list $ctx $app) | nindent 4 }}
spec:
  replicas: {{ .values.replicas }}
  strategy:
    {{- include "gpushare.deploymentStrategy" $ctx | nindent 4 }}
  selector:
    matchLabels:
      {{- include "gpushare.selector" (list $ctx $app) | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "gpushare.selector" (list $ctx $app) | nindent 8 }}
    spec:
      serviceAccountName: {{ $app }}
      {{- with include "gpushare.hostNetwork" $ctx }}{{ . | nindent 6 }}{{ end }}
      {{- include "gpushare.imagePullSecrets" $ctx | nindent 6 }}
      securityContext:
        runAsNonRoot: true
        runAsUser: 10001
        runAsGroup: 10001
        seccompProfile:
          type: RuntimeDefault
      affinity:
        podAntiAffinity:
          preferredDuringSchedulingIgnoredDuringExecution:
            - weight: 100
              podAffinityTerm:
                topologyKey: kubernetes.io/hostname
                labelSelector:
                  matchLabels:
                    {{- include "gpushare.selector" (list $ctx $app) | nindent 20 }}
      containers:
        - name: {{ .name }}
          image: {{ include "gpushare.image" $ctx }}
          {{- with $ctx.Values.image.pullPolicy }}
          imagePullPolicy: {{ . }}
          {{- end }}
          {{- if $single }}
          args: [{{ .name | quote }}, "--host", {{ $ctx.Values.singleMachine.address | quote }}, "--port", {{ $port | quote }}]
          {{- else }}
          args: [{{ .name | quote }}, "--port", {{ .port | quote }}]
          {{- end }}
          envFrom:
            - configMapRef:
                name: gpushare-config
          env:
            # its own PostgreSQL role and NATS user: least privilege (docs/security.md)
            - name: GPUSHARE_DATABASE_URL
              value: postgresql://gpushare_{{ .name }}@$(GPUSHARE_DATABASE_SERVER)
            - name: GPUSHARE_DATABASE_PASSWORD
              valueFrom:
                secretKeyRef:
                  name: gpushare-database
                  key: {{ .name }}-password
            - name: GPUSHARE_NATS_USER
              value: {{ $app }}
            - name: GPUSHARE_NATS_PASSWORD
              valueFrom:
                secretKeyRef:
                  name: gpushare-nats
                  key: {{ .name }}-password
            {{- with .extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
            {{- with include "gpushare.apiServerEnv" $ctx }}{{ . | nindent 12 }}{{ end }}
          ports:
            - name: http
              containerPort: {{ $port }}
          readinessProbe:
            httpGet:
              path: /readyz
              port: http
            periodSeconds: 5
          startupProbe:  # a slow start (a loaded node) is not a hung process: liveness counts once it answers
            httpGet:
              path: /healthz
              port: http
            periodSeconds: 2
            failureThreshold: 90
          livenessProbe:
            httpGet:
              path: /healthz
              port: http
            periodSeconds: 10
            failureThreshold: 3
          resources:
            {{- toYaml .values.resources | nindent 12 }}
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities:
              drop: ["ALL"]
          volumeMounts:
            - name: tmp
              mountPath: /tmp
      volumes:
        - name: tmp
          emptyDir: {}
{{- end }}
