"""vLLM's own argument parser and EngineArgs read the LoRA flags and env the operator renders for spec.lora (no
engine start: `make test-vllm` runs it in the cached vLLM environment)."""

from __future__ import annotations

import json
import os
import subprocess

from warmfleet.operator.passes.reconcile import render
from warmfleet.operator.planning.nodes import node_info
from warmfleet.operator.planning.objects import Images

from .conftest import L4_NODE

PARSE = """
import json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.engine.arg_utils import EngineArgs
import vllm.envs as envs
ns = make_arg_parser(FlexibleArgumentParser()).parse_args(json.loads(sys.argv[1]))
ea = EngineArgs.from_cli_args(ns)
print(json.dumps({"enable_lora": ea.enable_lora, "max_loras": ea.max_loras, "max_lora_rank": ea.max_lora_rank,
                  "max_cpu_loras": ea.max_cpu_loras, "lora_modules": getattr(ns, "lora_modules", None),
                  "runtime_updating": envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING}))
"""


def test_vllm_parses_the_rendered_lora_flags_and_allows_runtime_updates(vllm_python, tmp_path):
    svc = {"apiVersion": "serving.warmfleet.io/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": "tiny", "namespace": "default", "uid": "u", "generation": 1},
           "spec": {"model": {"path": "/models/m", "hiddenSize": 512, "dtype": "float32"},
                    "engine": {"kind": "vllm", "image": "vllm/vllm-openai:v0.32.0"},
                    "lora": {"maxLoras": 3, "maxCpuLoras": 7, "maxLoraRank": 32,
                             "modelShape": {"numLayers": 2, "intermediateSize": 1024}},
                    "adapters": [{"name": "a", "source": "/adapters/a"}]}}
    deps = [o for o in render(svc, [node_info(L4_NODE)], Images("e", "r")) if o["kind"] == "Deployment"
            and o["metadata"]["labels"]["app.kubernetes.io/component"] == "server"]
    container = next(c for c in deps[0]["spec"]["template"]["spec"]["containers"] if c["name"] == "server")
    env = dict(os.environ, **{e["name"]: e["value"] for e in container["env"] if "value" in e})
    out = subprocess.run([vllm_python, "-c", PARSE, json.dumps(container["args"])], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"enable_lora": True, "max_loras": 3, "max_lora_rank": 32, "max_cpu_loras": 7, "lora_modules": None,
                   "runtime_updating": True}
