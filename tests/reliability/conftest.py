"""One live fleet (two `warmfleet serve` replicas on the tiny checkpoint, one `warmfleet route`) for the fault tests.

Each test gets it with every process running and the router synced with every replica
(`LiveFleet.restore` restarts what an earlier test killed and did not bring back).
"""

from __future__ import annotations

import pytest

from warmfleet.livefleet import LiveFleet

GPU_BLOCKS = 512  # per replica: the load's working set (six tenant prefixes) fits, so hit ratios are steady


@pytest.fixture(scope="package")
def live_fleet(tiny_model_dir, tmp_path_factory):
    # cwd outside the repo: its warmfleet/ folder is only part of the package
    fleet = LiveFleet(tiny_model_dir, tmp_path_factory.mktemp("reliability"),
                      replica_args=("--num-gpu-blocks", str(GPU_BLOCKS)))
    fleet.start()
    try:
        yield fleet
    finally:
        fleet.close()


@pytest.fixture
def fleet(live_fleet):
    live_fleet.restore()
    return live_fleet
