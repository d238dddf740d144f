{{/* Names, labels and the values several templates share. */}}

{{- define "lorafleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Resource name prefix: <release>-<chart>, or <release> when it already contains the chart name. */}}
{{- define "lorafleet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "lorafleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "lorafleet.labels" -}}
helm.sh/chart: {{ include "lorafleet.chart" . }}
app.kubernetes.io/name: {{ include "lorafleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component: include with (dict "ctx" $ "component" "router"). */}}
{{- define "lorafleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "lorafleet.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "lorafleet.componentLabels" -}}
{{ include "lorafleet.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "lorafleet.operator.fullname" -}}
{{- printf "%s-operator" (include "lorafleet.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "lorafleet.router.fullname" -}}
{{- printf "%s-router" (include "lorafleet.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "lorafleet.redis.fullname" -}}
{{- printf "%s-redis" (include "lorafleet.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "lorafleet.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (include "lorafleet.operator.fullname" .) .Values.operator.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "lorafleet.router.serviceAccountName" -}}
{{- if .Values.router.serviceAccount.create }}
{{- default (include "lorafleet.router.fullname" .) .Values.router.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.router.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "lorafleet.controlPlaneImage" -}}
{{- printf "%s:%s" .Values.image.controlPlane.repository (default .Chart.AppVersion .Values.image.controlPlane.tag) }}
{{- end }}

{{- define "lorafleet.workerImage" -}}
{{- printf "%s:%s" .Values.image.worker.repository (default .Chart.AppVersion .Values.image.worker.tag) }}
{{- end }}

{{/* Namespaces the operator watches (scope=namespace). */}}
{{- define "lorafleet.operator.namespaces" -}}
{{- $nss := .Values.operator.watchNamespaces | default (list .Release.Namespace) }}
{{- join "," (uniq $nss) }}
{{- end }}

{{/*
Namespaces with worker pods, comma-separated: the router discovers the workers there (a Role to
list pods in each) and a NetworkPolicy guards them. router.discoveryNamespaces, else the operator's
watched namespaces (scope=namespace) or the release namespace (scope=cluster).
*/}}
{{- define "lorafleet.worker.namespaces" -}}
{{- $nss := .Values.router.discoveryNamespaces }}
{{- if not $nss }}
{{- if eq .Values.operator.scope "namespace" }}
{{- $nss = splitList "," (include "lorafleet.operator.namespaces" .) }}
{{- else }}
{{- $nss = list .Release.Namespace }}
{{- end }}
{{- end }}
{{- join "," (uniq $nss) }}
{{- end }}

{{/* Redis password Secret name and key; empty name = no password (external Redis without auth). */}}
{{- define "lorafleet.redis.secretName" -}}
{{- if .Values.redis.auth.existingSecret }}
{{- .Values.redis.auth.existingSecret }}
{{- else if eq .Values.redis.mode "bundled" }}
{{- include "lorafleet.redis.fullname" . }}
{{- end }}
{{- end }}

{{/* Redis URL with `$(REDIS_PASSWORD)`, which Kubernetes expands from the env var defined before it. */}}
{{- define "lorafleet.redis.url" -}}
{{- $auth := ternary ":$(REDIS_PASSWORD)@" "" (ne (include "lorafleet.redis.secretName" .) "") }}
{{- if eq .Values.redis.mode "bundled" }}
{{- printf "redis://%s%s.%s.svc:6379/0" $auth (include "lorafleet.redis.fullname" .) .Release.Namespace }}
{{- else if eq .Values.redis.mode "external" }}
{{- $e := .Values.redis.external }}
{{- printf "%s://%s%s:%d/%d" (ternary "rediss" "redis" $e.tls) $auth $e.host (int $e.port) (int $e.db) }}
{{- end }}
{{- end }}

{{/* Env vars REDIS_PASSWORD and LORAFLEET_REDIS_URL (order matters: the URL refers to the password). */}}
{{- define "lorafleet.redis.env" -}}
{{- if ne .Values.redis.mode "none" }}
{{- $secret := include "lorafleet.redis.secretName" . }}
{{- if $secret }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ .Values.redis.auth.passwordKey }}
{{- end }}
- name: LORAFLEET_REDIS_URL
  value: {{ include "lorafleet.redis.url" . | quote }}
{{- end }}
{{- end }}

{{/* One admin-token Secret for every pool (router --admin-token-file); empty = none. */}}
{{- define "lorafleet.router.adminTokenSecret" -}}
{{- .Values.router.adminTokenSecret }}
{{- end }}

{{/* Pools whose `<pool>-admin-token` Secrets the router mounts (--admin-token-dir), comma-separated. */}}
{{- define "lorafleet.router.tokenPools" -}}
{{- $pools := .Values.router.adminTokenPools | default list }}
{{- if .Values.defaultPool.enabled }}
{{- $pools = prepend $pools .Values.defaultPool.name }}
{{- end }}
{{- join "," (uniq $pools) }}
{{- end }}

{{- define "lorafleet.tenantsSecret" -}}
{{- default (printf "%s-tenants" (include "lorafleet.fullname" .)) .Values.tenants.existingSecret }}
{{- end }}

{{/* Cross-value checks the JSON schema cannot express; each fails the render with a message. */}}
{{- define "lorafleet.validate" -}}
{{- if and (gt (int .Values.operator.replicas) 1) (not .Values.operator.peering.enabled) }}
{{- fail "operator.replicas > 1 needs operator.peering.enabled=true (several active operators would fight)" }}
{{- end }}
{{- if and (eq .Values.redis.mode "none") .Values.router.enabled (or (gt (int .Values.router.replicas) 1) .Values.router.autoscaling.enabled) }}
{{- fail "router.replicas > 1 (or autoscaling) needs redis.mode bundled or external: replicas share placement state through Redis" }}
{{- end }}
{{- if and (eq .Values.redis.mode "external") (not .Values.redis.external.host) }}
{{- fail "redis.mode=external needs redis.external.host" }}
{{- end }}
{{- if and .Values.router.autoscaling.enabled (gt (int .Values.router.autoscaling.minReplicas) (int .Values.router.autoscaling.maxReplicas)) }}
{{- fail "router.autoscaling.minReplicas must be <= maxReplicas" }}
{{- end }}
{{- if and .Values.defaultPool.enabled (gt (int .Values.defaultPool.engine.maxLoras) (int .Values.defaultPool.engine.maxCpuLoras)) }}
{{- fail "defaultPool.engine.maxLoras must be <= defaultPool.engine.maxCpuLoras" }}
{{- end }}
{{- if eq (int .Values.router.workerPort) (int .Values.router.workerAdminPort) }}
{{- fail "router.workerPort and router.workerAdminPort must differ (LoraPool spec.ports.http and spec.ports.admin)" }}
{{- end }}
{{- if and .Values.router.enabled .Values.router.ingress.enabled (not .Values.router.ingress.hosts) }}
{{- fail "router.ingress.enabled=true needs at least one router.ingress.hosts entry (an Ingress without rules is refused)" }}
{{- end }}
{{- $owners := dict }}
{{- range .Values.tenants.list }}
{{- $tenant := .name }}
{{- range .apiKeySha256 }}
{{- $hash := trimPrefix "sha256:" . }}
{{- if hasKey $owners $hash }}
{{- fail (printf "tenants.list: API key hash %s is listed twice (tenants %q and %q); the router refuses to start with it" $hash (get $owners $hash) $tenant) }}
{{- end }}
{{- $_ := set $owners $hash $tenant }}
{{- end }}
{{- end }}
{{- if and .Values.tenants.open (or .Values.tenants.list .Values.tenants.existingSecret) }}
{{- fail "tenants.open=true contradicts tenants.list / tenants.existingSecret: pick one" }}
{{- end }}
{{- end }}
