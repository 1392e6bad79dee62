"""Names changed in fedsd 0.2 (each word means one thing): an old node-config key still
works for one release, with a note naming its new name."""
import re
import warnings
from pathlib import Path

import pytest

from fedsd.app.client.node_config import NodeConfigError, parse
from fedsd.errors import FedsdNote

ROOT = Path(__file__).resolve().parents[2]


def test_old_node_config_key_noise_still_works_with_a_note(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        node = parse({"partition-id": 0, "state-dir": str(tmp_path), "noise": "seeded"})
    assert node.randomness == "seeded"
    notes = [str(w.message) for w in caught if issubclass(w.category, FedsdNote)]
    assert notes == ["node-config noise: renamed randomness in fedsd 0.2 (write randomness=seeded); noise= still "
                     "works in this release"]


def test_the_new_key_gives_no_note_and_both_are_refused(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parse({"partition-id": 0, "state-dir": str(tmp_path), "randomness": "secret"}).randomness == "secret"
    with pytest.raises(NodeConfigError, match="node-config noise and randomness: noise is randomness's old name"):
        parse({"partition-id": 0, "state-dir": str(tmp_path), "noise": "seeded", "randomness": "secret"})


@pytest.mark.parametrize("old,name,new", [("fedsd.data", "locate", "fedsd.data.datasets"),
                                          ("fedsd.privacy", "plan", "fedsd.privacy.accounting"),
                                          ("fedsd.settings", "setting", "fedsd.settings.declared")])
def test_a_name_of_an_old_module_that_became_a_package_says_where_it_is(old, name, new):
    import importlib

    assert hasattr(importlib.import_module(new), name)
    with pytest.raises(ImportError, match=f"{old} is a package since fedsd 0.2, and {name} is in {new}"):
        exec(f"from {old} import {name}", {})
    assert not hasattr(importlib.import_module(old), "no_such_name")  # anything else: an AttributeError


def test_the_deployment_guide_has_a_row_for_every_node_config_key():
    """clients/README.md's node-config table names each key the node reads, by its current name."""
    from fedsd.app.client.node_config import KEYS, RENAMED_KEYS

    rows = {name for line in (ROOT / "clients" / "README.md").read_text().splitlines() if line.startswith("| `")
            for name in re.findall(r"`([a-z0-9-]+)`", line.split("|")[1])}
    assert sorted(set(KEYS) - rows) == []
    assert not set(RENAMED_KEYS) & rows  # an old name is not documented as a key


def test_a_method_plugin_of_fedsd_0_1_still_gets_its_settings_base_class_with_a_note():
    from fedsd.methods import MethodConfig, SelfDistillationConfig

    with pytest.warns(FedsdNote, match="fedsd.methods.MethodSettings: renamed MethodConfig in fedsd 0.2"):
        from fedsd.methods import MethodSettings
    with pytest.warns(FedsdNote, match="SelfDistillationSettings: renamed SelfDistillationConfig"):
        from fedsd.methods import SelfDistillationSettings
    assert (MethodSettings, SelfDistillationSettings) == (MethodConfig, SelfDistillationConfig)
