{{/* Chart name, truncated to 63 characters (a DNS label). */}}
{{- define "warmfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-chart unless the release already contains the chart name; 63 characters. */}}
{{- define "warmfleet.fullname" -}}
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

{{/* Common labels. */}}
{{- define "warmfleet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "warmfleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels selecting the operator pod. */}}
{{- define "warmfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "warmfleet.name" . }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The slim image (operator, router, fetch-model), repository:tag (tag defaults to appVersion). */}}
{{- define "warmfleet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The engine image of `warmfleet` server pods, repository:tag (tag defaults to appVersion). */}}
{{- define "warmfleet.engineImage" -}}
{{- printf "%s:%s" .Values.engineImage.repository (default .Chart.AppVersion .Values.engineImage.tag) }}
{{- end }}

{{/* ServiceAccount name. */}}
{{- define "warmfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "warmfleet.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The operator's Secret permissions (a ClusterRole's rules, or a Role's in each of operator.watchNamespaces):
create, for the admin key it generates per InferenceService (NAME-admin; never read back unless GET is granted);
GET (never list or watch) of the Secrets a service names (credentials, API and admin keys) with
operator.readModelCredentials.
*/}}
{{- define "warmfleet.secretRules" -}}
- apiGroups: [""]
  resources: ["secrets"]
  verbs: [{{ if .Values.operator.readModelCredentials }}"get", {{ end }}"create"]
{{- end }}
