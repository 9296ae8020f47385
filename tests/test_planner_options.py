"""The evolving planner's settings as NAME=VALUE options (`planner/options.py`) and where they
go: `SimConfig`, the slices a longer window needs, the evolving policy's planner."""

from __future__ import annotations

import pytest

from evolving_infra.planner import options
from evolving_infra.planner.evolving import EvolvingPlanner
from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.policies import PolicyContext, policy
from evolving_infra.timing import DEFAULT_DEPLOYMENT
from evolving_infra.timing.model import IterationModel


def test_options_parse_to_their_types() -> None:
    assert options.parse("min_gain=0.04") == ("min_gain", 0.04)
    assert options.parse(" slices =20") == ("slices", 20)
    assert options.parse("max_step=none") == ("max_step", None)
    assert options.parse("recent=None") == ("recent", None)
    with pytest.raises(ValueError, match="needs a number"):
        options.parse("alpha=none")  # only the settings that default to None take none
    with pytest.raises(ValueError, match="twice"):
        options.check((("alpha", 0.1), ("alpha", 0.2)))
    with pytest.raises(ValueError, match="unknown"):
        options.check((("nodes_total", 3.0),))  # the driver's, not an option


def test_the_config_hands_them_to_the_evolving_planner_and_slices_its_window() -> None:
    config = SimConfig(planner_options=(("window_s", 1200.0), ("slices", 20), ("min_gain", 0.05)))
    assert config.slices_window_s == 1200.0  # the cluster keeps 20 minutes of slices
    assert SimConfig().slices_window_s == SimConfig().planner_window_s
    ctx = PolicyContext(config.nodes, 16, config, IterationModel(prior=DEFAULT_DEPLOYMENT))
    spec = policy("evolving", config.nodes)
    assert spec.planner is not None
    planner = spec.planner(ctx)
    assert isinstance(planner, EvolvingPlanner)
    assert (planner.window_s, planner.slices, planner.min_gain) == (1200.0, 20, 0.05)
    assert config.to_dict(16)["planner_options"] == {
        "window_s": 1200.0,
        "slices": 20,
        "min_gain": 0.05,
    }
    with pytest.raises(ValueError, match="refuses its options"):
        SimConfig(planner_options=(("min_slices", 1),))
