{{/*
Pieces of the RayCluster (raycluster.yaml).

videojob.rayWorkerGroup: one entry of workerGroupSpecs. Its argument is a dict:
  root            the chart's root context
  name            groupName (a GPU class, or "drivers")
  component       the pods' app.kubernetes.io/component
  labels          more pod labels (dict)
  minReplicas, maxReplicas
  groupResources  KubeRay's worker-group `resources` field (KubeRay 1.5): Ray
                  resources as strings ("CPU", custom ones). KubeRay writes them
                  into `ray start` as --num-cpus and a single-quoted
                  --resources='{...}', which survives its `bash -lc`; Ray's
                  autoscaler reads the same field (autoscaling_config.py
                  _get_custom_resources). KubeRay refuses the field beside
                  num-cpus, num-gpus, memory or resources in rayStartParams
                  (the schema keeps those out of the extra flags).
  rayStartParams  extra `ray start` flags (strings)
  resources       the Ray container's ResourceRequirements
  nodeSelector, tolerations, affinity
  live            the live group of that name (helm upgrade), or nil
*/}}
{{- define "videojob.rayWorkerGroup" -}}
{{- $root := .root -}}
- groupName: {{ .name }}
  minReplicas: {{ .minReplicas | int }}
  maxReplicas: {{ .maxReplicas | int }}
  {{- with .live }}
  {{- if hasKey . "replicas" }}
  replicas: {{ .replicas | int }}
  {{- end }}
  {{- with .scaleStrategy }}
  scaleStrategy:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- end }}
  {{- with .groupResources }}
  resources:
    {{- range $key, $value := . }}
    {{ $key | quote }}: {{ $value | toString | quote }}
    {{- end }}
  {{- end }}
  {{- with .rayStartParams }}
  rayStartParams:
    {{- range $key, $value := . }}
    {{ $key | quote }}: {{ $value | toString | quote }}
    {{- end }}
  {{- else }}
  rayStartParams: {}
  {{- end }}
  template:
    metadata:
      labels:
        {{- include "videojob.selectorLabels" $root | nindent 8 }}
        app.kubernetes.io/component: {{ .component }}
        {{- with .labels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      restartPolicy: Never
      automountServiceAccountToken: false
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: ray-worker
          image: {{ include "videojob.image" (dict "image" $root.Values.image.runtime "root" $root) }}
          imagePullPolicy: {{ $root.Values.image.runtime.pullPolicy }}
          env:
            {{- include "videojob.runtimeEnv" $root | nindent 12 }}
            {{- include "videojob.rayAuthEnv" $root | nindent 12 }}
          resources:
            {{- toYaml .resources | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.containerSecurityContext | nindent 12 }}
          volumeMounts:
            {{- include "videojob.runtimeVolumeMounts" $root | nindent 12 }}
      volumes:
        {{- include "videojob.runtimeVolumes" $root | nindent 8 }}
      {{- with .nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}

{{/*
The autoscaler sidecar's Kubernetes API credentials. The head pod mounts no
ServiceAccount token (automountServiceAccountToken: false): its Ray container
runs the GCS, the dashboard and the Jobs API and never calls Kubernetes. KubeRay
(1.5, common/pod.go DefaultHeadPodTemplate) gives the head pod the RayCluster's
own ServiceAccount (named after the cluster, with a Role to patch its pods and
RayCluster) and appends the autoscaler container, which reads the in-cluster
token at the usual path (ray autoscaler kuberay/node_provider.py). So the pod
has this projected volume, the same sources as the kube-api-access volume the
API server would add, and only the autoscaler mounts it
(autoscalerOptions.volumeMounts).
*/}}
{{- define "videojob.autoscalerTokenVolumeName" -}}
kube-api-access-autoscaler
{{- end -}}

{{- define "videojob.autoscalerTokenVolume" -}}
- name: {{ include "videojob.autoscalerTokenVolumeName" . }}
  projected:
    defaultMode: 420
    sources:
      - serviceAccountToken:
          path: token
          expirationSeconds: 3607
      - configMap:
          name: kube-root-ca.crt
          items:
            - key: ca.crt
              path: ca.crt
      - downwardAPI:
          items:
            - path: namespace
              fieldRef:
                apiVersion: v1
                fieldPath: metadata.namespace
{{- end -}}
