{{/* Names ---------------------------------------------------------------------------------------------- */}}
{{- define "gemflow.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gemflow.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "gemflow.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "gemflow.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* "<fullname>-<component>", kept under the 63-character label limit. */}}
{{- define "gemflow.componentName" -}}
{{- printf "%s-%s" (include "gemflow.fullname" .root) .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels ---------------------------------------------------------------------------------------------- */}}
{{- define "gemflow.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gemflow.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "gemflow.labels" -}}
{{ include "gemflow.selectorLabels" . }}
app.kubernetes.io/part-of: gemflow
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Images ---------------------------------------------------------------------------------------------- */}}
{{- define "gemflow.image" -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag -}}
{{- end -}}
{{- define "gemflow.gpuImage" -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.gpuTag -}}
{{- end -}}

{{/* Security: one pod and one container context for every workload (see values.securityDefaults). ------- */}}
{{- define "gemflow.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityDefaults.runAsUser }}
runAsGroup: {{ .Values.securityDefaults.runAsGroup }}
fsGroup: {{ .Values.securityDefaults.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Container context; pass readOnlyRootFilesystem=false only where a workload cannot run without it. */}}
{{- define "gemflow.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Service endpoints (in-chart StatefulSets or existing services) ------------------------------------- */}}
{{- define "gemflow.postgresHost" -}}
{{- if .Values.postgres.deploy -}}
{{- include "gemflow.componentName" (dict "root" . "component" "postgres") -}}
{{- else -}}
{{- required "postgres.host is required when postgres.deploy=false" .Values.postgres.host -}}
{{- end -}}
{{- end -}}

{{- define "gemflow.redisHost" -}}
{{- if .Values.redis.deploy -}}
{{- include "gemflow.componentName" (dict "root" . "component" "redis") -}}
{{- else -}}
{{- required "redis.host is required when redis.deploy=false" .Values.redis.host -}}
{{- end -}}
{{- end -}}

{{- define "gemflow.mlflowUrl" -}}
{{- printf "http://%s:%v" (include "gemflow.componentName" (dict "root" . "component" "mlflow")) .Values.mlflow.port -}}
{{- end -}}

{{/* What an MLflow client needs: the tracking server's address and, with mlflow.auth.enabled, the login the
     MLflow client sends (HTTP basic auth, MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD) from the auth
     Secret. Every pod that talks to MLflow includes it; pods that do not (the Feast server) do not get the login. */}}
{{- define "gemflow.mlflowEnv" -}}
- name: MLFLOW_TRACKING_URI
  value: {{ include "gemflow.mlflowUrl" . | quote }}
{{- if .Values.mlflow.auth.enabled }}
- name: MLFLOW_TRACKING_USERNAME
  valueFrom:
    secretKeyRef:
      name: {{ include "gemflow.mlflowAuthSecret" . }}
      key: {{ .Values.mlflow.auth.usernameKey }}
- name: MLFLOW_TRACKING_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "gemflow.mlflowAuthSecret" . }}
      key: {{ .Values.mlflow.auth.passwordKey }}
{{- end }}
{{- end -}}

{{- define "gemflow.mlflowAuthSecret" -}}
{{- required "mlflow.auth.existingSecret is required when mlflow.auth.enabled=true (set mlflow.auth.enabled=false to run MLflow without a login)" .Values.mlflow.auth.existingSecret -}}
{{- end -}}

{{/* Environment shared by every pod that uses Feast and the workspace. Passwords come only from Secrets
     (existingSecret); Feast expands ${VAR} in feature_store.yaml from these variables. Pods that also talk to
     MLflow add gemflow.mlflowEnv. */}}
{{- define "gemflow.clientEnv" -}}
- name: GEMFLOW_HOME
  value: {{ .Values.workspace.mountPath | quote }}
- name: GEMFLOW_FEATURE_STORE_YAML
  value: /etc/gemflow/feast/feature_store.yaml
- name: FEAST_FS_YAML_FILE_PATH
  value: /etc/gemflow/feast/feature_store.yaml
- name: FEAST_DB_USER
  valueFrom:
    secretKeyRef:
      name: {{ .Values.postgres.existingSecret }}
      key: {{ .Values.postgres.userKey }}
- name: FEAST_DB_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.postgres.existingSecret }}
      key: {{ .Values.postgres.passwordKey }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret }}
      key: {{ .Values.redis.passwordKey }}
- name: MLFLOW_ALLOW_PICKLE_DESERIALIZATION
  value: "false"
- name: MLFLOW_DISABLE_TELEMETRY
  value: "true"
- name: DO_NOT_TRACK
  value: "true"
{{- end -}}

{{/* S3 credentials and endpoint for object storage, from an existing Secret. */}}
{{- define "gemflow.objectStorageEnv" -}}
- name: AWS_DEFAULT_REGION
  value: {{ .Values.objectStorage.region | quote }}
{{- if .Values.objectStorage.endpoint }}
- name: MLFLOW_S3_ENDPOINT_URL
  value: {{ .Values.objectStorage.endpoint | quote }}
- name: AWS_ENDPOINT_URL_S3
  value: {{ .Values.objectStorage.endpoint | quote }}
{{- end }}
{{- if .Values.objectStorage.existingSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ .Values.objectStorage.existingSecret }}
      key: {{ .Values.objectStorage.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.objectStorage.existingSecret }}
      key: {{ .Values.objectStorage.secretAccessKeyKey }}
{{- end }}
{{- end -}}

{{/* Volumes every project-image pod needs with a read-only root filesystem. */}}
{{- define "gemflow.scratchVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.securityDefaults.tmpSizeLimit }}
- name: home
  emptyDir:
    sizeLimit: 256Mi
{{- end -}}
{{- define "gemflow.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: /home/gemflow
{{- end -}}

{{- define "gemflow.feastVolume" -}}
- name: feast-config
  configMap:
    name: {{ include "gemflow.componentName" (dict "root" . "component" "feast") }}
{{- end -}}
{{- define "gemflow.feastMount" -}}
- name: feast-config
  mountPath: /etc/gemflow/feast
  readOnly: true
{{- end -}}

{{- define "gemflow.workspaceClaim" -}}
{{- if .Values.workspace.existingClaim -}}
{{- .Values.workspace.existingClaim -}}
{{- else -}}
{{- include "gemflow.componentName" (dict "root" . "component" "workspace") -}}
{{- end -}}
{{- end -}}

{{/* Training ------------------------------------------------------------------------------------------ */}}
{{/* `gemflow train` launched by torchrun: under the Trainer's torch policy, torchrun reads the node count,
     rank and rendezvous address from the PET_* variables the Trainer injects; DeepSpeed joins that group. */}}
{{- define "gemflow.trainCommand" -}}
- torchrun
- --no-python
- gemflow
- train
- --model
- {{ .Values.training.model }}
{{- range .Values.training.args }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{- define "gemflow.trainResources" -}}
{{- $gpu := dict "nvidia.com/gpu" (toString .Values.training.gpusPerNode) -}}
requests:
  {{- toYaml (merge (deepCopy .Values.training.resourcesPerNode.requests) $gpu) | nindent 2 }}
limits:
  {{- toYaml (merge (deepCopy .Values.training.resourcesPerNode.limits) $gpu) | nindent 2 }}
{{- end -}}

{{/* The training pod body shared by the ClusterTrainingRuntime and the indexed Job. */}}
{{- define "gemflow.trainPodSpec" -}}
serviceAccountName: {{ include "gemflow.componentName" (dict "root" .root "component" "trainer") }}
automountServiceAccountToken: false
restartPolicy: Never
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- include "gemflow.podSecurityContext" .root | nindent 2 }}
containers:
  - name: {{ .containerName }}
    image: {{ include "gemflow.gpuImage" .root }}
    imagePullPolicy: {{ .root.Values.image.pullPolicy }}
    command:
      {{- .command | nindent 6 }}
    securityContext:
      {{- include "gemflow.containerSecurityContext" .root | nindent 6 }}
    env:
      - name: DS_ACCELERATOR
        value: cuda
      - name: NCCL_DEBUG
        value: WARN
      {{- with .extraEnv }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
      {{- include "gemflow.mlflowEnv" .root | nindent 6 }}
      {{- include "gemflow.clientEnv" .root | nindent 6 }}
      {{- with .root.Values.training.env }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    ports:
      - name: rendezvous
        containerPort: {{ .root.Values.training.masterPort }}
    resources:
      {{- include "gemflow.trainResources" .root | nindent 6 }}
    volumeMounts:
      {{- include "gemflow.scratchMounts" .root | nindent 6 }}
      {{- include "gemflow.feastMount" .root | nindent 6 }}
      - name: workspace
        mountPath: {{ .root.Values.workspace.mountPath }}
      - name: shm
        mountPath: /dev/shm
volumes:
  {{- include "gemflow.scratchVolumes" .root | nindent 2 }}
  {{- include "gemflow.feastVolume" .root | nindent 2 }}
  - name: workspace
    persistentVolumeClaim:
      claimName: {{ include "gemflow.workspaceClaim" .root }}
  - name: shm
    emptyDir:
      medium: Memory
      sizeLimit: {{ .root.Values.training.shmSize }}
{{- end -}}

{{/* Spark on Kubernetes ---------------------------------------------------------------------------------- */}}
{{/* The spark-submit settings of the Spark stages, as JSON (GEMFLOW_SPARK_CONF): image, ServiceAccount, pod
     templates (the stage pod's volumes, env and security context), sizing. */}}
{{- define "gemflow.sparkConf" -}}
{{- $s := .Values.stages.spark -}}
{{- $template := "/opt/gemflow/stage/spark-pod-template.yaml" -}}
{{- dict
  "spark.kubernetes.namespace" .Release.Namespace
  "spark.kubernetes.container.image" (default (include "gemflow.image" .) $s.image)
  "spark.kubernetes.container.image.pullPolicy" .Values.image.pullPolicy
  "spark.kubernetes.authenticate.driver.serviceAccountName" $s.serviceAccount
  "spark.kubernetes.authenticate.submission.caCertFile" "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
  "spark.kubernetes.authenticate.submission.oauthTokenFile" "/var/run/secrets/kubernetes.io/serviceaccount/token"
  "spark.kubernetes.driver.podTemplateFile" $template
  "spark.kubernetes.executor.podTemplateFile" $template
  "spark.kubernetes.driver.podTemplateContainerName" "base"
  "spark.kubernetes.executor.podTemplateContainerName" "base"
  "spark.pyspark.python" "/opt/gemflow/bin/python"
  "spark.driver.cores" (toString $s.driver.cores)
  "spark.driver.memory" $s.driver.memory
  "spark.executor.instances" (toString $s.executor.instances)
  "spark.executor.cores" (toString $s.executor.cores)
  "spark.executor.memory" $s.executor.memory
  "spark.executor.memoryOverhead" $s.executor.memoryOverhead
  "spark.sql.shuffle.partitions" (toString $s.shufflePartitions)
  "spark.sql.session.timeZone" "UTC"
  | toJson -}}
{{- end -}}

{{/* A stage pod (the KubernetesPodOperator template): .serviceAccount runs it; .apiToken mounts its token
     (spark: spark-submit and the driver talk to the API server) and the stage settings (spark-pod-template.yaml). */}}
{{- define "gemflow.stagePod" -}}
{{- $root := .root -}}
apiVersion: v1
kind: Pod
metadata:
  name: gemflow-stage
  labels:
    {{- include "gemflow.labels" (dict "root" $root "component" "stage") | nindent 4 }}
    {{- if .apiToken }}
    gemflow.io/spark: "true"  # spark-submit, driver, executors: templates/spark.yaml's NetworkPolicy
    {{- end }}
spec:
  serviceAccountName: {{ .serviceAccount }}
  automountServiceAccountToken: {{ .apiToken }}
  restartPolicy: Never
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- include "gemflow.podSecurityContext" $root | nindent 4 }}
  containers:
    # KubernetesPodOperator fills in the command of the container named "base".
    - name: base
      image: {{ include "gemflow.image" $root }}
      {{- if .apiToken }}
      # Spark's driver and executor pods get `driver ...` / `executor` as arguments (docker/spark-entrypoint.sh);
      # the spark-submit pod's command (KubernetesPodOperator's cmds) replaces this one.
      command: ["/opt/gemflow/spark-entrypoint.sh"]
      {{- end }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      securityContext:
        {{- include "gemflow.containerSecurityContext" $root | nindent 8 }}
      env:
        {{- include "gemflow.mlflowEnv" $root | nindent 8 }}
        {{- include "gemflow.clientEnv" $root | nindent 8 }}
        {{- include "gemflow.objectStorageEnv" $root | nindent 8 }}
        {{- if $root.Values.ranker.enabled }}
        # the InferenceService `gemflow deploy --mode cluster` applies (ranker-manifest-configmap.yaml)
        - name: GEMFLOW_RANKER_MANIFEST_FILE
          value: /opt/gemflow/ranker/inferenceservice.yaml
        {{- end }}
      resources:
        {{- toYaml $root.Values.stages.resources | nindent 8 }}
      volumeMounts:
        {{- include "gemflow.scratchMounts" $root | nindent 8 }}
        {{- include "gemflow.feastMount" $root | nindent 8 }}
        - name: workspace
          mountPath: {{ $root.Values.workspace.mountPath }}
        {{- if .apiToken }}
        - name: stage-settings
          mountPath: /opt/gemflow/stage
          readOnly: true
        {{- end }}
        {{- if $root.Values.ranker.enabled }}
        - name: ranker-manifest
          mountPath: /opt/gemflow/ranker
          readOnly: true
        {{- end }}
  volumes:
    {{- include "gemflow.scratchVolumes" $root | nindent 4 }}
    {{- include "gemflow.feastVolume" $root | nindent 4 }}
    {{- if .apiToken }}
    - name: stage-settings
      configMap:
        name: {{ $root.Values.stages.settingsConfigMap }}
    {{- end }}
    - name: workspace
      persistentVolumeClaim:
        claimName: {{ include "gemflow.workspaceClaim" $root }}
    {{- if $root.Values.ranker.enabled }}
    - name: ranker-manifest
      configMap:
        name: {{ include "gemflow.componentName" (dict "root" $root "component" "ranker-manifest") }}
    {{- end }}
{{- end -}}
