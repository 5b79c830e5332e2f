"""`warmfleet operator [run|render|crd]`: run kopf, print the objects for a service offline, or emit the CRD."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterable

import yaml

# The two images a release publishes (README "Images"); the chart passes both with its own tags.
DEFAULT_IMAGE_ENV, ROUTER_IMAGE_ENV = "WARMFLEET_IMAGE", "WARMFLEET_ROUTER_IMAGE"
# The images vLLM and FastDeploy pods run when a service names none (default: their pinned official releases); an
# air-gapped cluster points them at its mirror (chart: operator.defaultImages).
PEER_IMAGE_ENVS = {"vllm": "WARMFLEET_VLLM_IMAGE", "fastdeploy": "WARMFLEET_FASTDEPLOY_IMAGE"}
ENGINE_REPOSITORY, SLIM_REPOSITORY = "ghcr.io/warmfleet/warmfleet", "ghcr.io/warmfleet/warmfleet-slim"


def _release_tag() -> str:
    """This package's version: the tag of the images released with it (never a moving `latest`)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("warmfleet")
    except PackageNotFoundError:
        return "latest"


def _image_flags(p: argparse.ArgumentParser) -> None:
    """--default-image and --router-image, for `run` and `render` alike."""
    p.add_argument("--default-image", default=os.environ.get(DEFAULT_IMAGE_ENV) or f"{ENGINE_REPOSITORY}:{_release_tag()}",
                   help=f"Engine image of `warmfleet` server pods when the service names none (env {DEFAULT_IMAGE_ENV}).")
    p.add_argument("--router-image", default=os.environ.get(ROUTER_IMAGE_ENV) or f"{SLIM_REPOSITORY}:{_release_tag()}",
                   help="Slim image (no Paddle) of router pods and of the fetch-model init step when the service "
                        f"names none (env {ROUTER_IMAGE_ENV}).")
    for kind, env in PEER_IMAGE_ENVS.items():
        p.add_argument(f"--{kind}-image", type=_image_ref, default=os.environ.get(env) or None,
                       help=f"Image of {kind} server pods when the service sets no spec.engine.image (env {env}); "
                            "default: its pinned official release (docs/gpu-cluster.md).")


def _image_ref(text: str) -> str:
    """An image reference as a flag value: one token, no spaces (the registry decides the rest)."""
    if not text or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"not an image reference: {text!r}")
    return text


def default_images(args: argparse.Namespace) -> Any:
    """The operator's default images from its flags: engine, router, and the peer engines' (objects.Images)."""
    from warmfleet.operator.planning import objects

    engines = tuple((kind, image) for kind in PEER_IMAGE_ENVS if (image := getattr(args, f"{kind}_image", None)))
    return objects.Images(engine=args.default_image, router=args.router_image, engines=engines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Subcommands run (default), render and crd."""
    parser.set_defaults(action="run", namespaces=[], liveness="http://0.0.0.0:8080/healthz", verbose=False,
                        leader_election=False, lease_name="warmfleet-operator", lease_namespace=None, identity=None,
                        router_url_template=os.environ.get("WARMFLEET_ROUTER_URL_TEMPLATE") or None,
                        autoscale_interval=float(os.environ.get("WARMFLEET_AUTOSCALE_INTERVAL_S") or 15))
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    run_p = sub.add_parser("run", help="Run the kopf operator (the default).")
    for p in (parser, run_p):
        p.add_argument("--namespace", "-n", dest="namespaces", action="append", default=[],
                       help="Watch only this namespace (repeatable); default: all namespaces.")
        p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                       help="Where /healthz (liveness) and /metrics (the operator's own Prometheus metrics) are served.")
        p.add_argument("--leader-election", action="store_true",
                       help="Reconcile only while holding a coordination.k8s.io Lease (run several replicas; a standby "
                            "takes over within ~20 s of the leader's death).")
        p.add_argument("--lease-name", default="warmfleet-operator", help="The Lease's name (with --leader-election).")
        p.add_argument("--lease-namespace", default=None,
                       help="The Lease's namespace; default: env POD_NAMESPACE, else the service account's namespace.")
        p.add_argument("--identity", default=None,
                       help="This candidate's name in the Lease; default: env POD_NAME, else hostname and a random suffix.")
        p.add_argument("--verbose", action="store_true", help="Debug logging.")
        _image_flags(p)
        p.add_argument("--router-url-template", default=os.environ.get("WARMFLEET_ROUTER_URL_TEMPLATE") or None,
                       help="Where the autoscaler scrapes a service's routers, e.g. http://127.0.0.1:9000 or "
                            "http://{service}.{namespace}.svc:{port} (env WARMFLEET_ROUTER_URL_TEMPLATE); default: "
                            "each Ready router pod by IP.")
        p.add_argument("--autoscale-interval", type=float, default=float(os.environ.get("WARMFLEET_AUTOSCALE_INTERVAL_S") or 15),
                       help="Seconds between two scrapes of each service's routers (env WARMFLEET_AUTOSCALE_INTERVAL_S).")
    render_p = sub.add_parser("render", help="Print the objects the operator would apply, offline.")
    render_p.add_argument("-f", "--filename", required=True, help="YAML with one or more InferenceService objects.")
    render_p.add_argument("--nodes", required=True, help="YAML with Node objects (a List, or several documents).")
    _image_flags(render_p)
    render_p.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml", help="Output format.")
    render_p.add_argument("--strict", action="store_true",
                          help="Exit 1 when there are warnings (no matching node, a pool that fits nothing, clamped sizes).")
    crd_p = sub.add_parser("crd", help="Print the CRD, or regenerate the committed CRD files.")
    crd_p.add_argument("--write", metavar="REPO", help="Write crds/ and the chart's CRD template under this repo root.")


def run(args: argparse.Namespace) -> int:
    """Dispatch to the chosen action."""
    if args.action == "render":
        return render_cmd(args)
    if args.action == "crd":
        return crd_cmd(args)
    return run_operator(args)


def run_operator(args: argparse.Namespace) -> int:
    """Run kopf with our registry until interrupted (wiring/process.py: health, metrics, leader election)."""
    from warmfleet.operator.planning.admin_policy import policy_from_env
    from warmfleet.operator.wiring.process import run_operator as run_process

    try:  # the admin's policy (chart values → env), read again at startup: a bad value stops here, in one line
        policy_from_env(os.environ)
    except ValueError as exc:
        print(f"warmfleet operator: error: {exc}", file=sys.stderr)
        return 2
    args.engine_images = default_images(args).engines  # --vllm-image, --fastdeploy-image (process.py's registry)
    return run_process(args)


def load_docs(path: str) -> list[dict[str, Any]]:
    """YAML documents of a file, with `kind: List` expanded."""
    out: list[dict[str, Any]] = []
    with open(path) as fh:
        for doc in yaml.safe_load_all(fh):
            if not doc:
                continue
            out += doc.get("items", []) if doc.get("kind", "").endswith("List") else [doc]
    return out


def render_warnings(plan: Any) -> list[str]:
    """What a user should know before applying: no matching node, pools that fit nothing, clamped sizes, the engine
    on GPU pools without a GPU backend, GPU memory no source knows."""
    out = []
    if not plan.pools:
        out.append("matches no Ready, schedulable node: no server Deployment would be created "
                   "(check spec.nodeSelector and the nodes' labels)")
    for p in plan.pools:
        if not p.sizing.fits:
            out.append(f"pool {p.pool.name} fits no replica: {p.sizing.message}")
        sources = (p.sizing.inputs.sources if p.sizing.inputs is not None else {}) or {}
        for size, src in sorted(sources.items()):
            if src in ("min", "max"):
                out.append(f"pool {p.pool.name}: {size} clamped to its {src}")
        tier = p.sizing.node_tier
        if tier is not None and tier.message:
            out.append(f"pool {p.pool.name}: no node tier: {tier.message}")
        elif tier is not None and tier.source == "spare":
            out.append(f"pool {p.pool.name}: node tier lowered to the {tier.size_gib:g} GiB a node can spare")
    if plan.pools and plan.capacity < plan.desired:
        out.append(f"{plan.desired} replicas wanted, the pools can host {plan.capacity}")
    out += pool_condition_warnings(plan)
    return out


def pool_condition_warnings(plan: Any) -> list[str]:
    """The EngineFit and GPUMemoryKnown warnings the operator would write (an engine without GPU attention on GPU
    pools, GPU pools of unknown memory), in the status conditions' own words."""
    from warmfleet.operator.planning.service_status import pool_conditions

    return [c.message for c in pool_conditions(plan) if c.status == "False"]


def render_cmd(args: argparse.Namespace) -> int:
    """Print the children of every InferenceService in -f, sized for the nodes in --nodes, then its status.

    The last document per service is the InferenceService with the status the operator would
    write before any pod is ready, under a comment listing the Secrets the operator generates for it
    (generated_secrets.py: never manifests, no key material; with -o json the list goes to stderr).
    Warnings go to stderr; with --strict they make the exit code 1.
    """
    from warmfleet.operator.planning.admin_policy import policy_from_env
    from warmfleet.operator.planning.nodes import node_info
    from warmfleet.operator.spec.constants import KIND

    nodes = [node_info(n) for n in load_docs(args.nodes) if n.get("kind", "Node") == "Node"]
    policy = policy_from_env(os.environ)  # the admin's policy, as the operator reads it (WARMFLEET_HOST_PATH_PREFIXES, ...)
    services = [d for d in load_docs(args.filename) if d.get("kind") == KIND]
    if not services:
        raise ValueError(f"{args.filename} holds no {KIND}")
    objs: list[dict[str, Any]] = []
    comments: list[str] = []
    warned = 0
    for svc in services:
        children, status_doc, notes, secrets = render_service(args, svc, nodes, policy)
        for note in notes:
            print(f"warmfleet operator render: warning: {note}", file=sys.stderr)
        warned += len(notes)
        if secrets and args.output == "json":  # a JSON List has no comments
            sys.stderr.write(secrets)
        objs += [*children, status_doc]
        comments += [""] * len(children) + [secrets]
    sys.stdout.write(dump(objs, args.output, comments))
    return 1 if warned and args.strict else 0


def render_service(args: argparse.Namespace, svc: dict[str, Any], nodes: list[Any], policy: Any,
                   ) -> tuple[list[dict[str, Any]], dict[str, Any], list[str], str]:
    """One InferenceService of `warmfleet operator render`: (its children, the service with the status the operator
    would write, warnings naming it, the comment listing the Secrets the operator generates for it)."""
    from warmfleet.operator.passes import model_config as mc
    from warmfleet.operator.passes.reconcile import owned, plan_for, utcnow
    from warmfleet.operator.planning import gateway, objects
    from warmfleet.operator.planning.generated_secrets import generated_secrets, secrets_comment
    from warmfleet.operator.planning.service_status import healthy_status
    from warmfleet.operator.spec.constants import KIND
    from warmfleet.operator.spec.inference_service import served_name
    from warmfleet.operator.spec.schema import SpecError

    body = dict(svc)
    meta = body["metadata"] = {"namespace": "default", "uid": "00000000-0000-0000-0000-000000000000",
                               **(svc.get("metadata") or {})}
    name = meta.get("name")
    learned = mc.learn_now(body)  # config.json of an hf:// or s3:// source, with this machine's credentials
    try:
        owner, spec, plan = plan_for(body, nodes, default_images(args), learned, policy)
    except SpecError as exc:  # one readable line naming the object (the CLI prints it, exit 2)
        raise SpecError(exc.path, f"{exc.message} ({KIND} {name})") from None
    notes = [f"config.json: {learned.error}"] if learned is not None and learned.error else []
    notes = [f"{KIND} {meta['namespace']}/{name}: {w}" for w in notes + render_warnings(plan)]
    # gateway mode: as on a cluster serving the GIE (and Gateway API) CRDs, before the Gateway has an address
    gw = (gateway.gateway_state(owner, spec, {}, pool_served=True, route_served=True, gateway_obj=None)
          if spec.router.mode == "gateway" else None)
    status = healthy_status(plan=plan, generation=meta.get("generation"), model=served_name(spec, owner.name),
                            endpoint=gw.endpoint if gw is not None else objects.endpoint_url(owner, spec),
                            selector=objects.selector_string(owner), ready_by_pool={}, router_ready=0, previous={},
                            now=utcnow(), gateway=gw)
    status = mc.with_model_config(status, body, learned, utcnow(), meta.get("generation"))
    return (owned(plan.children, body), {**{k: v for k, v in svc.items() if k != "status"}, "status": status}, notes,
            secrets_comment(owner, generated_secrets(owner, spec, plan.pools)))


def dump(objs: Iterable[dict[str, Any]], fmt: str = "yaml", comments: list[str] | None = None) -> str:
    """Objects as YAML documents, each under its comment (`comments`, parallel to `objs`), or a JSON List."""
    objs = list(objs)
    if fmt == "json":
        return json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}, indent=2) + "\n"
    comments = comments or [""] * len(objs)
    return "".join("---\n" + c + yaml.dump(o, Dumper=_Dumper, sort_keys=False, width=120) for o, c in zip(objs, comments))


class _Dumper(yaml.SafeDumper):
    """SafeDumper writing multi-line strings (the sizing report) as literal blocks, without YAML aliases."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def crd_cmd(args: argparse.Namespace) -> int:
    """Print the CRD, or write crds/ and the chart template."""
    from warmfleet.operator.spec.chart_crd import write_chart_crd
    from warmfleet.operator.spec.crd import crd_yaml, write_crd

    if not args.write:
        sys.stdout.write(crd_yaml())
        return 0
    root = Path(args.write)
    print(write_crd(root / "crds"))
    print(write_chart_crd(root / "charts" / "warmfleet" / "templates"))
    return 0
