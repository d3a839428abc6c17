{{/* Names. fullname is cut to 40 characters so that "<fullname>-control-plane" (a Service: a DNS label, at most
63) and the other suffixed names fit. */}}
{{- define "openrl-lab.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "openrl-lab.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "openrl-lab.selectorLabels" -}}
app.kubernetes.io/name: {{ include "openrl-lab.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "openrl-lab.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "openrl-lab.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "openrl-lab.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "openrl-lab.controlPlaneName" -}}
{{- printf "%s-control-plane" (include "openrl-lab.fullname" .) }}
{{- end }}

{{/* The address kernels dial, and the name the control plane's certificate must carry. */}}
{{- define "openrl-lab.controlPlaneHost" -}}
{{- printf "%s.%s.svc" (include "openrl-lab.controlPlaneName" .) .Release.Namespace }}
{{- end }}

{{- define "openrl-lab.joinTokenSecret" -}}
{{- .Values.joinToken.existingSecret | default (printf "%s-join-token" (include "openrl-lab.fullname" .)) }}
{{- end }}

{{- define "openrl-lab.apiKeysSecret" -}}
{{- .Values.apiKeys.existingSecret | default (printf "%s-api-keys" (include "openrl-lab.fullname" .)) }}
{{- end }}

{{- define "openrl-lab.sandboxName" -}}
{{- printf "%s-sandbox" (include "openrl-lab.fullname" .) }}
{{- end }}

{{- define "openrl-lab.sandboxTokenSecret" -}}
{{- .Values.sandbox.token.existingSecret | default (printf "%s-sandbox-token" (include "openrl-lab.fullname" .)) }}
{{- end }}

{{/* The sandbox Service's port and the address the control plane forwards programs to. */}}
{{- define "openrl-lab.sandboxPort" -}}8080{{- end }}
{{- define "openrl-lab.sandboxUrl" -}}
{{- printf "http://%s.%s.svc:%s" (include "openrl-lab.sandboxName" .) .Release.Namespace (include "openrl-lab.sandboxPort" .) }}
{{- end }}

{{- define "openrl-lab.controlPlaneTlsSecret" -}}
{{- if eq .Values.tls.mode "existing" }}{{ .Values.tls.existing.controlPlaneSecret }}
{{- else }}{{ printf "%s-control-plane-tls" (include "openrl-lab.fullname" .) }}{{ end }}
{{- end }}

{{- define "openrl-lab.kernelTlsSecret" -}}
{{- if eq .Values.tls.mode "existing" }}{{ .Values.tls.existing.kernelSecret }}
{{- else }}{{ printf "%s-kernel-tls" (include "openrl-lab.fullname" .) }}{{ end }}
{{- end }}

{{- define "openrl-lab.stateClaim" -}}
{{- .Values.persistence.state.existingClaim | default (printf "%s-state" (include "openrl-lab.fullname" .)) }}
{{- end }}

{{- define "openrl-lab.checkpointClaim" -}}
{{- .Values.persistence.checkpoints.existingClaim | default (printf "%s-checkpoints" (include "openrl-lab.fullname" .)) }}
{{- end }}

{{/* The DRA object a GPU group's kernel Pods reference: a ResourceClaimTemplate (a claim, so a GPU, per Pod) or,
for a shared group, one ResourceClaim all its Pods reference (the time-slicing case). */}}
{{- define "openrl-lab.gpuClaimName" -}}
{{- printf "%s-%s-gpu" (include "openrl-lab.fullname" .root) .group.id }}
{{- end }}

{{/* The kernel name (`serve --kernel-tls-name`) in every kernel certificate: kernel Pods' addresses are not known
in advance, so the control plane checks this name instead. */}}
{{- define "openrl-lab.kernelTlsName" -}}openrl-kernel{{- end }}

{{/* One device request in the resource.k8s.io/v1 shape: everything under `exactly` (the v1beta1 shape, with
deviceClassName on the request itself, is refused by a 1.34 API server). Called with the group: its `gpu` says
which devices, its `devices` (default 1) how many each claim gets (a multi-device kernel Pod's). */}}
{{- define "openrl-lab.deviceClaimSpec" -}}
{{- $count := int (.devices | default 1) }}
{{- with .gpu -}}
devices:
  requests:
    - name: gpu
      exactly:
        deviceClassName: {{ .deviceClassName }}
        allocationMode: ExactCount
        count: {{ $count }}
        {{- if or .productName .selector }}
        selectors:
          {{- if .productName }}
          - cel:
              expression: {{ printf "device.attributes[%q].productName == %q" (.driver | default "gpu.nvidia.com") .productName | quote }}
          {{- end }}
          {{- if .selector }}
          - cel:
              expression: {{ .selector | quote }}
          {{- end }}
        {{- end }}
  {{- if .timeSlicing }}
  config:
    # for NVIDIA's DRA driver: how the Pods that share this GPU take turns (its opaque GpuConfig)
    - requests: [gpu]
      opaque:
        driver: {{ .driver | default "gpu.nvidia.com" }}
        parameters:
          apiVersion: resource.nvidia.com/v1beta1
          kind: GpuConfig
          sharing:
            strategy: TimeSlicing
            timeSlicingConfig:
              interval: {{ .timeSlicing }}
  {{- end }}
{{- end }}
{{- end }}

{{/* Checks that JSON Schema cannot say. */}}
{{- define "openrl-lab.validate" -}}
{{- $seen := dict }}
{{- range .Values.kernels.groups }}
{{- if hasKey $seen .id }}
{{- fail (printf "kernels.groups: the group id %q is used twice; each group needs its own id" .id) }}
{{- end }}
{{- $_ := set $seen .id true }}
{{- $pod := printf "%s-kernel-%s-%d" $.Release.Name .id (sub (int .kernels) 1) }}
{{- if gt (len $pod) 63 }}
{{- fail (printf "kernels.groups: the kernel Pod name %q (<release>-kernel-<group>-<i>) is longer than 63 characters: use a shorter release name or group id" $pod) }}
{{- end }}
{{- if and (gt (int (.devices | default 1)) 1) (not .gpu) }}
{{- fail (printf "kernels.groups: group %q asks for %d devices per kernel Pod but claims no GPU: `devices` counts the GPUs of `gpu` (CPU kernels have one device each: a run on several devices takes several groups)" .id (int .devices)) }}
{{- end }}
{{- end }}
{{- end }}
