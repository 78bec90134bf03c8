"""The local launcher on the torch releases the package admits: torch 2.11's ``LaunchConfig`` (the one
a lent GPU machine has) has no ``shutdown_timeout`` field, and ``gridshard train --nproc N`` stopped
there before any worker started ("unexpected keyword argument"). The launcher passes the field only
where it exists; the agent's own 30 s wait applies on 2.11."""
import dataclasses

import pytest
import torch.distributed.launcher.api as api

from gridshard.launch import SHUTDOWN_TIMEOUT_S, launch_local


def _launch_with(monkeypatch, config_cls) -> object:
    seen = {}
    monkeypatch.setattr(api, "LaunchConfig", config_cls)
    monkeypatch.setattr(api, "elastic_launch", lambda config, fn: (lambda *a: seen.setdefault("config", config)))
    launch_local(2, print)
    return seen["config"]


def test_the_shutdown_wait_is_passed_where_launch_config_takes_it(monkeypatch):
    if "shutdown_timeout" not in api.LaunchConfig.__dataclass_fields__:
        pytest.skip("this torch's LaunchConfig has no shutdown_timeout (the next test is its case)")
    config = _launch_with(monkeypatch, api.LaunchConfig)
    assert config.shutdown_timeout == SHUTDOWN_TIMEOUT_S and config.nproc_per_node == 2


def test_a_launch_config_without_the_field_torch_2_11_is_built_without_it(monkeypatch):
    names = [f.name for f in dataclasses.fields(api.LaunchConfig) if f.name != "shutdown_timeout"]
    config_211 = dataclasses.make_dataclass("LaunchConfig", [(n, object, dataclasses.field(default=None))
                                                             for n in names])
    config = _launch_with(monkeypatch, config_211)
    assert not hasattr(config, "shutdown_timeout") and config.nproc_per_node == 2
    assert config.signals_to_handle == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
