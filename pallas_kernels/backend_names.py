"""The attention backends' names, apart from their registry (`backends`) so that configuration can
check a name without importing jax."""

from __future__ import annotations

import typing
from typing import Literal

BackendName = Literal["auto", "pallas", "pallas_triton", "pallas_mosaic_gpu", "xla", "cpu_native"]
BACKEND_NAMES: tuple[str, ...] = typing.get_args(BackendName)
