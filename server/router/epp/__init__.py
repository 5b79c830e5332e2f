"""The Endpoint Picker front door: Envoy's ext_proc gRPC (GIE's Endpoint Picker Protocol) over the router core."""
