{{/*
Names. The full name is kept to 40 characters so that derived names stay
valid: the RayCluster (at most 53, DNS-1035), its head Service
(<cluster>-head-svc) and its pods' generated names.
*/}}
{{- define "videojob.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "videojob.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "videojob.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "videojob.selectorLabels" -}}
app.kubernetes.io/name: {{ include "videojob.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "videojob.labels" -}}
helm.sh/chart: {{ include "videojob.chart" . }}
{{ include "videojob.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: videojob
{{- end -}}

{{- define "videojob.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "videojob.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "videojob.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{/* The image of the operator pod: the runtime image in embedded mode (Ray runs inside it). */}}
{{- define "videojob.operatorImage" -}}
{{- if eq .Values.ray.mode "embedded" -}}
{{- include "videojob.image" (dict "image" .Values.image.runtime "root" .) -}}
{{- else -}}
{{- include "videojob.image" (dict "image" .Values.image.operator "root" .) -}}
{{- end -}}
{{- end -}}

{{- define "videojob.operatorPullPolicy" -}}
{{- if eq .Values.ray.mode "embedded" -}}
{{- .Values.image.runtime.pullPolicy -}}
{{- else -}}
{{- .Values.image.operator.pullPolicy -}}
{{- end -}}
{{- end -}}

{{- define "videojob.rayClusterName" -}}
{{- default (printf "%s-ray" (include "videojob.fullname" .)) .Values.ray.kuberay.clusterName -}}
{{- end -}}

{{/* The URL of the Ray dashboard (Jobs and State APIs) the operator speaks to. */}}
{{- define "videojob.dashboardUrl" -}}
{{- if eq .Values.ray.mode "kuberay" -}}
{{- printf "http://%s-head-svc.%s.svc:8265" (include "videojob.rayClusterName" .) .Release.Namespace -}}
{{- else if eq .Values.ray.mode "address" -}}
{{- required "ray.mode address needs ray.address (the Ray head's dashboard URL)" .Values.ray.address -}}
{{- end -}}
{{- end -}}

{{- define "videojob.inventoryDevice" -}}
{{- if .Values.inventory.device -}}
{{- .Values.inventory.device -}}
{{- else if eq .Values.ray.mode "embedded" -}}
cpu
{{- else -}}
cuda
{{- end -}}
{{- end -}}

{{/* "true" when bundles carry vj-class-<name> (inventory.py: default true on cuda, false on cpu). */}}
{{- define "videojob.classResources" -}}
{{- if kindIs "bool" .Values.inventory.classResources -}}
{{- .Values.inventory.classResources -}}
{{- else -}}
{{- eq (include "videojob.inventoryDevice" .) "cuda" -}}
{{- end -}}
{{- end -}}

{{- define "videojob.claimName" -}}
{{- default (printf "%s-data" (include "videojob.fullname" .)) .Values.persistence.existingClaim -}}
{{- end -}}

{{/*
The claim's access modes: persistence.accessModes, or by mode when empty
(kuberay: the head, driver and worker pods on several nodes mount it at once).
The schema refuses a kuberay list without ReadWriteMany; this says the fix
when schema validation was skipped.
*/}}
{{- define "videojob.accessModes" -}}
{{- $modes := .Values.persistence.accessModes -}}
{{- $kuberay := eq .Values.ray.mode "kuberay" -}}
{{- if not $modes -}}
{{- $modes = list (ternary "ReadWriteMany" "ReadWriteOnce" $kuberay) -}}
{{- else if and $kuberay (not (has "ReadWriteMany" $modes)) -}}
{{- fail (printf "persistence.accessModes %v: ray.mode kuberay mounts the data claim in the head, driver and worker pods on several nodes at once, so it needs ReadWriteMany; set persistence.accessModes=[ReadWriteMany] (a storage class that offers it) or leave it empty" $modes) -}}
{{- end -}}
{{- toYaml $modes -}}
{{- end -}}

{{- define "videojob.dataMountPath" -}}
{{- printf "%s/%s" .Values.persistence.mountRoot (include "videojob.claimName" .) -}}
{{- end -}}

{{- define "videojob.tokenMountDir" -}}
/var/run/secrets/videojob/ray
{{- end -}}

{{/*
The data volume (the claim, or an emptyDir when persistence is off), /tmp and
/dev/shm: every pod that runs the runtime has them (the root filesystem is read-only).
*/}}
{{/* The runtime key's Secret (values: runtimeKey; runtimekey.py) and where every container mounts it. */}}
{{- define "videojob.runtimeKeySecret" -}}
{{- .Values.runtimeKey.existingSecret | default (printf "%s-runtime-key" (include "videojob.fullname" .)) -}}
{{- end -}}

{{- define "videojob.runtimeKeyDir" -}}
/var/run/secrets/videojob/runtime-key
{{- end -}}

{{- define "videojob.runtimeKeyVolume" -}}
- name: runtime-key
  secret:
    secretName: {{ include "videojob.runtimeKeySecret" . }}
    defaultMode: 0440
    items:
      - key: {{ .Values.runtimeKey.secretKey }}
        path: key
{{- end -}}

{{- define "videojob.runtimeKeyMount" -}}
- name: runtime-key
  mountPath: {{ include "videojob.runtimeKeyDir" . }}
  readOnly: true
{{- end -}}

{{- define "videojob.runtimeKeyEnv" -}}
- name: VIDEOJOB_RUNTIME_KEY_FILE
  value: {{ printf "%s/key" (include "videojob.runtimeKeyDir" .) | quote }}
{{- end -}}

{{- define "videojob.runtimeVolumes" -}}
{{ include "videojob.runtimeKeyVolume" . }}
- name: data
{{- if .Values.persistence.enabled }}
  persistentVolumeClaim:
    claimName: {{ include "videojob.claimName" . }}
{{- else }}
  emptyDir: {}
{{- end }}
- name: tmp
  emptyDir: {}
- name: dshm
  emptyDir:
    medium: Memory
{{- end -}}

{{- define "videojob.runtimeVolumeMounts" -}}
{{ include "videojob.runtimeKeyMount" . }}
- name: data
  mountPath: {{ include "videojob.dataMountPath" . }}
- name: tmp
  mountPath: /tmp
- name: dshm
  mountPath: /dev/shm
{{- end -}}

{{/* Where the runtime finds local:// and pvc:// locations (runtime/videojob_runtime/locations.py). */}}
{{- define "videojob.runtimeEnv" -}}
{{- $data := include "videojob.dataMountPath" . -}}
- name: HOME
  value: /tmp
{{ include "videojob.runtimeKeyEnv" . }}
- name: VIDEOJOB_VOLUMES_ROOT
  value: {{ .Values.persistence.mountRoot | quote }}
- name: VIDEOJOB_OUTPUT_ROOT
  value: {{ printf "%s/outputs" $data | quote }}
- name: VIDEOJOB_MODEL_ROOT
  value: {{ printf "%s/models" $data | quote }}
- name: VIDEOJOB_DATA_ROOT
  value: {{ printf "%s/inputs" $data | quote }}
- name: HF_HOME
  value: {{ printf "%s/huggingface" $data | quote }}
{{- /* https inputs: the driver fetches them into a per-job directory here, where the ranks on other pods read them */}}
- name: VIDEOJOB_INPUT_STAGING_ROOT
  value: {{ printf "%s/staging" $data | quote }}
- name: HF_HUB_OFFLINE
  value: "1"
{{- with .Values.runtime.sharedModelRoots }}
{{- /* read-only model locations every namespace's spec.model.source may name (locations.py) */}}
- name: VIDEOJOB_SHARED_MODEL_ROOTS
  value: {{ join "," . | quote }}
{{- end }}
{{- with .Values.runtime.s3 }}
{{- if or .endpointUrl .credentialsSecret }}
{{- /* s3:// locations (runtime s3store.py): the store, the pod's download cache and the outputs'
staging on the data volume, and the credentials from the admin's Secret, never from a spec */}}
{{- with .endpointUrl }}
- name: VIDEOJOB_S3_ENDPOINT_URL
  value: {{ . | quote }}
{{- end }}
- name: VIDEOJOB_S3_REGION
  value: {{ .region | quote }}
- name: VIDEOJOB_S3_ADDRESSING_STYLE
  value: {{ .addressingStyle | quote }}
{{- with .buckets }}
- name: VIDEOJOB_S3_BUCKETS
  value: {{ join "," . | quote }}
{{- end }}
- name: VIDEOJOB_S3_TENANT_PREFIX
  value: {{ .tenantPrefix | quote }}
- name: VIDEOJOB_S3_CACHE_ROOT
  value: {{ printf "%s/s3-cache" $data | quote }}
- name: VIDEOJOB_S3_STAGING_ROOT
  value: {{ printf "%s/s3-staging" $data | quote }}
- name: VIDEOJOB_S3_PRESIGN_EXPIRY_S
  value: {{ .presignExpiryS | int | quote }}
{{- if .credentialsSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ .credentialsSecret | quote }}
      key: {{ .accessKeyIdKey | quote }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .credentialsSecret | quote }}
      key: {{ .secretAccessKeyKey | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- /* Ray's job manager (on the head) fails a job whose JobSupervisor waits longer than this
for its resources (default 15 min): a driver waiting for a free vj-driver slot may wait as
long as a placement may (operator.settings.placementMaxWaitS). */}}
- name: RAY_JOB_START_TIMEOUT_SECONDS
  value: {{ .Values.operator.settings.placementMaxWaitS | int | quote }}
{{- /* Ray's job supervisor SIGKILLs a stopped driver this long after SIGTERM (default 3 s);
the driver tears its group down within it (runtime stopping.py), which on a busy node
took longer than the default allows. */}}
- name: RAY_JOB_STOP_WAIT_TIME_S
  value: "10"
{{- with .Values.runtime.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Ray's token auth in every Ray container of the rendered cluster (kuberay mode: the schema requires the Secret). */}}
{{- define "videojob.rayAuthEnv" -}}
{{- if .Values.ray.auth.existingSecret -}}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.ray.auth.existingSecret }}
      key: {{ .Values.ray.auth.secretKey }}
{{- end -}}
{{- end -}}

{{/* The namespaces watched: none (cluster-wide), or the listed ones, or the release namespace. */}}
{{- define "videojob.watchNamespaces" -}}
{{- if not .Values.watch.clusterWide -}}
{{- if .Values.watch.namespaces -}}
{{- join "," .Values.watch.namespaces -}}
{{- else -}}
{{- .Release.Namespace -}}
{{- end -}}
{{- end -}}
{{- end -}}
