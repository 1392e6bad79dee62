import os
import warnings
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
if "FEDSD_DATA_DIR" not in os.environ and SHARED_DATA.is_dir():
    os.environ["FEDSD_DATA_DIR"] = str(SHARED_DATA)
warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
warnings.filterwarnings("ignore", message="Full backward hook is firing")


def require(dataset: str):
    from fedsd.data import locate

    if locate(dataset) is None:
        pytest.skip(f"{dataset} not available here")


@pytest.fixture
def flower_task():
    """What Flower's runtime sets before it calls an app or builds a Message."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 11, 1
