{{/*
Expand the name of the chart.
*/}}
{{- define "ratchet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
A default fully qualified app name, cut to 52 characters so that every component suffix (the
longest is "-test-proxy") still fits the 63 characters of a Kubernetes name.
If the release name contains the chart name it is used as the full name.
*/}}
{{- define "ratchet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Chart name and version as used by the chart label.
*/}}
{{- define "ratchet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Common labels.
*/}}
{{- define "ratchet.labels" -}}
helm.sh/chart: {{ include "ratchet.chart" . }}
{{ include "ratchet.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ratchet
{{- end }}

{{/*
Selector labels.
*/}}
{{- define "ratchet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ratchet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Labels and selector labels of one component: include with (dict "ctx" $ "component" "proxy").
*/}}
{{- define "ratchet.componentLabels" -}}
{{ include "ratchet.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "ratchet.componentSelectorLabels" -}}
{{ include "ratchet.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
The service account every pod of the release uses.
*/}}
{{- define "ratchet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ratchet.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
An image reference from (dict "image" <repository/tag/digest> "fallback" <image> "ctx" $):
the digest wins over the tag; empty fields come from the fallback, the tag at last from
the chart's appVersion.
*/}}
{{- define "ratchet.imageRef" -}}
{{- $fallback := .fallback | default dict }}
{{- $repo := .image.repository | default $fallback.repository }}
{{- $digest := .image.digest | default $fallback.digest }}
{{- $tag := .image.tag | default $fallback.tag | default .ctx.Chart.AppVersion }}
{{- if $digest }}
{{- printf "%s@%s" $repo $digest }}
{{- else }}
{{- printf "%s:%s" $repo $tag }}
{{- end }}
{{- end }}

{{- define "ratchet.image" -}}
{{- include "ratchet.imageRef" (dict "image" .Values.image "ctx" .) }}
{{- end }}

{{/*
The learner's image, built with CUDA torch: learner.image.repository (else image.repository) at
learner.image.digest, else at learner.image.tag, else at image.tag (or the appVersion) followed by
learner.image.tagSuffix. image.digest is never used: it pins the image without torch.
*/}}
{{- define "ratchet.learnerImage" -}}
{{- $image := .Values.learner.image }}
{{- $repo := $image.repository | default .Values.image.repository }}
{{- if $image.digest }}
{{- printf "%s@%s" $repo $image.digest }}
{{- else }}
{{- $tag := $image.tag | default (printf "%s%s" (.Values.image.tag | default .Chart.AppVersion) ($image.tagSuffix | default "")) }}
{{- printf "%s:%s" $repo $tag }}
{{- end }}
{{- end }}

{{/*
The base model's served name: model.servedName, else the last part of model.name, lower-cased.
*/}}
{{- define "ratchet.servedName" -}}
{{- if .Values.model.servedName }}
{{- .Values.model.servedName }}
{{- else }}
{{- .Values.model.name | splitList "/" | last | lower }}
{{- end }}
{{- end }}

{{/*
Where the services reach vLLM.
*/}}
{{- define "ratchet.vllmUrl" -}}
{{- if .Values.inferenceGateway.enabled }}
{{- .Values.inferenceGateway.url | trimSuffix "/" }}
{{- else if .Values.vllm.enabled }}
{{- printf "http://%s-vllm:%d" (include "ratchet.fullname" .) (int .Values.vllm.port) }}
{{- else }}
{{- .Values.vllm.url | trimSuffix "/" }}
{{- end }}
{{- end }}

{{/*
Names of the Secrets the pods read (the chart's own, or the ones the user manages).
*/}}
{{- define "ratchet.secretName" -}}
{{- printf "%s-secrets" (include "ratchet.fullname" .) }}
{{- end }}

{{- define "ratchet.proxySecretName" -}}
{{- .Values.proxy.existingSecret | default (include "ratchet.secretName" .) }}
{{- end }}

{{- define "ratchet.kafkaSecretName" -}}
{{- .Values.kafka.sasl.existingSecret | default (include "ratchet.secretName" .) }}
{{- end }}

{{- define "ratchet.redisSecretName" -}}
{{- .Values.redis.auth.existingSecret | default (include "ratchet.secretName" .) }}
{{- end }}

{{- define "ratchet.kafkaPasswordKey" -}}
{{- if .Values.kafka.sasl.existingSecret }}{{ .Values.kafka.sasl.passwordKey }}{{ else }}kafka-sasl-password{{ end }}
{{- end }}

{{- define "ratchet.redisPasswordKey" -}}
{{- if .Values.redis.auth.existingSecret }}{{ .Values.redis.auth.passwordKey }}{{ else }}redis-password{{ end }}
{{- end }}

{{- define "ratchet.apiKeysKey" -}}
{{- if .Values.proxy.existingSecret }}{{ .Values.proxy.apiKeysKey }}{{ else }}api-keys{{ end }}
{{- end }}

{{- define "ratchet.adminKeyKey" -}}
{{- if .Values.proxy.existingSecret }}{{ .Values.proxy.adminKeyKey }}{{ else }}admin-key{{ end }}
{{- end }}

{{/*
Whether the chart writes proxy.adminKey into its Secret: for the proxy and for the console, whose
admin actions (and, off loopback, every page) take the same key.
*/}}
{{- define "ratchet.adminKeyWritten" -}}
{{- if and .Values.proxy.adminKey (not .Values.proxy.existingSecret) (or .Values.proxy.enabled .Values.console.enabled) }}true{{ end }}
{{- end }}

{{/*
The server secret (RATCHET_SECRET) and vLLM's API key: the chart's Secret, or the user's.
*/}}
{{- define "ratchet.serverSecretName" -}}
{{- .Values.secret.existingSecret | default (printf "%s-server" (include "ratchet.fullname" .)) }}
{{- end }}

{{- define "ratchet.serverSecretWritten" -}}
{{- if and .Values.secret.create (not .Values.secret.existingSecret) }}true{{ end }}
{{- end }}

{{- define "ratchet.serverSecretKey" -}}
{{- if .Values.secret.existingSecret }}{{ .Values.secret.secretKey }}{{ else }}ratchet-secret{{ end }}
{{- end }}

{{- define "ratchet.vllmApiKeyKey" -}}
{{- if .Values.secret.existingSecret }}{{ .Values.secret.vllmApiKeyKey }}{{ else }}vllm-api-key{{ end }}
{{- end }}

{{/*
vLLM's API key from that Secret, as an env entry: include with (dict "ctx" $ "name" "VLLM_API_KEY").
*/}}
{{- define "ratchet.vllmApiKeyEnv" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ include "ratchet.serverSecretName" .ctx }}
      key: {{ include "ratchet.vllmApiKeyKey" .ctx }}
{{- end }}

{{- define "ratchet.kafkaSasl" -}}
{{- if .Values.kafka.sasl.mechanism }}true{{ end }}
{{- end }}

{{- define "ratchet.redisAuth" -}}
{{- if or .Values.redis.auth.existingSecret .Values.redis.auth.password }}true{{ end }}
{{- end }}

{{/*
Whether the chart writes its own Secret, and whether it holds anything.
*/}}
{{- define "ratchet.chartSecretNeeded" -}}
{{- if or (and .Values.proxy.enabled (not .Values.proxy.existingSecret)) (include "ratchet.adminKeyWritten" .) (and (include "ratchet.kafkaSasl" .) (not .Values.kafka.sasl.existingSecret)) (and .Values.redis.auth.password (not .Values.redis.auth.existingSecret)) }}true{{ end }}
{{- end }}

{{- define "ratchet.judgeSecretName" -}}
{{- .Values.judge.existingSecret | default (printf "%s-judge" (include "ratchet.fullname" .)) }}
{{- end }}

{{/*
Whether anything in the release calls the judge model: the judge, and the learner's gate (which
judges pairs of answers with the same judge settings, key and verifiers).
*/}}
{{- define "ratchet.judgeModelUsed" -}}
{{- if or .Values.judge.enabled .Values.learner.enabled }}true{{ end }}
{{- end }}

{{/*
Whether the chart writes the judge's Secret (judge.apiKey, judge.providerKeys), and whether the
judge and the learner read one at all (that one, or judge.existingSecret).
*/}}
{{- define "ratchet.judgeSecretWritten" -}}
{{- if and (include "ratchet.judgeModelUsed" .) (not .Values.judge.existingSecret) (or .Values.judge.apiKey .Values.judge.providerKeys) }}true{{ end }}
{{- end }}

{{- define "ratchet.judgeSecretUsed" -}}
{{- if and (include "ratchet.judgeModelUsed" .) (or (include "ratchet.judgeSecretWritten" .) .Values.judge.existingSecret) }}true{{ end }}
{{- end }}

{{/*
The Hugging Face token Secret the learner reads (learner.hfToken, else vllm.hfToken), if any.
*/}}
{{- define "ratchet.learnerHfToken" -}}
{{- if .Values.learner.hfToken.existingSecret }}
{{- dict "name" .Values.learner.hfToken.existingSecret "key" .Values.learner.hfToken.key | toJson }}
{{- else if .Values.vllm.hfToken.existingSecret }}
{{- dict "name" .Values.vllm.hfToken.existingSecret "key" .Values.vllm.hfToken.key | toJson }}
{{- end }}
{{- end }}

{{/*
The Redis URL, with redis.auth.username but never the password (the services read it from the
secret file RATCHET_REDIS_PASSWORD); with a CA Secret, redis-py reads ssl_ca_certs from the query.
*/}}
{{- define "ratchet.redisUrl" -}}
{{- $url := .Values.redis.url }}
{{- if and (include "ratchet.redisAuth" .) .Values.redis.auth.username }}
{{- $scheme := regexFind "^rediss?://" $url }}
{{- $url = printf "%s%s@%s" $scheme .Values.redis.auth.username (trimPrefix $scheme $url) }}
{{- end }}
{{- if .Values.redis.tls.caSecret }}
{{- $sep := ternary "&" "?" (contains "?" $url) }}
{{- $url = printf "%s%sssl_ca_certs=/etc/ratchet/redis-ca/%s" $url $sep .Values.redis.tls.caKey }}
{{- end }}
{{- $url }}
{{- end }}

{{/*
Whether the adapter store is mounted by anything in this release (the console reads it).
*/}}
{{- define "ratchet.adaptersUsed" -}}
{{- if or .Values.vllm.enabled .Values.learner.enabled .Values.console.enabled }}true{{ end }}
{{- end }}

{{- define "ratchet.adaptersClaim" -}}
{{- .Values.adapters.existingClaim | default (printf "%s-adapters" (include "ratchet.fullname" .)) }}
{{- end }}

{{/*
Values that the schema cannot check alone; each failure says what to set.
*/}}
{{/*
Whether the chart renders the headless Service of vLLM's pods that the proxy, judge and gate
balance over (vllm_endpoints): several replicas, and no inference gateway doing it for them.
*/}}
{{- define "ratchet.vllmReplicasService" -}}
{{- if and .Values.vllm.enabled (gt (int .Values.vllm.replicaCount) 1) (not .Values.inferenceGateway.enabled) }}true{{ end }}
{{- end }}

{{/*
The endpoint picker's EndpointPickerConfig (llm-d router): vLLM's metrics scraped from each pod,
the request body parsed as OpenAI's, and one scheduling profile of inferenceGateway's scorers.
*/}}
{{- define "ratchet.endpointPickerConfig" -}}
ratchet-plugins.yaml: |
  apiVersion: llm-d.ai/v1alpha1
  kind: EndpointPickerConfig
  plugins:
    - type: metrics-data-source
      parameters:
        scheme: http
        path: /metrics
    - type: core-metrics-extractor
    {{- range $scorer, $weight := .Values.inferenceGateway.endpointPicker.scorers }}
    - type: {{ $scorer }}
    {{- end }}
  schedulingProfiles:
    - name: default
      plugins:
        {{- range $scorer, $weight := .Values.inferenceGateway.endpointPicker.scorers }}
        - pluginRef: {{ $scorer }}
          weight: {{ $weight }}
        {{- end }}
{{- end }}

{{- define "ratchet.validate" -}}
{{- if .Values.inferenceGateway.enabled }}
{{- if not .Values.vllm.enabled }}
{{- fail "inferenceGateway.enabled needs vllm.enabled: the InferencePool selects the chart's own vLLM pods. For a vLLM you run, point vllm.url at your inference gateway instead" }}
{{- end }}
{{- if not .Values.inferenceGateway.gateway.name }}
{{- fail "inferenceGateway.enabled is true but inferenceGateway.gateway.name is empty: name the Gateway (one that implements the Inference Extension) the HTTPRoute attaches to" }}
{{- end }}
{{- if not .Values.inferenceGateway.url }}
{{- fail "inferenceGateway.enabled is true but inferenceGateway.url is empty: set it to where Ratchet's pods reach that Gateway's listener, e.g. http://inference-gateway.gateway-system.svc:80" }}
{{- end }}
{{- if not .Values.inferenceGateway.gateway.sectionName }}
{{- fail "inferenceGateway.enabled is true but inferenceGateway.gateway.sectionName is empty: name the Gateway's listener the HTTPRoute attaches to (on a shared Gateway it would attach to every listener that allows it)" }}
{{- end }}
{{- $host := regexReplaceAll ":[0-9]+$" (urlParse .Values.inferenceGateway.url).host "" }}
{{- $served := false }}
{{- range .Values.inferenceGateway.hostnames }}
{{- if or (eq . $host) (and (hasPrefix "*." .) (hasSuffix (trimPrefix "*" .) $host)) }}{{ $served = true }}{{ end }}
{{- end }}
{{- if not .Values.inferenceGateway.hostnames }}
{{- fail (printf "inferenceGateway.enabled is true but inferenceGateway.hostnames is empty: name the host names the HTTPRoute answers for, at least the host of inferenceGateway.url (%s)" $host) }}
{{- end }}
{{- if not $served }}
{{- fail (printf "inferenceGateway.hostnames does not include the host of inferenceGateway.url (%s): Ratchet's own requests would not be routed" $host) }}
{{- end }}
{{- end }}
{{- if and .Values.vllm.enabled .Values.vllm.url }}
{{- fail "vllm.url is set while vllm.enabled is true: set vllm.enabled=false to use an existing vLLM, or remove vllm.url" }}
{{- end }}
{{- if and (not .Values.vllm.enabled) (not .Values.vllm.url) }}
{{- fail "vllm.enabled is false but vllm.url is empty: set vllm.url to your vLLM's address (e.g. http://vllm.inference:8000)" }}
{{- end }}
{{- if and (not .Values.secret.create) (not .Values.secret.existingSecret) }}
{{- fail "secret.create is false and secret.existingSecret is empty: every component needs the server secret and vLLM's API key. Set secret.existingSecret to a Secret holding them (keys secret.secretKey and secret.vllmApiKeyKey), or secret.create=true" }}
{{- end }}
{{- if and .Values.proxy.enabled (not .Values.proxy.existingSecret) (not .Values.proxy.apiKeys) }}
{{- fail "proxy.apiKeys is empty and proxy.existingSecret is not set: the proxy refuses to listen on the pod network without API keys. Set proxy.apiKeys (e.g. --set proxy.apiKeys[0]=sk-...) or proxy.existingSecret" }}
{{- end }}
{{- if and .Values.console.enabled (not .Values.proxy.adminKey) (not .Values.proxy.existingSecret) }}
{{- fail "console.enabled is true but proxy.adminKey is empty and proxy.existingSecret is not set: the console listens on the pod network (0.0.0.0) and refuses to start without the admin key. Set proxy.adminKey (e.g. --set proxy.adminKey=...) or proxy.existingSecret (the key under proxy.adminKeyKey), or console.enabled=false" }}
{{- end }}
{{- if and (include "ratchet.kafkaSasl" .) (not .Values.kafka.sasl.username) }}
{{- fail "kafka.sasl.mechanism is set but kafka.sasl.username is empty" }}
{{- end }}
{{- if and (include "ratchet.kafkaSasl" .) (not .Values.kafka.sasl.existingSecret) (not .Values.kafka.sasl.password) }}
{{- fail "kafka.sasl.mechanism is set but there is no password: set kafka.sasl.existingSecret (and passwordKey) or kafka.sasl.password" }}
{{- end }}
{{- if and .Values.kafka.sasl.users (not (include "ratchet.kafkaSasl" .)) }}
{{- fail "kafka.sasl.users is set but kafka.sasl.mechanism is empty: per-component users need SASL" }}
{{- end }}
{{- if and (include "ratchet.kafkaSasl" .) (not (hasPrefix "SASL_" .Values.kafka.securityProtocol)) }}
{{- fail "kafka.sasl.mechanism is set but kafka.securityProtocol is not SASL_PLAINTEXT or SASL_SSL" }}
{{- end }}
{{- if and (hasPrefix "SASL_" .Values.kafka.securityProtocol) (not (include "ratchet.kafkaSasl" .)) }}
{{- fail (printf "kafka.securityProtocol is %s but kafka.sasl.mechanism is empty: set kafka.sasl.mechanism (PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512), kafka.sasl.username and its password" .Values.kafka.securityProtocol) }}
{{- end }}
{{- if and (not .Values.kafka.allowInsecure) (ne .Values.kafka.securityProtocol "SASL_SSL") }}
{{- fail (printf "kafka.securityProtocol is %s: whoever reaches the brokers could write the groups the learner trains on and the ratings it learns from. Set kafka.securityProtocol=SASL_SSL with kafka.sasl (mechanism, username, password) and kafka.tls.caSecret, or kafka.allowInsecure=true for a cluster where only Ratchet can reach Kafka" .Values.kafka.securityProtocol) }}
{{- end }}
{{- if and (not .Values.redis.allowInsecure) (not (include "ratchet.redisAuth" .)) }}
{{- fail "redis has no password: whoever reaches Redis would control routing (which version answers). Set redis.auth.existingSecret (and passwordKey) or redis.auth.password, or redis.allowInsecure=true for a Redis only Ratchet can reach" }}
{{- end }}
{{- if and .Values.redis.tls.caSecret (not (hasPrefix "rediss://" .Values.redis.url)) }}
{{- fail "redis.tls.caSecret is set but redis.url does not start with rediss://" }}
{{- end }}
{{- if and (include "ratchet.judgeModelUsed" .) .Values.judge.existingSecret (or .Values.judge.apiKey .Values.judge.providerKeys) }}
{{- fail "judge.existingSecret is set together with judge.apiKey or judge.providerKeys: put those keys into the Secret (RATCHET_JUDGE__JUDGE_API_KEY for the judge model's key), or unset judge.existingSecret" }}
{{- end }}
{{- if and (include "ratchet.judgeModelUsed" .) .Values.judge.apiKey (hasKey .Values.judge.providerKeys "RATCHET_JUDGE__JUDGE_API_KEY") }}
{{- fail "judge.apiKey and judge.providerKeys.RATCHET_JUDGE__JUDGE_API_KEY are both set: keep one" }}
{{- end }}
{{- if and .Values.learner.enabled (not .Values.vllm.enabled) (not .Values.adapters.existingClaim) }}
{{- fail "learner.enabled is true with an existing vLLM (vllm.enabled=false) but adapters.existingClaim is empty: the learner must write the adapter store your vLLM reads (VLLM_LORA_RESOLVER_CACHE_DIR). Set adapters.existingClaim to that volume's claim, or learner.enabled=false" }}
{{- end }}
{{- /* A setting the values leave out takes the service's default (_settings-defaults.tpl). */}}
{{- $defaults := include "ratchet.settingsDefaults" . | fromYaml }}
{{- if and .Values.learner.enabled .Values.vllm.enabled }}
{{- $rank := dig "lora" "rank" $defaults.learner.lora.rank (.Values.learner.config | default dict) }}
{{- if gt (int $rank) (int .Values.vllm.maxLoraRank) }}
{{- fail (printf "learner.config.lora.rank (%d) is above vllm.maxLoraRank (%d): vLLM would refuse every adapter the learner writes. Lower lora.rank or raise vllm.maxLoraRank" (int $rank) (int .Values.vllm.maxLoraRank)) }}
{{- end }}
{{- end }}
{{- range $name, $alias := .Values.aliases }}
{{- $gate := ($alias | default dict).gate | default dict }}
{{- $min := dig "min_pairs" $defaults.aliases.gate.min_pairs $gate }}
{{- $max := dig "max_pairs" $defaults.aliases.gate.max_pairs $gate }}
{{- if lt (int $max) (int $min) }}
{{- fail (printf "aliases.%s.gate.max_pairs (%d) is below gate.min_pairs (%d): no gate could ever pass. Raise max_pairs (default %d) or lower min_pairs" $name (int $max) (int $min) (int $defaults.aliases.gate.max_pairs)) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
ratchet.yaml, as the services read it (ratchet/settings/; unknown keys are refused there).
Secrets never appear here: they come in as RATCHET_* environment variables.
*/}}
{{- define "ratchet.config" -}}
{{- $served := include "ratchet.servedName" . }}
{{- $kafka := dict "security_protocol" .Values.kafka.securityProtocol }}
{{- /* A Kafka value left out takes the services' default (the `kafka` section of the settings). */}}
{{- with .Values.kafka.topics }}
{{- if .partitions }}{{ $_ := set $kafka "topic_partitions" (int .partitions) }}{{ end }}
{{- if .replication }}{{ $_ := set $kafka "topic_replication" (int .replication) }}{{ end }}
{{- if .retentionMs }}{{ $_ := set $kafka "topic_retention_ms" (int64 .retentionMs) }}{{ end }}
{{- end }}
{{- with .Values.kafka.compression }}{{ $_ := set $kafka "compression" . }}{{ end }}
{{- with .Values.kafka.idempotence }}{{ $_ := set $kafka "idempotence" . }}{{ end }}
{{- with .Values.kafka.sessionTimeoutMs }}{{ $_ := set $kafka "session_timeout_ms" (int .) }}{{ end }}
{{- if .Values.kafka.sasl.mechanism }}
{{- $_ := set $kafka "sasl_mechanism" .Values.kafka.sasl.mechanism }}
{{- $_ := set $kafka "sasl_username" .Values.kafka.sasl.username }}
{{- end }}
{{- if .Values.kafka.tls.caSecret }}
{{- $_ := set $kafka "ssl_cafile" (printf "/etc/ratchet/kafka-ca/%s" .Values.kafka.tls.caKey) }}
{{- end }}
{{- $proxy := deepCopy (.Values.proxy.config | default dict) }}
{{- $_ := set $proxy "host" .Values.proxy.bindAddress }}
{{- $_ := set $proxy "port" (int .Values.proxy.port) }}
{{- $aliases := include "ratchet.aliases" . | fromYaml }}
{{- $config := dict "kafka_bootstrap_servers" .Values.kafka.bootstrapServers "redis_url" (include "ratchet.redisUrl" .) "vllm_url" (include "ratchet.vllmUrl" .) "home" .Values.state.mountPath "state_dir" (printf "%s/state" .Values.state.mountPath) "store_dir" .Values.adapters.mountPath "kafka" $kafka "proxy" $proxy "aliases" $aliases }}
{{- if include "ratchet.vllmReplicasService" . }}
{{- $_ := set $config "vllm_endpoints" (list (printf "http://%s-vllm-replicas:%d" (include "ratchet.fullname" .) (int .Values.vllm.port))) }}
{{- end }}
{{- /* A service's section is written only when it runs, so a release without it never depends
  on settings it does not have yet. Metrics listen on the pod network for probes and Prometheus. */}}
{{- /* The learner's gate calls the judge model with the judge's settings, so the judge section is
  there whenever either runs. */}}
{{- if include "ratchet.judgeModelUsed" . }}
{{- $judge := deepCopy (.Values.judge.config | default dict) }}
{{- $_ := set $judge "metrics_host" "0.0.0.0" }}
{{- $_ := set $judge "metrics_port" (int .Values.judge.metricsPort) }}
{{- $_ := set $config "judge" $judge }}
{{- end }}
{{- if .Values.learner.enabled }}
{{- $learner := deepCopy (.Values.learner.config | default dict) }}
{{- if and (not (hasKey $learner "device")) (gt (int .Values.learner.gpu.count) 0) }}
{{- $_ := set $learner "device" "cuda" }}
{{- end }}
{{- /* The weights vLLM serves, and the value every adapter's base_model_name_or_path must carry. */}}
{{- $_ := set $learner "base_model_path" .Values.model.name }}
{{- $_ := set $learner "metrics_host" "0.0.0.0" }}
{{- $_ := set $learner "metrics_port" (int .Values.learner.metricsPort) }}
{{- $_ := set $config "learner" $learner }}
{{- end }}
{{- if .Values.console.enabled }}
{{- $console := deepCopy (.Values.console.config | default dict) }}
{{- /* On the pod network for the Service and the probes; it needs the admin key there. */}}
{{- $_ := set $console "host" "0.0.0.0" }}
{{- $_ := set $console "port" (int .Values.console.port) }}
{{- /* Host names served (audit N-13): the configured ones, else the console Service's own names,
never any; a name an ingress serves it under must be added to console.config.allowed_hosts. */}}
{{- if not $console.allowed_hosts }}
{{- $service := printf "%s-console" (include "ratchet.fullname" .) }}
{{- $namespaced := printf "%s.%s" $service .Release.Namespace }}
{{- $_ := set $console "allowed_hosts" (list $service $namespaced (printf "%s.svc" $namespaced) (printf "%s.svc.cluster.local" $namespaced)) }}
{{- end }}
{{- /* Its health panel asks the proxy through the proxy's Service, not its own pod. */}}
{{- if .Values.proxy.enabled }}
{{- $_ := set $console "proxy_url" (printf "http://%s-proxy:%d" (include "ratchet.fullname" .) (int .Values.proxy.port)) }}
{{- /* Its counters from every replica: a headless Service's name resolves to each pod. */}}
{{- $_ := set $console "proxy_metrics_url" (printf "http://%s-proxy-replicas:%d" (include "ratchet.fullname" .) (int .Values.proxy.port)) }}
{{- end }}
{{- if .Values.judge.enabled }}
{{- $_ := set $console "judge_metrics_url" (printf "http://%s-judge-replicas:%d" (include "ratchet.fullname" .) (int .Values.judge.metricsPort)) }}
{{- end }}
{{- $_ := set $config "console" $console }}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{/*
The aliases as ratchet.yaml holds them: the values' map (or one alias "support" when it is
empty), with base_model and reward.judge_model defaulting to the base model's served name.
*/}}
{{- define "ratchet.aliases" -}}
{{- $served := include "ratchet.servedName" . }}
{{- $aliases := dict }}
{{- range $name, $cfg := (.Values.aliases | default (dict "support" dict)) }}
{{- $alias := deepCopy ($cfg | default dict) }}
{{- if not (hasKey $alias "base_model") }}
{{- $_ := set $alias "base_model" $served }}
{{- end }}
{{- $reward := $alias.reward | default dict }}
{{- if not (hasKey $reward "judge_model") }}
{{- $_ := set $reward "judge_model" (printf "hosted_vllm/%s" $served) }}
{{- end }}
{{- $_ := set $alias "reward" $reward }}
{{- $_ := set $aliases $name $alias }}
{{- end }}
{{- toYaml $aliases }}
{{- end }}

{{/*
Pod annotations that roll the pods when their configuration changes.
*/}}
{{- define "ratchet.checksums" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- if include "ratchet.chartSecretNeeded" . }}
checksum/secret: {{ include (print .Template.BasePath "/secret.yaml") . | sha256sum }}
{{- end }}
{{- with include "ratchet.serverSecretChecksum" . }}
{{ . }}
{{- end }}
{{- end }}

{{/*
The data of the chart's server Secret, as JSON: the values already in the cluster (lookup, on
upgrade) or random ones, drawn once per render and shared by every template that asks, so the
Secret and the checksums of the pods that read it agree.
*/}}
{{- define "ratchet.serverSecretData" -}}
{{- if not (hasKey .Values.secret "__drawn") }}
{{- $existing := (lookup "v1" "Secret" .Release.Namespace (include "ratchet.serverSecretName" .)).data | default dict }}
{{- $secret := get $existing "ratchet-secret" | default (randAlphaNum 64 | b64enc) }}
{{- $vllmKey := get $existing "vllm-api-key" | default (randAlphaNum 48 | b64enc) }}
{{- $_ := set .Values.secret "__drawn" (dict "ratchet-secret" $secret "vllm-api-key" $vllmKey) }}
{{- end }}
{{- get .Values.secret "__drawn" | toJson }}
{{- end }}

{{/*
Rolls a pod when the chart's server Secret changes: only when its values do, since upgrades read
them back (a render without a cluster draws new ones every time, and rolls every time). A
Secret the user manages is invisible to the chart: after rotating it, restart vLLM and the
services together.
*/}}
{{- define "ratchet.serverSecretChecksum" -}}
{{- if include "ratchet.serverSecretWritten" . -}}
checksum/server-secret: {{ include "ratchet.serverSecretData" . | sha256sum }}
{{- end }}
{{- end }}

{{/*
Environment of every Ratchet container. Secrets are not in it: they are files in the secrets
volume (ratchet.secretsVolume), read through RATCHET_SECRETS_DIR, so that a process the
service starts, a crash report or `kubectl describe` never carries them.
*/}}
{{- define "ratchet.env" -}}
- name: RATCHET_CONFIG
  value: /etc/ratchet/ratchet.yaml
- name: RATCHET_SECRETS_DIR
  value: {{ include "ratchet.secretsDir" . }}
- name: HOME
  value: /tmp
- name: PYTHONUNBUFFERED
  value: "1"
- name: PYTHONDONTWRITEBYTECODE
  value: "1"
{{- end }}

{{/*
The Kafka user of one component when kafka.sasl.users names one (its password is in the secrets
volume): include with (dict "ctx" $ "component" "judge") after ratchet.env.
*/}}
{{- define "ratchet.kafkaUserEnv" -}}
{{- with get .ctx.Values.kafka.sasl.users .component }}
- name: RATCHET_KAFKA__SASL_USERNAME
  value: {{ .username | quote }}
{{- end }}
{{- end }}

{{- define "ratchet.secretsDir" -}}
/var/run/secrets/ratchet
{{- end }}

{{/*
The secret files of one component, each named as the setting's variable (RATCHET_SECRET, ...):
include with (dict "ctx" $ "component" "proxy"). Only what that component uses: the server
secret and the Kafka and Redis passwords for all; vLLM's key for those that call vLLM (not the
console, which reads only its open /health); the client keys for the proxy; the admin key for
the proxy and the console.
*/}}
{{- define "ratchet.secretsVolume" -}}
{{- $ := .ctx }}
{{- $component := .component }}
- name: secrets
  projected:
    # Group-readable: the pod's fsGroup, which the non-root user is in, owns the files.
    defaultMode: 0440
    sources:
      - secret:
          name: {{ include "ratchet.serverSecretName" $ }}
          items:
            # Keys client-key hashes, the held-out split and canary stickiness: the same in every pod.
            - key: {{ include "ratchet.serverSecretKey" $ }}
              path: RATCHET_SECRET
            {{- if has $component (list "proxy" "judge" "learner") }}
            - key: {{ include "ratchet.vllmApiKeyKey" $ }}
              path: RATCHET_VLLM_API_KEY
            {{- end }}
      {{- if include "ratchet.redisAuth" $ }}
      - secret:
          name: {{ include "ratchet.redisSecretName" $ }}
          items:
            - key: {{ include "ratchet.redisPasswordKey" $ }}
              path: RATCHET_REDIS_PASSWORD
      {{- end }}
      {{- if include "ratchet.kafkaSasl" $ }}
      {{- with get $.Values.kafka.sasl.users $component }}
      # This component's own Kafka user (kafka.sasl.users).
      - secret:
          name: {{ .existingSecret }}
          items:
            - key: {{ .passwordKey | default "password" }}
              path: RATCHET_KAFKA__SASL_PASSWORD
      {{- else }}
      - secret:
          name: {{ include "ratchet.kafkaSecretName" $ }}
          items:
            - key: {{ include "ratchet.kafkaPasswordKey" $ }}
              path: RATCHET_KAFKA__SASL_PASSWORD
      {{- end }}
      {{- end }}
      {{- if eq $component "proxy" }}
      - secret:
          name: {{ include "ratchet.proxySecretName" $ }}
          items:
            - key: {{ include "ratchet.apiKeysKey" $ }}
              path: RATCHET_PROXY__API_KEYS
      {{- if or $.Values.proxy.adminKey $.Values.proxy.existingSecret }}
      # Optional for the proxy: without it the admin key is off (a Secret may leave it out).
      - secret:
          name: {{ include "ratchet.proxySecretName" $ }}
          optional: true
          items:
            - key: {{ include "ratchet.adminKeyKey" $ }}
              path: RATCHET_PROXY__ADMIN_KEY
      {{- end }}
      {{- if or $.Values.proxy.userVouchingKeys $.Values.proxy.existingSecret }}
      - secret:
          name: {{ include "ratchet.proxySecretName" $ }}
          optional: true
          items:
            - key: {{ if $.Values.proxy.existingSecret }}{{ $.Values.proxy.userVouchingKeysKey }}{{ else }}user-vouching-keys{{ end }}
              path: RATCHET_PROXY__USER_VOUCHING_KEYS
      {{- end }}
      {{- end }}
      {{- if eq $component "console" }}
      # Off loopback the console refuses to start without it: every page and admin action asks
      # for it. Not optional, so a Secret without the key stops the pod with an event naming it
      # instead of a crash loop.
      - secret:
          name: {{ include "ratchet.proxySecretName" $ }}
          items:
            - key: {{ include "ratchet.adminKeyKey" $ }}
              path: RATCHET_PROXY__ADMIN_KEY
      {{- end }}
{{- end }}

{{- define "ratchet.volumeMounts" -}}
- name: config
  mountPath: /etc/ratchet
  readOnly: true
- name: secrets
  mountPath: {{ include "ratchet.secretsDir" . }}
  readOnly: true
- name: state
  mountPath: {{ .Values.state.mountPath }}
- name: tmp
  mountPath: /tmp
{{- if .Values.kafka.tls.caSecret }}
- name: kafka-ca
  mountPath: /etc/ratchet/kafka-ca
  readOnly: true
{{- end }}
{{- if .Values.redis.tls.caSecret }}
- name: redis-ca
  mountPath: /etc/ratchet/redis-ca
  readOnly: true
{{- end }}
{{- end }}

{{- define "ratchet.volumes" -}}
- name: config
  configMap:
    name: {{ include "ratchet.fullname" . }}-config
- name: state
  emptyDir:
    sizeLimit: {{ .Values.state.sizeLimit }}
- name: tmp
  emptyDir:
    sizeLimit: 1Gi
{{- if .Values.kafka.tls.caSecret }}
- name: kafka-ca
  secret:
    secretName: {{ .Values.kafka.tls.caSecret }}
    items:
      - key: {{ .Values.kafka.tls.caKey }}
        path: {{ .Values.kafka.tls.caKey }}
{{- end }}
{{- if .Values.redis.tls.caSecret }}
- name: redis-ca
  secret:
    secretName: {{ .Values.redis.tls.caSecret }}
    items:
      - key: {{ .Values.redis.tls.caKey }}
        path: {{ .Values.redis.tls.caKey }}
{{- end }}
{{- end }}

{{/*
Pod-level settings every Ratchet pod shares.
*/}}
{{- define "ratchet.podCommon" -}}
serviceAccountName: {{ include "ratchet.serviceAccountName" . }}
# Service links would put <SERVICE>_PORT variables such as RATCHET_PROXY_PORT into the
# environment, next to the RATCHET_* settings.
enableServiceLinks: false
automountServiceAccountToken: {{ .Values.serviceAccount.automountToken }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}
