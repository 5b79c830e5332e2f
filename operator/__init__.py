"""warmfleet operator: kopf handlers, sizing and manifests; import `warmfleet.operator`."""
