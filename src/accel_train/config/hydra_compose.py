"""One compose per `accel-train` run instead of Hydra's two.

`hydra.main` composes the whole config once in `Hydra.get_mode`, only to read `hydra.mode` (a
config such as hparams_search=... sets MULTIRUN), and throws it away; `Hydra.run` then
composes it again (~0.2 s each on a 2-core machine). `install` makes `get_mode` keep its config
for the run that follows: where the command line holds no sweep (`a=1,2`, `glob(...)`),
`get_mode` composes in RUN mode (what the run would compose; validating the overrides for a run
is then a no-op), and if the mode it reads lets Hydra run a single job, the next
`compose_config` of that run, for the same config and overrides, takes that config instead of
composing it again. Everything else is Hydra's own path, unchanged: `-m` and a config whose
`hydra.mode` is MULTIRUN (the sweep composes per job), a command line with a sweep, a compose
that fails (Hydra's own `get_mode` then composes in MULTIRUN mode as before and the run reports
the error), `--cfg`, `--info` and `--help` (which never call `get_mode`).

The config handed over is the one Hydra would have composed: the same config loader, config
name and overrides; where `hydra.mode` was unset, Hydra's `_run_app` adds the override
`hydra.mode=RUN` for the run, which is applied here the same way (the mode, and the override
in `hydra.overrides.hydra`).
"""

from __future__ import annotations

import logging
from typing import Any

import hydra._internal.hydra as hydra_module
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import configure_log
from hydra.types import RunMode

_MODE_RUN = "hydra.mode=RUN"  # what Hydra's _run_app appends when the config sets no mode


def _has_sweep(overrides: list[str]) -> bool:
    try:
        parsed = OverridesParser.create().parse_overrides(overrides=overrides)
    except Exception:  # noqa: BLE001 - Hydra's own path reports it
        return True
    return any(o.is_sweep_override() for o in parsed)


def install() -> None:
    """Wrap Hydra's `get_mode` and `compose_config` (idempotent; another Hydra without them is
    left alone).

    Long because the two wrappers are closures over Hydra's own methods, each mirroring the
    signature and the steps of the one it replaces."""
    Hydra = hydra_module.Hydra  # noqa: N806 - the class, as Hydra names it

    if getattr(Hydra, "_accel_compose_once", False):
        return
    if not (hasattr(Hydra, "get_mode") and hasattr(Hydra, "compose_config")):
        return
    hydra_get_mode = Hydra.get_mode
    hydra_compose = Hydra.compose_config

    def get_mode(self: Any, config_name: str | None, overrides: list[str]) -> Any:
        self._accel_kept = None
        if _has_sweep(overrides):
            return hydra_get_mode(self, config_name, overrides)
        try:
            cfg = hydra_compose(
                self,
                config_name=config_name,
                overrides=list(overrides),
                with_log_configuration=False,
                run_mode=RunMode.RUN,
            )
        except Exception:  # noqa: BLE001 - as Hydra's get_mode: the run reports it
            return hydra_get_mode(self, config_name, overrides)
        mode = cfg.hydra.mode
        if mode is None:  # _run_app will run with `hydra.mode=RUN` appended
            cfg.hydra.mode = RunMode.RUN
            cfg.hydra.overrides.hydra.append(_MODE_RUN)
            self._accel_kept = (config_name, [*overrides, _MODE_RUN], cfg)
        elif mode == RunMode.RUN:
            self._accel_kept = (config_name, list(overrides), cfg)
        return mode

    def compose_config(
        self: Any,
        config_name: str | None,
        overrides: list[str],
        run_mode: RunMode,
        with_log_configuration: bool = False,
        from_shell: bool = True,
        validate_sweep_overrides: bool = True,
        **more: Any,  # a later Hydra's arguments (a callback on compose): its own path
    ) -> Any:
        kept, self._accel_kept = getattr(self, "_accel_kept", None), None
        if (
            kept is not None
            and not more
            and run_mode == RunMode.RUN
            and from_shell
            and kept[0] == config_name
            and kept[1] == list(overrides)
        ):
            cfg = kept[2]
            if with_log_configuration:  # what Hydra's compose_config does after composing
                configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)
                hydra_module.log = logging.getLogger(hydra_module.__name__)
                self._print_debug_info(config_name, overrides, run_mode)
            return cfg
        return hydra_compose(
            self,
            config_name=config_name,
            overrides=overrides,
            run_mode=run_mode,
            with_log_configuration=with_log_configuration,
            from_shell=from_shell,
            validate_sweep_overrides=validate_sweep_overrides,
            **more,
        )

    Hydra.get_mode = get_mode
    Hydra.compose_config = compose_config
    Hydra._accel_compose_once = True
