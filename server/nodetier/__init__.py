"""The node tier: one host-memory cache of KV blocks and encoder outputs shared by a service's replicas on a node."""
