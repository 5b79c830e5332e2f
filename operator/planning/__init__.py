"""Room 2, pure planning: spec + nodes → pools, sizes, children, status; imports spec/ only, never kopf or an HTTP or Kubernetes client."""
