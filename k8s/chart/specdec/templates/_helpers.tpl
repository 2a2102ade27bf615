{{/* Names ------------------------------------------------------------------------------------- */}}
{{- define "specdec.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specdec.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "specdec.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "specdec.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "specdec.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}{{ default (include "specdec.fullname" .) .Values.serviceAccount.name }}{{ else }}{{ default "default" .Values.serviceAccount.name }}{{ end }}
{{- end }}

{{/* The model pools: one Deployment (+ headless Service, PDB, HPA) per entry. */}}
{{- define "specdec.modelGroups" -}}
- {kind: target, pool: baseline}
- {kind: target, pool: speculative}
{{- if not (has .Values.models.draftProposer (list "local-ngram" "target-ngram" "target-model")) }}{{/* drafts in the coordinator or the target */}}
- {kind: draft, pool: speculative}
{{- end }}
{{- end }}

{{/* Labels; call with (dict "root" $ "component" "target" "pool" "speculative") ------------------ */}}
{{- define "specdec.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specdec.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- if .pool }}
specdec.io/pool: {{ .pool }}
{{- end }}
{{- end }}

{{- define "specdec.labels" -}}
{{ include "specdec.selectorLabels" . }}
app.kubernetes.io/part-of: specdec
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end }}

{{/* Image of a component: its own full reference, else <registry>/specdec-<component>:<tag>. */}}
{{- define "specdec.image" -}}
{{- $values := index .root.Values .component -}}
{{- if $values.image -}}
{{ $values.image }}
{{- else -}}
{{- $registry := .root.Values.image.registry -}}
{{- $tag := default .root.Chart.AppVersion .root.Values.image.tag -}}
{{ if $registry }}{{ trimSuffix "/" $registry }}/{{ end }}specdec-{{ .component }}:{{ $tag }}
{{- end }}
{{- end }}

{{/* The port probes and the registrar check: the plaintext health port under TLS, else the main one. */}}
{{- define "specdec.healthPort" -}}
{{- $ports := (index .root.Values .component).ports -}}
{{- if .root.Values.tls.enabled }}{{ $ports.health }}{{ else }}{{ $ports.grpc }}{{ end }}
{{- end }}

{{- define "specdec.serverName" -}}
{{- default (printf "%s-models.%s.svc" (include "specdec.fullname" .) .Release.Namespace) .Values.tls.serverName }}
{{- end }}

{{/* Native gRPC probes on the health port; startup covers model download and loading. */}}
{{- define "specdec.probes" -}}
{{- $values := index .root.Values .component -}}
{{- $port := include "specdec.healthPort" . | int -}}
startupProbe:
  grpc: {port: {{ $port }}}
  periodSeconds: {{ $values.startupProbe.periodSeconds }}
  failureThreshold: {{ $values.startupProbe.failureThreshold }}
  timeoutSeconds: 5
readinessProbe:
  grpc: {port: {{ $port }}}
  periodSeconds: 5
  failureThreshold: 2
  timeoutSeconds: 3
livenessProbe:
  grpc: {port: {{ $port }}}
  periodSeconds: 15
  failureThreshold: 4
  timeoutSeconds: 5
{{- end }}

{{/* Server flags shared by the three services (non-secret; secrets come from mounted files). */}}
{{- define "specdec.serverArgs" -}}
{{- $values := index .root.Values .component -}}
- --host=0.0.0.0
- --port={{ $values.ports.grpc }}
- --metrics-port={{ $values.ports.metrics }}
- --drain-period={{ $values.drainSeconds }}
- --grace-period={{ $values.graceSeconds }}
- --trace-sampling-ratio={{ .root.Values.otel.samplingRatio }}
- --trace-cycle-every={{ .root.Values.otel.cycleSpanEvery }}
{{- if .root.Values.tls.enabled }}
- --health-port={{ $values.ports.health }}
{{- else }}
- --plaintext
{{- end }}
{{- end }}

{{/* Redis URL as environment (SPECDEC_REDIS_URL): the password comes from a Secret. */}}
{{- define "specdec.redisEnv" -}}
{{- if .Values.redis.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ .Values.redis.auth.existingSecret }}, key: {{ .Values.redis.auth.passwordKey }}}
- name: SPECDEC_REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s-redis.%s.svc:6379/0" (include "specdec.fullname" .) .Release.Namespace | quote }}
{{- else }}
{{- if not .Values.redis.external.urlSecret }}
{{- fail "redis.enabled=false needs redis.external.urlSecret (a Secret holding the Redis URL)" }}
{{- end }}
- name: SPECDEC_REDIS_URL
  valueFrom:
    secretKeyRef: {name: {{ .Values.redis.external.urlSecret }}, key: {{ .Values.redis.external.urlKey }}}
{{- end }}
{{- end }}

{{- define "specdec.otelEnv" -}}
- name: OTEL_SERVICE_NAME
  value: specdec-{{ .component }}
{{- if .root.Values.otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .root.Values.otel.endpoint | quote }}
{{- else }}
- name: OTEL_TRACES_EXPORTER
  value: none
{{- end }}
{{- with .root.Values.otel.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Volumes every pod has: writable /tmp, the models volume, TLS and token secrets. */}}
{{- define "specdec.volumes" -}}
{{- $v := .root.Values -}}
- name: tmp
  emptyDir: {}
- name: models
{{- if eq $v.models.volume.type "persistentVolumeClaim" }}
  persistentVolumeClaim: {claimName: {{ required "models.volume.claimName is required" $v.models.volume.claimName }}, readOnly: {{ $v.models.volume.readOnly }}}
{{- else if eq $v.models.volume.type "hostPath" }}
  hostPath: {path: {{ required "models.volume.hostPath is required" $v.models.volume.hostPath }}, type: Directory}
{{- else }}
  emptyDir: {sizeLimit: {{ $v.models.volume.sizeLimit }}}
{{- end }}
{{- if $v.tls.enabled }}
- name: tls
  secret: {secretName: {{ $v.tls.secretName }}}
{{- if and (eq .component "coordinator") $v.tls.mutual }}
- name: tls-client
  secret: {secretName: {{ default $v.tls.secretName $v.tls.clientSecretName }}}
{{- end }}
{{- if eq .component "coordinator" }}
- name: tls-public
  secret: {secretName: {{ default $v.tls.secretName $v.tls.coordinatorSecretName }}}
{{- end }}
{{- end }}
{{- if $v.auth.internalTokenSecret }}
- name: internal-auth
  secret: {secretName: {{ $v.auth.internalTokenSecret }}}
{{- end }}
{{- if and (eq .component "coordinator") $v.auth.coordinatorTokensSecret }}
- name: auth
  secret: {secretName: {{ $v.auth.coordinatorTokensSecret }}}
{{- end }}
{{- if and (not $v.redis.enabled) $v.redis.external.caSecret }}
- name: redis-ca
  secret: {secretName: {{ $v.redis.external.caSecret }}}
{{- end }}
{{- end }}

{{- define "specdec.volumeMounts" -}}
{{- $v := .root.Values -}}
- {name: tmp, mountPath: /tmp}
- {name: models, mountPath: {{ $v.models.mountPath }}, readOnly: {{ $v.models.volume.readOnly }}}
{{- if $v.tls.enabled }}
- {name: tls, mountPath: /etc/specdec/tls, readOnly: true}
{{- if and (eq .component "coordinator") $v.tls.mutual }}
- {name: tls-client, mountPath: /etc/specdec/tls-client, readOnly: true}
{{- end }}
{{- if eq .component "coordinator" }}
- {name: tls-public, mountPath: /etc/specdec/tls-public, readOnly: true}
{{- end }}
{{- end }}
{{- if $v.auth.internalTokenSecret }}
- {name: internal-auth, mountPath: /etc/specdec/internal-auth, readOnly: true}
{{- end }}
{{- if and (eq .component "coordinator") $v.auth.coordinatorTokensSecret }}
- {name: auth, mountPath: /etc/specdec/auth, readOnly: true}
{{- end }}
{{- if and (not $v.redis.enabled) $v.redis.external.caSecret }}
- {name: redis-ca, mountPath: /etc/specdec/redis-ca, readOnly: true}
{{- end }}
{{- end }}

{{/* Affinity of a model pod: away from the other kind (draft vs target), spread within its group. */}}
{{- define "specdec.modelAffinity" -}}
{{- $a := .root.Values.affinity -}}
{{- $other := ternary "draft" "target" (eq .component "target") -}}
{{- $away := dict "labelSelector" (dict "matchLabels" (dict "app.kubernetes.io/instance" .root.Release.Name "app.kubernetes.io/component" $other)) "topologyKey" "kubernetes.io/hostname" -}}
{{- $spread := dict "labelSelector" (dict "matchLabels" (fromYaml (include "specdec.selectorLabels" .))) "topologyKey" "kubernetes.io/hostname" -}}
{{- $required := list -}}
{{- $preferred := list -}}
{{- if eq $a.draftTarget "required" }}
{{- $required = append $required $away -}}
{{- else if eq $a.draftTarget "preferred" }}
{{- $preferred = append $preferred (dict "weight" (int $a.preferredWeight) "podAffinityTerm" $away) -}}
{{- else if ne $a.draftTarget "none" }}
{{- fail (printf "affinity.draftTarget must be required, preferred or none, got %q" $a.draftTarget) }}
{{- end }}
{{- if $a.spreadReplicas }}
{{- $preferred = append $preferred (dict "weight" 50 "podAffinityTerm" $spread) -}}
{{- end }}
{{- if or $required $preferred }}
podAntiAffinity:
{{- with $required }}
  requiredDuringSchedulingIgnoredDuringExecution:
{{ toYaml . | indent 4 }}
{{- end }}
{{- with $preferred }}
  preferredDuringSchedulingIgnoredDuringExecution:
{{ toYaml . | indent 4 }}
{{- end }}
{{- end }}
{{- end }}

{{- define "specdec.preStop" -}}
{{- if gt (int .preStopSleepSeconds) 0 }}
lifecycle:
  preStop:
    exec:
      command: ["sleep", "{{ .preStopSleepSeconds }}"]
{{- end }}
{{- end }}

{{- define "specdec.checks" -}}
{{- if not (has .Values.trafficSplit.owner (list "coordinator" "mesh")) }}
{{- fail (printf "trafficSplit.owner must be coordinator or mesh, got %q" .Values.trafficSplit.owner) }}
{{- end }}
{{- if and (not .Values.tls.enabled) (or .Values.auth.coordinatorTokensSecret .Values.auth.internalTokenSecret) }}
{{- fail "bearer tokens need TLS (tls.enabled=true): over plaintext they would travel in the clear" }}
{{- end }}
{{- if and .Values.tls.mutual (not .Values.tls.enabled) }}
{{- fail "tls.mutual needs tls.enabled" }}
{{- end }}
{{- end }}

{{/* HPA metrics as given, refusing CPU/memory: a GPU-bound service's load is in its serving metrics. */}}
{{- define "specdec.hpaMetrics" -}}
{{- range . }}
{{- if has .type (list "Resource" "ContainerResource") }}
{{- fail "autoscaling on CPU or memory is refused: the load of a GPU-bound service shows in its serving metrics (KV cache use, sessions, active requests); use Pods or External metrics through a metrics adapter" }}
{{- end }}
{{- end }}
{{- toYaml . }}
{{- end }}
