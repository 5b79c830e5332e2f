#!/usr/bin/env bash
# Usage: scripts/otel-proto.sh PYTHON
# xds-protos (the gateway extra: Envoy's ext_proc protos) ships its own, older copy of
# opentelemetry/proto/**/*_pb2.py, which overwrites opentelemetry-proto's when pip installs it later;
# the OTLP exporter (the tracing extra) then fails to import (InstrumentationScope). Reinstalling
# opentelemetry-proto's own files last makes the environment deterministic; Envoy's protos that we use
# import none of them. Does nothing where opentelemetry-proto is not installed.
set -euo pipefail
PY=${1:?usage: scripts/otel-proto.sh PYTHON}
v=$("$PY" -P -c 'import importlib.metadata as m
try: print(m.version("opentelemetry-proto"))
except m.PackageNotFoundError: pass')
[[ -z $v ]] && exit 0
"$PY" -P -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps "opentelemetry-proto==$v"
"$PY" -P -c 'from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter' 2>/dev/null \
  || "$PY" -P -c 'import opentelemetry.proto.common.v1.common_pb2 as c; c.InstrumentationScope'
