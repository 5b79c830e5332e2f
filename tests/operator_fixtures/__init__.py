"""Node and InferenceService builders shared by the operator tests."""
