"""Names every room shares: the InferenceService's API identity, the labels and annotation of its children; imports nothing."""

GROUP = "serving.warmfleet.io"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["wfis"]  # not `isvc`: KServe owns that one
CATEGORIES = ["warmfleet"]

# Labels of every child and its pods (the operator's watches and the router's discovery select on them)
SIZING_HASH_ANNOTATION = f"{GROUP}/sizing-hash"
SERVICE_LABEL = f"{GROUP}/service"
POOL_LABEL = f"{GROUP}/pool"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY = {"app.kubernetes.io/managed-by": "warmfleet-operator"}
