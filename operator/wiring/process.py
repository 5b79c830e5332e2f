"""`warmfleet operator run`'s process: the /healthz + /metrics endpoint, then kopf, at once or only while this process holds the leader Lease (--leader-election)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from warmfleet.operator.passes.operator_metrics import OperatorMetrics, serve

log = logging.getLogger("warmfleet.operator")
SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
DEFAULT_LEASE_NAME = "warmfleet-operator"


@dataclass(frozen=True)
class Election:
    """Where the Lease lives and who we are: --lease-name, --lease-namespace (POD_NAMESPACE), --identity (POD_NAME)."""

    name: str
    namespace: str
    identity: str


def election_from(args: Any) -> Election | None:
    """The election the flags ask for, or None (--leader-election off: one process, reconciling at once)."""
    if not getattr(args, "leader_election", False):
        return None
    namespace = (args.lease_namespace or os.environ.get("POD_NAMESPACE")
                 or (SA_NAMESPACE_FILE.read_text().strip() if SA_NAMESPACE_FILE.is_file() else "default"))
    identity = args.identity or os.environ.get("POD_NAME") or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
    return Election(name=args.lease_name, namespace=namespace, identity=identity)


def health_address(url: str | None) -> tuple[str, int] | None:
    """host and port of the --liveness URL (http://0.0.0.0:8080/healthz), which serves /healthz and /metrics."""
    if not url:
        return None
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.port is None:
        raise ValueError(f"--liveness must be http://HOST:PORT/healthz, got {url!r}")
    return parts.hostname or "0.0.0.0", parts.port


def run_operator(args: Any) -> int:
    """Run until SIGTERM/SIGINT; exit code 1 when leadership was lost (the pod restarts as a standby)."""
    import kopf

    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.PLAIN)
    return asyncio.run(_main(args, election_from(args), health_address(args.liveness)))


async def _main(args: Any, election: Election | None, address: tuple[str, int] | None) -> int:
    from warmfleet.operator.passes.leader_election import LeadershipLost

    metrics = OperatorMetrics()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # kopf installs its own while it runs (it stops on them too)
        loop.add_signal_handler(sig, stop.set)
    state: dict[str, Any] = {"role": "leader" if election is None else "standby", "kopf": None}
    runner = await serve(metrics, *address, lambda: _health(state)) if address else None
    try:
        if election is None:
            metrics.set_leader(True)
            return await _kopf(args, metrics, None, stop, state)
        return await _elected(args, election, metrics, stop, state)
    except LeadershipLost as exc:  # never reconcile beside the next leader: end the process now
        log.error("%s; exiting", exc)
        logging.shutdown()
        sys.stdout.flush()
        os._exit(1)
    finally:
        if runner is not None:
            await runner.cleanup()


def _health(state: dict[str, Any]) -> dict[str, Any] | None:
    """Healthy unless kopf ended while this process still says it leads."""
    task = state.get("kopf")
    if state["role"] == "leader" and task is not None and task.done():
        return None
    return {"status": "ok", "role": state["role"]}


async def _elected(args: Any, election: Election, metrics: OperatorMetrics, stop: asyncio.Event,
                   state: dict[str, Any]) -> int:
    from warmfleet.kube import Kube
    from warmfleet.operator.passes.kube_client import FIELD_MANAGER
    from warmfleet.operator.passes.leader_election import LEASE_RESOURCES, LeaderElector, run_elected

    kube = await Kube.from_environment(LEASE_RESOURCES, field_manager=FIELD_MANAGER)
    elector = LeaderElector(kube, election.name, election.namespace, election.identity)
    log.info("standby for Lease %s/%s as %s", election.namespace, election.name, election.identity)

    def changed(leading: bool) -> None:
        state["role"] = "leader" if leading else "standby"
        metrics.set_leader(leading)

    try:
        return await run_elected(elector, lambda flag: _kopf(args, metrics, elector.is_leader, flag, state),
                                 stop, on_change=changed)
    finally:
        await kube.close()


async def _kopf(args: Any, metrics: OperatorMetrics, leading: Any, stop: asyncio.Event, state: dict[str, Any]) -> int:
    """kopf with our registry until `stop` is set or a signal comes."""
    import kopf

    from warmfleet.operator.wiring.handlers import make_registry

    registry = make_registry(default_image=args.default_image, router_image=args.router_image,
                             engine_images=getattr(args, "engine_images", ()),
                             router_url_template=args.router_url_template,
                             autoscale_interval_s=args.autoscale_interval, metrics=metrics, leading=leading)
    state["kopf"] = asyncio.ensure_future(kopf.operator(
        registry=registry, clusterwide=not args.namespaces, namespaces=args.namespaces,
        standalone=True, stop_flag=stop))
    await state["kopf"]
    return 0
