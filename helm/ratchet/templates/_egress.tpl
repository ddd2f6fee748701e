{{/*
The ports and peers of networkpolicy-egress.yaml.
*/}}

{{/*
A URL's port: its own, else the scheme's (http 80, https 443), else "default".
*/}}
{{- define "ratchet.urlPort" -}}
{{- $url := urlParse .url }}
{{- $port := regexFind ":[0-9]+$" $url.host | trimPrefix ":" }}
{{- if $port }}{{ $port }}
{{- else if eq $url.scheme "https" }}443
{{- else if eq $url.scheme "http" }}80
{{- else }}{{ .default }}
{{- end }}
{{- end }}

{{/*
The Kafka bootstrap servers' ports, as a JSON list (9092 for a server without one).
*/}}
{{- define "ratchet.kafkaPorts" -}}
{{- $ports := list }}
{{- range splitList "," (.Values.kafka.bootstrapServers | default "") }}
{{- $port := regexFind ":[0-9]+$" (trim .) | trimPrefix ":" | default "9092" }}
{{- $ports = append $ports (int $port) }}
{{- end }}
{{- toJson (uniq (default (list 9092) $ports)) }}
{{- end }}

{{/*
The egress rule to vLLM: the inference gateway's listener, the chart's vLLM pods, or the port of
an existing vLLM at vllm.url.
*/}}
{{- define "ratchet.vllmEgress" -}}
{{- $egress := .Values.networkPolicy.egress }}
{{- if .Values.inferenceGateway.enabled }}
# vLLM, through the inference gateway's listener.
- ports:
    - {port: {{ include "ratchet.urlPort" (dict "url" .Values.inferenceGateway.url "default" 80) }}, protocol: TCP}
  {{- with $egress.gatewayTo }}
  to:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- else if .Values.vllm.enabled }}
# vLLM's pods.
- to:
    - podSelector:
        matchLabels:
          {{- include "ratchet.componentSelectorLabels" (dict "ctx" . "component" "vllm") | nindent 10 }}
  ports:
    - {port: {{ int .Values.vllm.port }}, protocol: TCP}
{{- else }}
# The existing vLLM at vllm.url.
- ports:
    - {port: {{ include "ratchet.urlPort" (dict "url" .Values.vllm.url "default" 80) }}, protocol: TCP}
  {{- with $egress.vllmTo }}
  to:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end }}
