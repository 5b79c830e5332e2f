"""Every kubectl command the docs, the examples and the chart's NOTES show names our kind so that it cannot resolve to
KServe's: `wfis` (our CRD's short name) or `inferenceservices.serving.warmfleet.io`, never the bare plural or
singular, which `serving.kserve.io` also serves."""

from __future__ import annotations

import re
from pathlib import Path

from warmfleet.operator.spec.constants import GROUP, PLURAL, SHORT_NAMES, SINGULAR

REPO = Path(__file__).resolve().parents[1]
# a kubectl command whose resource argument is the bare kind name: `get inferenceservices`, `explain
# inferenceservice.spec`, `delete inferenceservice/x`; `-f examples/inferenceservice.yaml` is a file, not a kind
BARE = re.compile(rf"kubectl\b[^|;&#`\n]*?[\s,](?:{PLURAL}|{SINGULAR})\b(?!\.{re.escape(GROUP)}|[\w.-]*\.ya?ml)")


def shown_to_users() -> list[Path]:
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "examples").glob("*.yaml")),
             *sorted((REPO / "charts").rglob("*.txt")), *sorted((REPO / "charts").rglob("*.yaml"))]
    assert len(files) > 10
    return files


def test_the_crd_short_name_is_wfis_and_not_kserves():
    assert "wfis" in SHORT_NAMES and "isvc" not in SHORT_NAMES


def test_no_kubectl_command_names_the_bare_kind():
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for path in shown_to_users()
             for n, line in enumerate(path.read_text().splitlines(), 1) if BARE.search(line)]
    assert not found, "use `wfis` or inferenceservices." + GROUP + ":\n" + "\n".join(found)


def test_the_pattern_catches_the_commands_it_is_for():
    for bad in ("kubectl get inferenceservices -w", "kubectl explain inferenceservice.spec",
                "kubectl -n ml get inferenceservice qwen", "kubectl scale inferenceservice NAME --replicas=2",
                "kubectl delete inferenceservice/qwen", "kubectl get wfis,inferenceservices"):
        assert BARE.search(bad), bad
    for good in ("kubectl get wfis -w", "kubectl explain inferenceservices.serving.warmfleet.io.spec",
                 "kubectl apply -f examples/inferenceservice.yaml", "kubectl get wfis,inferencepool,httproute",
                 "kubectl apply -f inferenceservice-hf.yaml"):
        assert not BARE.search(good), good
