"""What the control plane may ask of the Kubernetes API: the kernel launcher (`cluster/kubernetes.py`) makes only
these calls, and the Helm chart's Role grants exactly these (both are tested against this list, so code, chart
and RBAC cannot drift apart). Kernel Pods themselves get no API access."""

RULES = ({"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "delete", "get", "list", "watch"]},)
