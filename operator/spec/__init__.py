"""Room 1, the InferenceService's shape: spec and status types, schema machinery, CRD writers, shared names; imports no other room."""
