"""docs/troubleshooting.md (which the chart's NOTES and docs/gpu-cluster.md send users to) explains every condition
reason the operator writes: collected from the operator's own code, so a new reason without a row fails."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from warmfleet import fetch
from warmfleet.operator.passes import model_config
from warmfleet.operator.planning import diagnose, gateway, service_status

DOC = (Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md").read_text()


def condition_reasons() -> set[str]:
    status = inspect.getsource(service_status)
    reasons = set(re.findall(r'_cond\("\w+", (?:True|False), "(\w+)"', status))
    reasons |= set(re.findall(r'reason, message = "(\w+)"', status))
    reasons |= {diagnose.MISSING_PVC, diagnose.MISSING_SECRET, diagnose.IMAGE_PULL, diagnose.CRASH_LOOP,
                diagnose.UNSCHEDULABLE, diagnose.STARTING, gateway.GIE_MISSING, gateway.GATEWAY_API_MISSING}
    reasons |= set(re.findall(r'reason="(\w+)"', inspect.getsource(model_config)))
    reasons |= set(re.findall(r'FetchError\("(\w+)"', inspect.getsource(fetch)))  # fetch-model's, also in config.json reads
    return reasons


def test_every_reason_the_operator_writes_has_a_row():
    reasons = condition_reasons()
    assert {"AllReplicasReady", "NoMatchingNodes", "InsufficientCapacity", "NotReady", "ScaledToZero", "SpecValid",
            "EndpointPickerUnavailable", "NotAccepted", "NotInstalled", "NotWritable"} <= reasons  # the collection works
    missing = sorted(r for r in reasons if f"`{r}`" not in DOC)
    assert not missing, f"docs/troubleshooting.md has no row for: {missing}"


def test_the_reason_column_is_explained_in_the_operators_order():
    """The Ready table lists the pod reasons most severe first, as the operator ranks them."""
    ranked = sorted(diagnose._RANK, key=diagnose._RANK.get)
    table = DOC.split("## Ready reasons", 1)[1].split("\n## ", 1)[0]
    positions = [table.index(f"| `{r}` |") for r in ranked]
    assert positions == sorted(positions), ranked
