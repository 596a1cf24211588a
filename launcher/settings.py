"""The local cluster's settings: ``deploy/local.env``, overridden by flags.

``deploy/local.env`` is the documented source of the defaults (one
``KEY=VALUE`` a line, ``#`` comments, no quoting). ``timeslice up`` reads it
from the source tree it runs from, or from ``$TIMESLICE_LOCAL_ENV``; when
neither exists (a plain ``pip install``) the same values built in here apply.
Every key is also a flag: lower case, ``_`` -> ``-`` (``LOCKD_REPLICAS`` =
``--lockd-replicas``). Values are validated before anything starts.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from pathlib import Path

from timeslice.common.server.keys import Keys

ENV_FILE_VAR = "TIMESLICE_LOCAL_ENV"
BACKENDS = ("auto", "cuda-driver", "cuda-checkpoint", "sim")

#: The values of deploy/local.env, for installs without the source tree.
BUILTIN: dict[str, str] = {
    "ETCD_MEMBERS": "1", "ETCD_CLIENT_PORT": "0", "ETCD_PEER_PORT": "0", "PREFIX": "/timeslice/",
    "LOCKD_REPLICAS": "3", "LOCKD_PORT": "0", "LOCKD_METRICS_PORT": "0",
    "NODEAGENT_PORT": "0", "NODEAGENT_METRICS_PORT": "0", "BACKEND": "auto",
    "SIM_DEVICES": "1", "SIM_DEVICE_CAPACITY_BYTES": str(64 << 20),
    "SIM_SNAPSHOT_BYTES_PER_S": "1800000000", "SIM_RESTORE_BYTES_PER_S": "4500000000",
    "LOG_DIR": "runs", "GROUP_SHARING": "fit",
}
SHARINGS = ("exclusive", "fit")


class SettingsError(ValueError):
    """A value in local.env or on the command line is unusable (the message says which)."""


def default_env_file() -> Path | None:
    """``$TIMESLICE_LOCAL_ENV``, else ``deploy/local.env`` of this source tree, else None."""
    explicit = os.environ.get(ENV_FILE_VAR)
    if explicit:
        return Path(explicit)
    here = Path(__file__).resolve()
    for parent in here.parents:                # launcher/ -> repo root
        candidate = parent / "deploy" / "local.env"
        if candidate.is_file():
            return candidate
    return None


def parse_env_file(text: str, origin: str = "local.env") -> dict[str, str]:
    values: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Z][A-Z0-9_]*", key):
            raise SettingsError(f"{origin}:{n}: not KEY=VALUE: {raw!r}")
        values[key] = value.strip()
    return values


def flag_name(key: str) -> str:
    return "--" + key.lower().replace("_", "-")


@dataclass(frozen=True)
class Settings:
    etcd_members: int = 1
    etcd_client_port: int = 0
    etcd_peer_port: int = 0
    prefix: str = "/timeslice/"
    lockd_replicas: int = 3
    lockd_port: int = 0
    lockd_metrics_port: int = 0
    nodeagent_port: int = 0
    nodeagent_metrics_port: int = 0
    backend: str = "auto"
    sim_devices: int = 1
    sim_device_capacity_bytes: int = 64 << 20
    sim_snapshot_bytes_per_s: int = 1_800_000_000
    sim_restore_bytes_per_s: int = 4_500_000_000
    log_dir: str = "runs"
    group_sharing: str = "fit"

    def __post_init__(self) -> None:
        if self.etcd_members < 1 or self.etcd_members % 2 == 0:
            raise SettingsError(f"ETCD_MEMBERS must be odd and >= 1 (1 or 3), is {self.etcd_members}")
        if self.lockd_replicas < 1:
            raise SettingsError(f"LOCKD_REPLICAS must be >= 1, is {self.lockd_replicas}")
        for f in fields(self):
            if f.name.endswith("_port"):
                v = getattr(self, f.name)
                if not 0 <= v <= 65535:
                    raise SettingsError(f"{f.name.upper()} {v} is no port (0 = a free one)")
        try:
            Keys(self.prefix)
        except ValueError as e:
            raise SettingsError(f"PREFIX: {e}") from None
        if self.backend not in BACKENDS:
            raise SettingsError(f"BACKEND {self.backend!r}: choose one of {', '.join(BACKENDS)}")
        if self.sim_devices != 1:
            raise SettingsError("SIM_DEVICES: the simulated backend offers one device per node; use 1")
        if self.sim_device_capacity_bytes <= 0:
            raise SettingsError("SIM_DEVICE_CAPACITY_BYTES must be > 0")
        if self.sim_snapshot_bytes_per_s < 0 or self.sim_restore_bytes_per_s < 0:
            raise SettingsError("SIM_*_BYTES_PER_S must be >= 0 (0 = as fast as memory allows)")
        if self.group_sharing not in SHARINGS:
            raise SettingsError(f"GROUP_SHARING {self.group_sharing!r}: choose one of {', '.join(SHARINGS)}")

    @classmethod
    def key_names(cls) -> list[str]:
        return [f.name.upper() for f in fields(cls)]

    @classmethod
    def from_values(cls, values: dict[str, str]) -> Settings:
        kw: dict = {}
        for f in fields(cls):
            raw = values.get(f.name.upper())
            if raw is None:
                continue
            if f.type in ("int", int):
                try:
                    kw[f.name] = int(raw)
                except ValueError:
                    raise SettingsError(f"{f.name.upper()} must be a whole number, is {raw!r}") from None
            else:
                kw[f.name] = raw
        return cls(**kw)


def load(env_file: str | os.PathLike | None = None, overrides: dict[str, object] | None = None) -> tuple[Settings, str]:
    """(settings, where the defaults came from). ``overrides`` maps KEY -> value (None = unset)."""
    path = Path(env_file) if env_file else default_env_file()
    if path is not None:
        if not path.is_file():
            raise SettingsError(f"{path}: no such file")
        values = {**BUILTIN, **parse_env_file(path.read_text(), str(path))}
        origin = str(path)
    else:
        values, origin = dict(BUILTIN), "built-in defaults (no deploy/local.env found)"
    unknown = set(values) - set(Settings.key_names())
    if unknown:
        raise SettingsError(f"{origin}: unknown key(s) {', '.join(sorted(unknown))}")
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = str(value)
    return Settings.from_values(values), origin
