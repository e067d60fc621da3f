{{/* Building blocks of networkpolicies.yaml. Postgres and Redis are pods of this release (deploy=true) or
     external services reached by CIDR (np.service). */}}
{{- define "gemflow.np.peer" -}}
- podSelector:
    matchLabels:
      app.kubernetes.io/instance: {{ .root.Release.Name }}
      app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "gemflow.np.airflowPeer" -}}
- podSelector:
    matchLabels:
      tier: airflow
{{- end -}}

{{- define "gemflow.np.dns" -}}
- to:
    - namespaceSelector:
        matchLabels:
          kubernetes.io/metadata.name: kube-system
      podSelector:
        matchLabels:
          k8s-app: kube-dns
  ports:
    - {protocol: UDP, port: 53}
    - {protocol: TCP, port: 53}
{{- end -}}

{{- define "gemflow.np.to" -}}
- to:
    {{- range .components }}
    {{- include "gemflow.np.peer" (dict "root" $.root "component" .) | nindent 4 }}
    {{- end }}
  ports:
    - {protocol: TCP, port: {{ .port }}}
{{- end -}}

{{- define "gemflow.np.cidr" -}}
- to:
    - ipBlock:
        cidr: {{ .cidr }}
  ports:
    {{- range .ports }}
    - {protocol: TCP, port: {{ . }}}
    {{- end }}
{{- end -}}

{{- define "gemflow.np.service" -}}
{{- $svc := index .root.Values .component -}}
- to:
    {{- if $svc.deploy }}
    {{- include "gemflow.np.peer" (dict "root" .root "component" .component) | nindent 4 }}
    {{- else }}
    - ipBlock:
        cidr: {{ required (printf "%s.cidr is required when %s.deploy=false and network policies are on" .component .component) $svc.cidr }}
    {{- end }}
  ports:
    - {protocol: TCP, port: {{ $svc.port }}}
{{- end -}}
