{{/*
Names, labels and the pieces every pod shares. Component templates (dataplane/, controlplane/,
serve/, tests/) call "nm-gateway.podSpec" with their own values, so hardening, probes' rules and
the `extra*` hooks are written once.
*/}}

{{/* Chart name, overridable. */}}
{{- define "nm-gateway.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-<chart>, or the release name alone when it already contains the chart name. */}}
{{- define "nm-gateway.fullname" -}}
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

{{/* "<fullname>-<suffix>", kept within 63 characters. Call with (list $ "suffix"). */}}
{{- define "nm-gateway.componentName" -}}
{{- $ctx := index . 0 }}
{{- $suffix := index . 1 }}
{{- printf "%s-%s" (include "nm-gateway.fullname" $ctx | trunc (int (sub 62 (len $suffix)))) $suffix | trimSuffix "-" }}
{{- end }}

{{- define "nm-gateway.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every resource. */}}
{{- define "nm-gateway.labels" -}}
helm.sh/chart: {{ include "nm-gateway.chart" . }}
app.kubernetes.io/name: {{ include "nm-gateway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: nm-gateway
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of the release (no component). */}}
{{- define "nm-gateway.selectorLabels" -}}
app.kubernetes.io/name: {{ include "nm-gateway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of a component's resources. Call with (list $ "dataplane"). */}}
{{- define "nm-gateway.componentLabels" -}}
{{ include "nm-gateway.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* Selector labels of a component. Call with (list $ "dataplane"). */}}
{{- define "nm-gateway.componentSelectorLabels" -}}
{{ include "nm-gateway.selectorLabels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* The component behind the HTTP Service: the dataplane, or the serve pod. */}}
{{- define "nm-gateway.httpComponent" -}}
{{- if eq .Values.mode "serve" }}serve{{ else }}dataplane{{ end }}
{{- end }}

{{- define "nm-gateway.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "nm-gateway.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "nm-gateway.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* ===== Database ===== */}}

{{/* "true" when the database is SQLite on a volume of the pod that runs the controlplane. */}}
{{- define "nm-gateway.sqlite" -}}
{{- if not (or .Values.database.url .Values.database.existingSecret) }}true{{ end }}
{{- end }}

{{- define "nm-gateway.dataDir" -}}/var/lib/nm-gateway/data{{- end }}
{{- define "nm-gateway.spoolDir" -}}/var/lib/nm-gateway/spool{{- end }}
{{- define "nm-gateway.configDir" -}}/etc/nm-gateway/config{{- end }}
{{- define "nm-gateway.tlsDir" -}}/etc/nm-gateway/tls{{- end }}

{{- define "nm-gateway.sqliteClaimName" -}}
{{- default (include "nm-gateway.componentName" (list . "data")) .Values.database.sqlite.persistence.existingClaim }}
{{- end }}

{{/* Secret and key holding NM_DATABASE_URL. */}}
{{- define "nm-gateway.databaseSecretName" -}}
{{- default (include "nm-gateway.componentName" (list . "database")) .Values.database.existingSecret }}
{{- end }}
{{- define "nm-gateway.databaseSecretKey" -}}
{{- if .Values.database.existingSecret }}{{ .Values.database.existingSecretKey }}{{ else }}database-url{{ end }}
{{- end }}

{{- define "nm-gateway.linkSecretName" -}}
{{- default (include "nm-gateway.componentName" (list . "link")) .Values.linkSecret.existingSecret }}
{{- end }}
{{- define "nm-gateway.linkSecretKey" -}}
{{- if .Values.linkSecret.existingSecret }}{{ .Values.linkSecret.existingSecretKey }}{{ else }}link-secret{{ end }}
{{- end }}

{{- define "nm-gateway.bootstrapSecretName" -}}
{{- default (include "nm-gateway.componentName" (list . "bootstrap")) .Values.bootstrapKey.existingSecret }}
{{- end }}
{{- define "nm-gateway.bootstrapSecretKey" -}}
{{- if .Values.bootstrapKey.existingSecret }}{{ .Values.bootstrapKey.existingSecretKey }}{{ else }}bootstrap-key{{ end }}
{{- end }}

{{/*
A generated secret value, kept across upgrades: the value already in the cluster's Secret when
there is one (`lookup`), else a fresh one. Call with (list $ "secret-name" "key" "prefix" length).
Returns the base64 text for `data:`.
*/}}
{{- define "nm-gateway.generatedSecretValue" -}}
{{- $ctx := index . 0 }}
{{- $existing := lookup "v1" "Secret" $ctx.Release.Namespace (index . 1) }}
{{- if and $existing $existing.data (hasKey $existing.data (index . 2)) }}
{{- index $existing.data (index . 2) }}
{{- else }}
{{- printf "%s%s" (index . 3) (randAlphaNum (int (index . 4))) | b64enc }}
{{- end }}
{{- end }}

{{/* ===== Controlplane link and TLS ===== */}}

{{- define "nm-gateway.controlplaneHost" -}}
{{- printf "%s.%s.svc" (include "nm-gateway.componentName" (list . "controlplane")) .Release.Namespace }}
{{- end }}

{{- define "nm-gateway.controlplaneUrl" -}}
{{- printf "%s://%s:%d" (ternary "https" "http" .Values.tls.enabled) (include "nm-gateway.controlplaneHost" .) (int .Values.controlplane.service.port) }}
{{- end }}

{{- define "nm-gateway.tlsSecretName" -}}
{{- default (include "nm-gateway.componentName" (list . "controlplane-tls")) .Values.tls.secretName }}
{{- end }}
{{- define "nm-gateway.tlsCaSecretName" -}}
{{- default (include "nm-gateway.tlsSecretName" .) .Values.tls.caSecretName }}
{{- end }}
{{- define "nm-gateway.tlsClientSecretName" -}}
{{- default (include "nm-gateway.componentName" (list . "dataplane-tls")) .Values.tls.clientAuth.secretName }}
{{- end }}

{{/*
Env and volumes of a link client (dataplane, test pod): trust the controlplane's CA (only
`ca.crt` is mounted, never the server's key) and, with mTLS, present the client certificate.
*/}}
{{- define "nm-gateway.linkClientTlsEnv" -}}
{{- if .Values.tls.enabled }}
- name: NM_CONTROLPLANE_CA
  value: {{ include "nm-gateway.tlsDir" . }}/ca/ca.crt
{{- if .Values.tls.clientAuth.enabled }}
- name: NM_CONTROLPLANE_CLIENT_CERT
  value: {{ include "nm-gateway.tlsDir" . }}/client/tls.crt
- name: NM_CONTROLPLANE_CLIENT_KEY
  value: {{ include "nm-gateway.tlsDir" . }}/client/tls.key
{{- end }}
{{- end }}
{{- end }}

{{- define "nm-gateway.linkClientTlsVolumes" -}}
{{- if .Values.tls.enabled }}
- name: tls-ca
  secret:
    secretName: {{ include "nm-gateway.tlsCaSecretName" . }}
    defaultMode: 0440
    items:
      - key: ca.crt
        path: ca.crt
{{- if .Values.tls.clientAuth.enabled }}
- name: tls-client
  secret:
    secretName: {{ include "nm-gateway.tlsClientSecretName" . }}
    defaultMode: 0440
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
{{- end }}
{{- end }}
{{- end }}

{{- define "nm-gateway.linkClientTlsMounts" -}}
{{- if .Values.tls.enabled }}
- name: tls-ca
  mountPath: {{ include "nm-gateway.tlsDir" . }}/ca
  readOnly: true
{{- if .Values.tls.clientAuth.enabled }}
- name: tls-client
  mountPath: {{ include "nm-gateway.tlsDir" . }}/client
  readOnly: true
{{- end }}
{{- end }}
{{- end }}

{{/* ===== Environment ===== */}}

{{/* Downward-API variables the OTel resource attributes refer to; first in the list (with OTel on). */}}
{{- define "nm-gateway.downwardEnv" -}}
- name: K8S_POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: K8S_NAMESPACE_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: K8S_NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: K8S_POD_UID
  valueFrom:
    fieldRef:
      fieldPath: metadata.uid
{{- end }}

{{/*
OTEL_* for one component. Call with (list $ "nm-dataplane" "dataplane"). Nothing at all without
an endpoint, so tracing stays off exactly as without the chart.
*/}}
{{- define "nm-gateway.otelEnv" -}}
{{- $ctx := index . 0 }}
{{- $o := $ctx.Values.otel }}
{{- if $o.endpoint }}
{{- $attrs := list "k8s.pod.name=$(K8S_POD_NAME)" "k8s.namespace.name=$(K8S_NAMESPACE_NAME)" "k8s.node.name=$(K8S_NODE_NAME)" "k8s.pod.uid=$(K8S_POD_UID)" "service.instance.id=$(K8S_POD_UID)" (printf "service.version=%s" $ctx.Chart.AppVersion) (printf "app.kubernetes.io/component=%s" (index . 2)) (printf "app.kubernetes.io/instance=%s" $ctx.Release.Name) }}
{{- range $k, $v := $o.resourceAttributes }}
{{- $attrs = append $attrs (printf "%s=%s" $k (toString $v)) }}
{{- end }}
- name: OTEL_SERVICE_NAME
  value: {{ index . 1 | quote }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $o.endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ $o.protocol | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ $o.sampler | quote }}
{{- if $o.samplerArg }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $o.samplerArg | quote }}
{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $attrs | quote }}
{{- if $o.headers.existingSecret }}
- name: OTEL_EXPORTER_OTLP_HEADERS
  valueFrom:
    secretKeyRef:
      name: {{ $o.headers.existingSecret }}
      key: {{ $o.headers.existingSecretKey }}
{{- end }}
{{- end }}
{{- end }}

{{/* NM_PROVIDER_KEY_<PROVIDER>, each from a Secret. */}}
{{- define "nm-gateway.providerKeyEnv" -}}
{{- $ctx := . }}
{{- range $name := keys .Values.providers.apiKeys | sortAlpha }}
- name: NM_PROVIDER_KEY_{{ upper $name }}
  valueFrom:
    secretKeyRef:
      name: {{ include "nm-gateway.componentName" (list $ctx "providers") }}
      key: {{ $name }}
{{- end }}
{{- range $name := keys .Values.providers.existingSecretKeys | sortAlpha }}
- name: NM_PROVIDER_KEY_{{ upper $name }}
  valueFrom:
    secretKeyRef:
      name: {{ $ctx.Values.providers.existingSecret }}
      key: {{ index $ctx.Values.providers.existingSecretKeys $name }}
{{- end }}
{{- end }}

{{- define "nm-gateway.secretEnv" -}}
- name: {{ index . 0 }}
  valueFrom:
    secretKeyRef:
      name: {{ index . 1 }}
      key: {{ index . 2 }}
{{- end }}

{{/* ===== Checksums: a change rolls the pods ===== */}}

{{/*
checksum/config over the rendered ConfigMaps; checksum/secret over the secret values given in
values (generated ones never change once made, and your own Secrets are yours to roll).
*/}}
{{- define "nm-gateway.checksumAnnotations" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
checksum/secret: {{ list .Values.database.url .Values.providers.apiKeys | toJson | sha256sum }}
{{- end }}

{{/* ===== Pods ===== */}}

{{/* Grace period: longer than the gateway's own drain. Call with (list $ componentValues preStop). */}}
{{- define "nm-gateway.terminationGrace" -}}
{{- $ctx := index . 0 }}
{{- $c := index . 1 }}
{{- if $c.terminationGracePeriodSeconds }}
{{- $c.terminationGracePeriodSeconds }}
{{- else }}
{{- add (index . 2) $ctx.Values.config.shutdownGraceSecs 15 }}
{{- end }}
{{- end }}

{{/*
The pod spec every workload shares. Call with a dict:
  ctx: the root context, component: name, values: the component's values,
  containers: the container list (YAML text), volumes: chart volumes (YAML text),
  grace: termination grace seconds (0 for none), restartPolicy: optional.
*/}}
{{- define "nm-gateway.podSpec" -}}
{{- $ctx := .ctx }}
{{- $v := .values }}
serviceAccountName: {{ include "nm-gateway.serviceAccountName" $ctx }}
automountServiceAccountToken: false
enableServiceLinks: false
{{- with $ctx.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $ctx.Values.podSecurityContext | nindent 2 }}
{{- if .restartPolicy }}
restartPolicy: {{ .restartPolicy }}
{{- end }}
{{- if .grace }}
terminationGracePeriodSeconds: {{ .grace }}
{{- end }}
{{- with $v.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $v.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .topologySpread }}
topologySpreadConstraints:
  {{- . | trim | nindent 2 }}
{{- end }}
containers:
  {{- .containers | trim | nindent 2 }}
volumes:
  - name: tmp
    emptyDir:
      sizeLimit: 64Mi
  {{- with .volumes }}
  {{- . | trim | nindent 2 }}
  {{- end }}
  {{- if $ctx.Values.configFile }}
  - name: config-file
    configMap:
      name: {{ include "nm-gateway.componentName" (list $ctx "file") }}
      defaultMode: 0444
  {{- end }}
  {{- with $v.extraVolumes }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}

{{/* Volume mounts every gateway container has. Call with (list $ componentValues). */}}
{{- define "nm-gateway.commonMounts" -}}
{{- $ctx := index . 0 }}
- name: tmp
  mountPath: /tmp
{{- if $ctx.Values.configFile }}
- name: config-file
  mountPath: {{ include "nm-gateway.configDir" $ctx }}
  readOnly: true
{{- end }}
{{- with (index . 1).extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* args after the subcommand: the config file, when there is one. */}}
{{- define "nm-gateway.configArgs" -}}
{{- if .Values.configFile }}
- --config
- {{ include "nm-gateway.configDir" . }}/config.toml
{{- end }}
{{- end }}

{{/* envFrom every gateway container has. Call with (list $ componentValues). */}}
{{- define "nm-gateway.envFrom" -}}
- configMapRef:
    name: {{ include "nm-gateway.componentName" (list (index . 0) "config") }}
{{- with (index . 1).extraEnvFrom }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* HTTP probes of a dataplane-like container (dataplane, serve). */}}
{{- define "nm-gateway.httpProbes" -}}
{{- $p := .Values.dataplane }}
startupProbe:
  httpGet:
    path: /health/live
    port: http
  periodSeconds: {{ $p.startupProbe.periodSeconds }}
  timeoutSeconds: {{ $p.startupProbe.timeoutSeconds }}
  failureThreshold: {{ $p.startupProbe.failureThreshold }}
readinessProbe:
  httpGet:
    path: /health
    port: http
  periodSeconds: {{ $p.readinessProbe.periodSeconds }}
  timeoutSeconds: {{ $p.readinessProbe.timeoutSeconds }}
  failureThreshold: {{ $p.readinessProbe.failureThreshold }}
  successThreshold: {{ $p.readinessProbe.successThreshold }}
livenessProbe:
  {{- if eq $p.livenessProbe.type "tcpSocket" }}
  tcpSocket:
    port: http
  {{- else }}
  httpGet:
    path: /health/live
    port: http
  {{- end }}
  periodSeconds: {{ $p.livenessProbe.periodSeconds }}
  timeoutSeconds: {{ $p.livenessProbe.timeoutSeconds }}
  failureThreshold: {{ $p.livenessProbe.failureThreshold }}
{{- end }}

{{/* Keep serving while endpoints drop the pod, then SIGTERM starts the gateway's own drain. */}}
{{- define "nm-gateway.preStop" -}}
{{- with .Values.dataplane.preStopSleepSeconds }}
lifecycle:
  preStop:
    sleep:
      seconds: {{ . }}
{{- end }}
{{- end }}
