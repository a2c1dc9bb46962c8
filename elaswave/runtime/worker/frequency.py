"""Frequency backends: read and set an accelerator's compute clock, by device index.

The DVFS planner (:mod:`elaswave.engine.dvfs`) decides a frequency; the runtime applies
it through one of these backends, chosen by name with :func:`frequency_backend`:

* ``emulated``: in-memory clocks, used by the CPU emulation and by tests;
* ``nvml``: NVIDIA GPUs through the pynvml package (locks the SM clock);
* ``npu-smi``: Ascend NPUs through Huawei's ``npu-smi`` command-line tool.

Vendor libraries and tools are looked up only when their backend is constructed, and a
missing one is reported as a ValueError that says what is missing. Every call blocks
(a driver call or a subprocess), so the runtime calls them from a worker thread, never
from the event loop.
"""

from __future__ import annotations

import enum
import importlib
import math
import shutil
import subprocess
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Protocol

import structlog

log = structlog.get_logger(__name__)

__all__ = [
    "BACKEND_NAMES",
    "EmulatedFrequency",
    "FrequencyBackend",
    "FrequencyBackendName",
    "NpuSmiFrequency",
    "NvmlFrequency",
    "frequency_backend",
]


class FrequencyBackendName(enum.StrEnum):
    EMULATED = "emulated"
    NVML = "nvml"
    NPU_SMI = "npu-smi"


BACKEND_NAMES = tuple(n.value for n in FrequencyBackendName)


class FrequencyBackend(Protocol):
    """Reads and sets the compute clock of the accelerators visible to this process."""

    name: str

    def range_mhz(self, device_index: int) -> tuple[float, float]:
        """The lowest and highest compute clock ``set_mhz`` accepts for the device."""
        ...

    def get_mhz(self, device_index: int) -> float:
        """The device's compute clock now."""
        ...

    def set_mhz(self, device_index: int, mhz: float) -> None:
        """Run the device's compute clock at ``mhz``; ValueError outside ``range_mhz``."""
        ...


def _check_in_range(name: str, device_index: int, mhz: float, low: float, high: float) -> None:
    if not math.isfinite(mhz) or not low <= mhz <= high:
        raise ValueError(
            f"{name}: {mhz!r} MHz is outside device {device_index}'s range [{low:g}, {high:g}] MHz"
        )


class EmulatedFrequency:
    """In-memory clocks for ``num_devices`` devices, each starting at ``base_mhz``.

    Nothing runs faster: the emulation's cost model reads :meth:`get_mhz` to scale its
    predicted compute times.
    """

    name = FrequencyBackendName.EMULATED.value

    def __init__(
        self, *, base_mhz: float, min_mhz: float, max_mhz: float, num_devices: int = 1
    ) -> None:
        for label, value in (("base_mhz", base_mhz), ("min_mhz", min_mhz), ("max_mhz", max_mhz)):
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{label} must be a positive number of MHz, got {value!r}")
        if not min_mhz <= base_mhz <= max_mhz:
            raise ValueError(
                f"base_mhz {base_mhz:g} must lie in [min_mhz, max_mhz] = [{min_mhz:g}, {max_mhz:g}]"
            )
        if num_devices < 1:
            raise ValueError(f"num_devices must be at least 1, got {num_devices}")
        self.num_devices = num_devices
        self._range = (float(min_mhz), float(max_mhz))
        self._mhz = [float(base_mhz)] * num_devices

    def _check_device(self, device_index: int) -> None:
        if not 0 <= device_index < self.num_devices:
            raise ValueError(
                f"device index {device_index} is out of range: this emulated backend has "
                f"devices 0-{self.num_devices - 1}"
            )

    def range_mhz(self, device_index: int) -> tuple[float, float]:
        self._check_device(device_index)
        return self._range

    def get_mhz(self, device_index: int) -> float:
        self._check_device(device_index)
        return self._mhz[device_index]

    def set_mhz(self, device_index: int, mhz: float) -> None:
        self._check_device(device_index)
        _check_in_range(self.name, device_index, mhz, *self._range)
        self._mhz[device_index] = float(mhz)


class NvmlFrequency:
    """NVIDIA GPUs through NVML (the pynvml module of the ``nvidia-ml-py`` package).

    ``set_mhz`` locks the SM clock with ``nvmlDeviceSetGpuLockedClocks(handle, mhz, mhz)``,
    which usually needs root (or an administrator's permission for clock changes);
    :meth:`reset` undoes it. ``get_mhz`` reads the SM clock now, which an idle GPU may
    hold below the locked value. The range is the span of supported graphics clocks at
    the highest supported memory clock. Device indices are NVML's, which follow the PCI
    order rather than ``CUDA_VISIBLE_DEVICES``.
    """

    name = FrequencyBackendName.NVML.value

    def __init__(self) -> None:
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError:
            raise ValueError(
                "frequency backend 'nvml' needs an NVIDIA GPU and the pynvml module, and "
                "pynvml is not installed (pip install nvidia-ml-py); use 'emulated' here"
            ) from None
        try:
            nvml.nvmlInit()
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            raise ValueError(
                f"frequency backend 'nvml' needs an NVIDIA GPU with its driver, and NVML "
                f"could not start ({exc}); use 'emulated' here"
            ) from None
        if count == 0:
            nvml.nvmlShutdown()
            raise ValueError("frequency backend 'nvml' needs an NVIDIA GPU, and NVML sees none")
        self._nvml: ModuleType = nvml
        self.num_devices = count
        self._ranges: dict[int, tuple[float, float]] = {}

    def _handle(self, device_index: int) -> Any:
        if not 0 <= device_index < self.num_devices:
            raise ValueError(
                f"device index {device_index} is out of range: NVML sees devices "
                f"0-{self.num_devices - 1}"
            )
        return self._nvml.nvmlDeviceGetHandleByIndex(device_index)

    def range_mhz(self, device_index: int) -> tuple[float, float]:
        if device_index not in self._ranges:
            handle = self._handle(device_index)
            memory = max(self._nvml.nvmlDeviceGetSupportedMemoryClocks(handle))
            clocks = self._nvml.nvmlDeviceGetSupportedGraphicsClocks(handle, memory)
            if not clocks:
                raise ValueError(
                    f"NVML lists no supported graphics clocks for device {device_index} at "
                    f"memory clock {memory} MHz: its clocks cannot be set"
                )
            self._ranges[device_index] = (float(min(clocks)), float(max(clocks)))
        return self._ranges[device_index]

    def get_mhz(self, device_index: int) -> float:
        handle = self._handle(device_index)
        return float(self._nvml.nvmlDeviceGetClockInfo(handle, self._nvml.NVML_CLOCK_SM))

    def set_mhz(self, device_index: int, mhz: float) -> None:
        _check_in_range(self.name, device_index, mhz, *self.range_mhz(device_index))
        handle = self._handle(device_index)
        locked = round(mhz)
        try:
            self._nvml.nvmlDeviceSetGpuLockedClocks(handle, locked, locked)
        except self._nvml.NVMLError as exc:
            if getattr(exc, "value", None) == self._nvml.NVML_ERROR_NO_PERMISSION:
                raise PermissionError(
                    f"locking device {device_index}'s SM clock at {locked} MHz needs root ({exc})"
                ) from None
            raise RuntimeError(
                f"NVML could not lock device {device_index}'s SM clock at {locked} MHz ({exc})"
            ) from exc
        log.info("sm_clock_locked", device=device_index, mhz=locked)

    def reset(self, device_index: int) -> None:
        """Release the clock lock: the driver manages the SM clock again."""
        self._nvml.nvmlDeviceResetGpuLockedClocks(self._handle(device_index))
        log.info("sm_clock_reset", device=device_index)

    def close(self) -> None:
        """Shut NVML down; clock locks stay in force until :meth:`reset`."""
        self._nvml.nvmlShutdown()


class NpuSmiFrequency:
    """Ascend NPUs through Huawei's ``npu-smi`` tool. Untested on hardware: there is no NPU
    or npu-smi here, so the commands follow npu-smi's documentation and the parsing is
    checked only against its documented sample output, through a fake ``npu-smi``.

    ``device_index`` is the NPU ID that ``npu-smi info -l`` lists (not torch_npu's logical
    index under ``ASCEND_RT_VISIBLE_DEVICES``), and ``chip_id`` selects the chip on it
    (0 on Atlas 800T A2 training servers, one chip per NPU). Reading uses the documented
    ``npu-smi info -t common -i NPU_ID``: ``Aicore curFreq(MHZ)`` is the clock now and
    ``Aicore Freq(MHZ)`` the rated clock, taken as the top of the range; npu-smi documents
    no minimum, so the bottom is ``min_mhz``.

    npu-smi's documented ``set -t`` types include no AI Core clock setting, so the command
    that sets one must be given as ``set_command``: an argument list whose items may use
    ``{npu_id}``, ``{chip_id}`` and ``{mhz}`` (an integer), run as is (no shell). Without
    it, :meth:`set_mhz` raises ValueError. Setting clocks normally needs root.
    """

    name = FrequencyBackendName.NPU_SMI.value

    def __init__(
        self,
        *,
        chip_id: int = 0,
        min_mhz: float = 0.0,
        set_command: Sequence[str] | None = None,
        executable: str = "npu-smi",
        timeout_s: float = 10.0,
    ) -> None:
        path = shutil.which(executable)
        if path is None:
            raise ValueError(
                f"frequency backend 'npu-smi' needs Huawei's {executable!r} tool (installed "
                "with the Ascend NPU driver) on PATH, and it was not found; use 'emulated' here"
            )
        if chip_id < 0:
            raise ValueError(f"chip_id must be >= 0, got {chip_id}")
        if not math.isfinite(min_mhz) or min_mhz < 0:
            raise ValueError(f"min_mhz must be a number of MHz >= 0, got {min_mhz!r}")
        self._executable = path
        self.chip_id = chip_id
        self.min_mhz = float(min_mhz)
        if set_command is not None:
            try:
                for part in set_command:
                    part.format(npu_id=0, chip_id=0, mhz=0)
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(
                    f"set_command {list(set_command)} has a placeholder other than {{npu_id}}, "
                    f"{{chip_id}} and {{mhz}} ({exc!r})"
                ) from None
        self.set_command = None if set_command is None else tuple(set_command)
        self.timeout_s = timeout_s

    def _run(self, argv: Sequence[str]) -> str:
        try:
            done = subprocess.run(
                list(argv), capture_output=True, text=True, timeout=self.timeout_s, check=False
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{' '.join(argv)} did not finish in {self.timeout_s:g} s") from None
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} failed with exit status {done.returncode}: "
                f"{(done.stderr or done.stdout).strip()}"
            )
        return done.stdout

    def _common(self, device_index: int) -> dict[str, str]:
        if device_index < 0:
            raise ValueError(f"device index must be >= 0, got {device_index}")
        text = self._run([self._executable, "info", "-t", "common", "-i", str(device_index)])
        fields = parse_common_info(text, chip_id=self.chip_id)
        if not fields:
            raise RuntimeError(
                f"npu-smi reports no chip {self.chip_id} on NPU {device_index}:\n{text}"
            )
        return fields

    def _field_mhz(self, device_index: int, key: str) -> float:
        fields = self._common(device_index)
        try:
            return float(fields[key])
        except (KeyError, ValueError):
            raise RuntimeError(
                f"npu-smi info -t common -i {device_index} gives no numeric {key!r} for "
                f"chip {self.chip_id}; fields: {fields}"
            ) from None

    def range_mhz(self, device_index: int) -> tuple[float, float]:
        return (self.min_mhz, self._field_mhz(device_index, "Aicore Freq(MHZ)"))

    def get_mhz(self, device_index: int) -> float:
        return self._field_mhz(device_index, "Aicore curFreq(MHZ)")

    def set_mhz(self, device_index: int, mhz: float) -> None:
        if self.set_command is None:
            raise ValueError(
                "npu-smi documents no command that sets the AI Core clock; pass set_command "
                "(e.g. your firmware's setter, with {npu_id}, {chip_id} and {mhz} "
                "placeholders) to the 'npu-smi' frequency backend"
            )
        _check_in_range(self.name, device_index, mhz, *self.range_mhz(device_index))
        values = {"npu_id": device_index, "chip_id": self.chip_id, "mhz": round(mhz)}
        self._run([part.format(**values) for part in self.set_command])
        log.info("aicore_clock_set", device=device_index, chip=self.chip_id, mhz=round(mhz))


def parse_common_info(text: str, *, chip_id: int) -> dict[str, str]:
    """The ``key : value`` fields of one chip in ``npu-smi info -t common`` output.

    The output lists each chip's fields after a ``Chip ID : N`` line and may end with an
    MCU section (``Chip Name : mcu``) that belongs to no chip. Some products print one
    chip without a ``Chip ID`` line; its fields are then chip 0's.
    """
    chips: dict[int | None, dict[str, str]] = {None: {}}
    current: int | None = None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "Chip ID" and value.isdigit():
            current = int(value)
            chips.setdefault(current, {})
        elif key == "Chip Name" and value.lower() == "mcu":
            current = -1
            chips.setdefault(current, {})
        else:
            chips[current][key] = value
    if len(chips) == 1 and chip_id == 0:
        return chips[None]
    return chips.get(chip_id, {})


def frequency_backend(name: str, **kwargs: Any) -> FrequencyBackend:
    """The backend called ``name``, constructed with ``kwargs``."""
    try:
        kind = FrequencyBackendName(name)
    except ValueError:
        raise ValueError(
            f"unknown frequency backend {name!r}; valid names: {', '.join(BACKEND_NAMES)}"
        ) from None
    if kind is FrequencyBackendName.EMULATED:
        return EmulatedFrequency(**kwargs)
    if kind is FrequencyBackendName.NVML:
        return NvmlFrequency(**kwargs)
    return NpuSmiFrequency(**kwargs)
