"""ElasticRayExecutor's arguments, without a Ray cluster: Horovod's settings and what is refused.

Its behaviour on a real cluster (a killed worker, a joiner) is
tests/cluster/test_ray_cluster.py::test_elastic_ray_executor_shrinks_in_place_then_grows.
"""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'ringtrain[ray]'")

from ringtrain.errors import ConfigError
from ringtrain.ray import ElasticRayExecutor


def test_create_settings_takes_both_of_horovods_spellings_and_its_defaults() -> None:
    old = ElasticRayExecutor.create_settings(min_np=2, max_np=4, reset_limit=3)
    new = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=4, reset_limit=3)
    assert old == new
    assert (old.min_num_proc, old.max_num_proc, old.reset_limit) == (2, 4, 3)
    default = ElasticRayExecutor.create_settings()
    assert (default.min_num_proc, default.max_num_proc) == (1, None)
    assert (default.elastic_timeout, default.timeout_s) == (600, 30)


def test_what_ringtrain_cannot_honour_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="cooldown_range"):
        ElasticRayExecutor.create_settings(cooldown_range=(10, 100))
    with pytest.raises(ConfigError, match="no_such_setting"):
        ElasticRayExecutor.create_settings(no_such_setting=1)
    with pytest.raises(ConfigError, match="min_np and its newer spelling"):
        ElasticRayExecutor.create_settings(min_np=2, min_num_proc=2)
    settings = ElasticRayExecutor.create_settings(min_np=2, max_np=3)
    with pytest.raises(ConfigError, match="override_discovery"):
        ElasticRayExecutor(settings, override_discovery=False)
    executor = ElasticRayExecutor(settings)
    with pytest.raises(ConfigError, match=r"callbacks\[0\] is not callable: 1 \(int\)"):
        executor.run(lambda: None, callbacks=[1])


def test_bad_counts_get_horovods_rules() -> None:
    with pytest.raises(ConfigError, match="min_np=2, max_np=1"):
        ElasticRayExecutor(ElasticRayExecutor.create_settings(min_np=2, max_np=1))
    with pytest.raises(ConfigError, match="gpus_per_slot is set, but use_gpu is False"):
        ElasticRayExecutor(ElasticRayExecutor.create_settings(), gpus_per_slot=1)
