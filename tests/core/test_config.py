"""The frozen-configuration guard: the pure comparison, the guard, and capsafe's own settings."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from capsafe.config import (
    MAX_SIM_DEVICES,
    Change,
    FrozenConfig,
    FrozenConfigError,
    RuntimeConfig,
    SettingError,
    check_settings,
    find_changed,
)
from capsafe.errors import CapsafeError, UsageError

# -- find_changed -------------------------------------------------------------


def test_find_changed_unchanged_is_empty() -> None:
    assert find_changed({"A": "1", "B": None}, {"A": "1", "B": None}) == []


def test_find_changed_reports_a_changed_value() -> None:
    assert find_changed({"A": "fast"}, {"A": "slow"}) == [Change("A", "fast", "slow")]


def test_find_changed_reports_a_newly_set_variable() -> None:
    assert find_changed({"A": None}, {"A": "1"}) == [Change("A", None, "1")]
    assert find_changed({}, {"A": "1"}) == [Change("A", None, "1")]


def test_find_changed_reports_a_cleared_variable() -> None:
    assert find_changed({"A": "1"}, {"A": None}) == [Change("A", "1", None)]
    assert find_changed({"A": "1"}, {}) == [Change("A", "1", None)]


def test_find_changed_treats_empty_as_set() -> None:
    assert find_changed({"A": None}, {"A": ""}) == [Change("A", None, "")]


def test_find_changed_lists_every_change_sorted() -> None:
    changes = find_changed({"B": "1", "A": "x", "C": "same"}, {"B": "2", "C": "same", "D": "n"})
    assert [c.variable for c in changes] == ["A", "B", "D"]


# -- the guard ------------------------------------------------------------------


def _config(environ: dict[str, str], guard: bool) -> FrozenConfig[str]:
    return FrozenConfig(
        "myapp",
        ["MYAPP_KERNEL", "MYAPP_TILE"],
        lambda env: env["MYAPP_KERNEL"] or "fast",
        environ=environ,
        guard=guard,
    )


def test_first_read_freezes_and_later_reads_keep_the_value_when_off() -> None:
    environ = {"MYAPP_KERNEL": "fast"}
    config = _config(environ, guard=False)
    assert not config.frozen
    assert config.get() == "fast"
    environ["MYAPP_KERNEL"] = "slow"
    assert config.get() == "fast"
    assert config.changes() == [Change("MYAPP_KERNEL", "fast", "slow")]


def test_guard_raises_with_both_values_and_the_freeze_site() -> None:
    environ = {"MYAPP_KERNEL": "fast"}
    config = _config(environ, guard=True)
    config.get()
    freeze_line = sys._getframe().f_lineno - 1
    environ["MYAPP_KERNEL"] = "slow"
    environ["MYAPP_TILE"] = "64"
    with pytest.raises(FrozenConfigError) as caught:
        config.get()
    error = caught.value
    assert isinstance(error, CapsafeError)
    assert error.frozen_at == f"{__file__}:{freeze_line}"
    assert error.changes == [
        Change("MYAPP_KERNEL", "fast", "slow"),
        Change("MYAPP_TILE", None, "64"),
    ]
    message = str(error)
    assert "MYAPP_KERNEL: frozen 'fast', now 'slow'" in message
    assert "MYAPP_TILE: frozen unset, now '64'" in message
    assert f"{Path(__file__).name}:{freeze_line}" in message
    assert "child process" in message


def test_guard_passes_when_a_change_is_undone() -> None:
    environ = {"MYAPP_KERNEL": "fast"}
    config = _config(environ, guard=True)
    config.get()
    environ["MYAPP_KERNEL"] = "slow"
    with pytest.raises(FrozenConfigError):
        config.get()
    environ["MYAPP_KERNEL"] = "fast"
    assert config.get() == "fast"


def test_guard_ignores_a_variable_not_feeding_the_config() -> None:
    environ = {"MYAPP_KERNEL": "fast"}
    config = _config(environ, guard=True)
    config.get()
    environ["UNRELATED"] = "1"
    environ["MYAPP_KERNELS"] = "other"
    assert config.get() == "fast"


def test_guard_error_survives_pickling() -> None:
    error = FrozenConfigError("myapp", [Change("A", "1", None)], "t.py:3")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.config, copy.changes, copy.frozen_at) == ("myapp", error.changes, "t.py:3")
    assert str(copy) == str(error)


def test_a_failed_parse_does_not_freeze() -> None:
    environ = {"N": "x"}
    config = FrozenConfig("n", ["N"], lambda env: int(env["N"] or ""), environ=environ, guard=True)
    with pytest.raises(ValueError):
        config.get()
    environ["N"] = "3"
    assert config.get() == 3


def test_declaring_no_variables_is_a_usage_error() -> None:
    with pytest.raises(UsageError):
        FrozenConfig("empty", [], dict)


# -- capsafe's own settings -------------------------------------------------------


def test_runtime_config_defaults() -> None:
    assert RuntimeConfig.from_environ({}) == RuntimeConfig()
    assert RuntimeConfig().backend == "auto"
    assert RuntimeConfig().kernel_cache_max_bytes == 268435456


def test_runtime_config_from_an_explicit_mapping() -> None:
    config = RuntimeConfig.from_environ(
        {
            "CAPSAFE_BACKEND": "SIM",
            "CAPSAFE_GATE_POLICY": "measured",
            "CAPSAFE_GATE": "off",
            "CAPSAFE_KERNEL_CACHE": "no",
            "CAPSAFE_KERNEL_CACHE_DIR": "/tmp/k",
            "CAPSAFE_KERNEL_CACHE_MAX_BYTES": "0",
            "CAPSAFE_SIM_DEVICES": " 4 ",
        }
    )
    assert config == RuntimeConfig(
        backend="sim",
        gate_policy="measured",
        gate_enabled=False,
        kernel_cache_enabled=False,
        kernel_cache_dir=Path("/tmp/k"),
        kernel_cache_max_bytes=0,
        sim_devices=4,
    )


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("CAPSAFE_BACKEND", "gpu", "cuda, sim, auto"),
        ("CAPSAFE_GATE_POLICY", "yolo", "conservative, measured"),
        ("CAPSAFE_GATE", "maybe", "1, true, yes, on, 0, false, no, off"),
        ("CAPSAFE_KERNEL_CACHE_MAX_BYTES", "-1", "integer >= 0"),
        ("CAPSAFE_KERNEL_CACHE_MAX_BYTES", "1GB", "integer >= 0"),
        ("CAPSAFE_SIM_DEVICES", "0", "use a whole number of devices, 1 to 64"),
        ("CAPSAFE_SIM_DEVICES", "-2", "use a whole number of devices, 1 to 64"),
        ("CAPSAFE_SIM_DEVICES", "1.5", "use a whole number of devices, 1 to 64"),
        ("CAPSAFE_SIM_DEVICES", "two", "use a whole number of devices, 1 to 64"),
        ("CAPSAFE_SIM_DEVICES", "65", "use a whole number of devices, 1 to 64"),
        ("CAPSAFE_SIM_DEVICES", "1000000", "use a whole number of devices, 1 to 64"),
    ],
)
def test_runtime_config_parse_errors_are_one_line(variable: str, value: str, expected: str) -> None:
    with pytest.raises(SettingError) as caught:
        check_settings({variable: value})
    message = str(caught.value)
    assert "\n" not in message
    assert f"{variable}={value!r}" in message
    assert expected in message


def test_sim_devices_message_is_exactly_one_line() -> None:
    with pytest.raises(SettingError) as caught:
        check_settings({"CAPSAFE_SIM_DEVICES": "0"})
    assert str(caught.value) == (
        "CAPSAFE_SIM_DEVICES='0' is not valid; use a whole number of devices, 1 to 64"
    )
    assert check_settings({"CAPSAFE_SIM_DEVICES": str(MAX_SIM_DEVICES)}).sim_devices == 64
    assert check_settings({}).sim_devices == 1
    assert check_settings({"CAPSAFE_SIM_DEVICES": ""}).sim_devices == 1


def test_check_settings_covers_the_guard_switch_and_freezes_nothing() -> None:
    with pytest.raises(SettingError, match="CAPSAFE_FROZEN_GUARD='2' is not a boolean"):
        check_settings({"CAPSAFE_FROZEN_GUARD": "2"})
    assert check_settings({"CAPSAFE_BACKEND": "SIM"}).backend == "sim"


def test_every_runtime_field_is_fed_by_one_watched_variable() -> None:
    """No setting parsed and unused: each field has its variable, each variable its field."""
    fields = set(RuntimeConfig.__dataclass_fields__)
    assert len(fields) == len(RuntimeConfig.VARIABLES)
    for variable in RuntimeConfig.VARIABLES:
        assert variable.startswith("CAPSAFE_")


def _run_child(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    import os

    child_env = {k: v for k, v in os.environ.items() if not k.startswith("CAPSAFE_")}
    child_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_runtime_config_guard_from_the_environment_in_a_child() -> None:
    result = _run_child(
        """
        import os
        from capsafe.config import FrozenConfigError, runtime_config, guard_enabled
        assert runtime_config().backend == "sim"
        assert guard_enabled()
        os.environ["CAPSAFE_BACKEND"] = "cuda"
        os.environ["UNRELATED"] = "x"
        try:
            runtime_config()
        except FrozenConfigError as error:
            print(error)
        """,
        CAPSAFE_BACKEND="sim",
        CAPSAFE_FROZEN_GUARD="1",
    )
    assert result.returncode == 0, result.stderr
    assert "CAPSAFE_BACKEND: frozen 'sim', now 'cuda'" in result.stdout
    assert "<string>:4" in result.stdout
    assert "UNRELATED" not in result.stdout


def test_runtime_config_without_the_guard_keeps_the_frozen_value_in_a_child() -> None:
    result = _run_child(
        """
        import os
        from capsafe.config import runtime_config
        runtime_config()
        os.environ["CAPSAFE_BACKEND"] = "cuda"
        print(runtime_config().backend)
        """,
        CAPSAFE_BACKEND="sim",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "sim"
