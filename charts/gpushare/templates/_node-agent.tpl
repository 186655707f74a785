{{/*
A node agent's metrics Service and DaemonSet: the device-plugin agent (gpushare-node-agent) and the DRA plugin
(gpushare-node-agent-dra, dra.enabled) differ only in their name, arguments, host paths and nodes; the rest (account,
credentials, probes, hardening, nodeAgent's tolerations, resources and runtimeClassName) is one. Root (the kubelet's
socket directories are root's), hostPID (maps GPU processes to pods through /proc/<pid>/cgroup), but no
capabilities, no privilege escalation, a read-only root filesystem and the runtime's seccomp profile.
(dict "ctx" . "name" "gpushare-node-agent" "args" list "hostPaths" list-of-{name,path,type,readOnly,comment}
"nodeSelector" map "affinity" map)
*/}}
{{- define "gpushare.nodeAgent" -}}
{{- $ctx := .ctx -}}
{{- $app := .name -}}
{{- $single := $ctx.Values.singleMachine.enabled -}}
{{- $port := ternary $ctx.Values.singleMachine.ports.nodeAgent 9119 $single -}}
{{- $nodeSelector := .nodeSelector | default dict -}}
{{- if $single }}{{ $nodeSelector = merge (dict) $ctx.Values.singleMachine.nodeSelector $nodeSelector }}{{ end -}}
{{- if not $single }}
apiVersion: v1
kind: Service
metadata:
  name: {{ $app }}
  namespace: {{ $ctx.Release.Namespace }}
  labels:
    {{- include "gpushare.componentLabels" (list $ctx $app) | nindent 4 }}
    gpushare.io/metrics: "true"
spec:
  clusterIP: None
  selector:
    {{- include "gpushare.selector" (list $ctx $app) | nindent 4 }}
  ports:
    - name: metrics
      port: 9119
      targetPort: metrics
      protocol: TCP
---
{{- end }}
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: {{ $app }}
  namespace: {{ $ctx.Release.Namespace }}
  labels:
    {{- include "gpushare.componentLabels" (list $ctx $app) | nindent 4 }}
spec:
  selector:
    matchLabels:
      {{- include "gpushare.selector" (list $ctx $app) | nindent 6 }}
  updateStrategy:
    type: RollingUpdate
    rollingUpdate:
      maxUnavailable: 1
  template:
    metadata:
      labels:
        {{- include "gpushare.selector" (list $ctx $app) | nindent 8 }}
    spec:
      serviceAccountName: gpushare-node-agent
      priorityClassName: system-node-critical
      hostPID: true
      {{- if $single }}
      # the single-machine install: on the host network, /metrics on {{ $ctx.Values.singleMachine.address }} only
      hostNetwork: true
      dnsPolicy: ClusterFirstWithHostNet
      {{- end }}
      {{- include "gpushare.imagePullSecrets" $ctx | nindent 6 }}
      securityContext:
        seccompProfile:
          type: RuntimeDefault  # NVML needs only ioctl/mmap on /dev/nvidia*, which the runtime's profile allows
      {{- with $nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $ctx.Values.nodeAgent.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $ctx.Values.nodeAgent.runtimeClassName }}
      runtimeClassName: {{ . }}
      {{- end }}
      containers:
        - name: node-agent
          image: {{ include "gpushare.image" $ctx }}
          {{- with $ctx.Values.image.pullPolicy }}
          imagePullPolicy: {{ . }}
          {{- end }}
          args:
            {{- toYaml .args | nindent 12 }}
          envFrom:
            - configMapRef:
                name: gpushare-config
          env:
            - name: NODE_NAME
              valueFrom:
                fieldRef:
                  fieldPath: spec.nodeName
            - name: NODE_IP
              valueFrom:
                fieldRef:
                  fieldPath: status.hostIP
            # No database URL and no database credential: the agent reaches the ledger over NATS only (the binder's
            # gateway answers), as its own NATS user; gpushare-node-agent is the only Secret a GPU node sees.
            - name: GPUSHARE_NATS_USER
              value: gpushare-node-agent
            - name: GPUSHARE_NATS_PASSWORD
              valueFrom:
                secretKeyRef:
                  name: gpushare-node-agent
                  key: nats-password
            # The NVIDIA container runtime mounts the driver and every GPU for NVML (utility = nvidia-smi/NVML).
            - name: NVIDIA_VISIBLE_DEVICES
              value: all
            - name: NVIDIA_DRIVER_CAPABILITIES
              value: utility
            - name: HOME
              value: /tmp
            {{- with include "gpushare.apiServerEnv" $ctx }}{{ . | nindent 12 }}{{ end }}
          ports:
            - name: metrics
              containerPort: {{ $port }}
          readinessProbe:
            httpGet:
              path: /readyz
              port: metrics
            periodSeconds: 10
          startupProbe:  # a slow start (a loaded node) is not a hung process: liveness counts once it answers
            httpGet:
              path: /healthz
              port: metrics
            periodSeconds: 2
            failureThreshold: 90
          livenessProbe:
            httpGet:
              path: /healthz
              port: metrics
            periodSeconds: 15
            failureThreshold: 4
          resources:
            {{- toYaml $ctx.Values.nodeAgent.resources | nindent 12 }}
          securityContext:
            runAsUser: 0
            runAsGroup: 0
            privileged: false
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities:
              drop: ["ALL"]
          volumeMounts:
            {{- range $m := .hostPaths }}
            - name: {{ $m.name }}
              mountPath: {{ $m.path }}
              {{- if $m.readOnly }}
              readOnly: true
              {{- end }}
            {{- end }}
            - name: tmp
              mountPath: /tmp
      volumes:
        {{- range $m := .hostPaths }}
        {{- if $m.comment }}
        # {{ $m.comment }}
        {{- end }}
        - name: {{ $m.name }}
          hostPath:
            path: {{ $m.path }}
            type: {{ $m.type }}
        {{- end }}
        - name: tmp
          emptyDir: {}
{{- end }}
