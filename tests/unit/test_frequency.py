"""Frequency backends: the emulated one, and the vendor ones against what this machine lacks."""

from __future__ import annotations

import importlib.util
import shutil
import sys
import textwrap
import types
from pathlib import Path

import pytest

from elaswave.runtime.worker.frequency import (
    BACKEND_NAMES,
    EmulatedFrequency,
    FrequencyBackend,
    NpuSmiFrequency,
    NvmlFrequency,
    frequency_backend,
    parse_common_info,
)

pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------------------------- emulated


def _emulated(num_devices: int = 2) -> EmulatedFrequency:
    return EmulatedFrequency(
        base_mhz=1400.0, min_mhz=800.0, max_mhz=1650.0, num_devices=num_devices
    )


def test_emulated_starts_at_base_and_sets_each_device() -> None:
    backend: FrequencyBackend = _emulated()
    assert backend.name == "emulated"
    assert backend.range_mhz(0) == backend.range_mhz(1) == (800.0, 1650.0)
    assert backend.get_mhz(0) == backend.get_mhz(1) == 1400.0
    backend.set_mhz(1, 1537.5)
    assert backend.get_mhz(1) == 1537.5 and backend.get_mhz(0) == 1400.0
    backend.set_mhz(0, 1650.0)
    backend.set_mhz(0, 800.0)
    assert backend.get_mhz(0) == 800.0


@pytest.mark.parametrize("mhz", [799.0, 1650.5, float("nan"), float("inf")])
def test_emulated_refuses_frequencies_outside_its_range(mhz: float) -> None:
    backend = _emulated()
    with pytest.raises(ValueError, match=r"outside device 1's range \[800, 1650\] MHz"):
        backend.set_mhz(1, mhz)
    assert backend.get_mhz(1) == 1400.0


@pytest.mark.parametrize("device_index", [-1, 2])
def test_emulated_refuses_unknown_devices(device_index: int) -> None:
    backend = _emulated()
    for call in (backend.get_mhz, backend.range_mhz):
        with pytest.raises(ValueError, match=f"device index {device_index} is out of range"):
            call(device_index)
    with pytest.raises(ValueError, match="devices 0-1"):
        backend.set_mhz(device_index, 1500.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"base_mhz": 1700.0}, r"base_mhz 1700 must lie in \[min_mhz, max_mhz\]"),
        ({"min_mhz": 1500.0}, r"base_mhz 1400 must lie in \[min_mhz, max_mhz\]"),
        ({"min_mhz": 0.0}, "min_mhz must be a positive number of MHz, got 0.0"),
        ({"max_mhz": float("nan")}, "max_mhz must be a positive number of MHz, got nan"),
        ({"num_devices": 0}, "num_devices must be at least 1, got 0"),
    ],
)
def test_emulated_validates_its_configuration(kwargs: dict[str, float], message: str) -> None:
    args: dict[str, float] = {"base_mhz": 1400.0, "min_mhz": 800.0, "max_mhz": 1650.0} | kwargs
    with pytest.raises(ValueError, match=message):
        EmulatedFrequency(**args)  # type: ignore[arg-type]


def test_backend_by_name() -> None:
    backend = frequency_backend("emulated", base_mhz=1000.0, min_mhz=500.0, max_mhz=2000.0)
    assert isinstance(backend, EmulatedFrequency) and backend.get_mhz(0) == 1000.0
    assert BACKEND_NAMES == ("emulated", "nvml", "npu-smi")
    with pytest.raises(ValueError, match="unknown frequency backend 'cuda'; valid names: "):
        frequency_backend("cuda")
    with pytest.raises(ValueError, match="emulated, nvml, npu-smi"):
        frequency_backend("")


# --------------------------------------------------------------------------- this machine


def test_nvml_on_this_machine_says_what_is_missing() -> None:
    # This machine has neither pynvml nor an NVIDIA GPU; the message must say which.
    if importlib.util.find_spec("pynvml") is None:
        missing = "pynvml is not installed"
    else:
        missing = "NVML could not start|NVML sees none"
    with pytest.raises(ValueError, match=rf"'nvml' needs an NVIDIA GPU.*({missing})"):
        frequency_backend("nvml")


def test_npu_smi_on_this_machine_says_what_is_missing() -> None:
    assert shutil.which("npu-smi") is None
    with pytest.raises(ValueError, match=r"needs Huawei's 'npu-smi' tool .* was not found"):
        frequency_backend("npu-smi")


# --------------------------------------------------------------------------- nvml, faked


class _FakeNvml(types.ModuleType):
    """The part of pynvml the backend uses, over two H100-like devices."""

    NVML_CLOCK_SM = 1
    NVML_ERROR_NO_PERMISSION = 4

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(f"NVML error {value}")
            self.value = value

    def __init__(self, *, count: int = 2, root: bool = True) -> None:
        super().__init__("pynvml")
        self.count, self.root = count, root
        self.sm = {"h0": 1755, "h1": 345}
        self.locked: list[tuple[str, int, int]] = []

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"h{index}"

    def nvmlDeviceGetSupportedMemoryClocks(self, handle: str) -> list[int]:
        return [1593, 2619]

    def nvmlDeviceGetSupportedGraphicsClocks(self, handle: str, memory: int) -> list[int]:
        return list(range(1980, 344, -15)) if memory == 2619 else [1200, 500]

    def nvmlDeviceGetClockInfo(self, handle: str, clock: int) -> int:
        assert clock == self.NVML_CLOCK_SM
        return self.sm[handle]

    def nvmlDeviceSetGpuLockedClocks(self, handle: str, low: int, high: int) -> None:
        if not self.root:
            raise self.NVMLError(self.NVML_ERROR_NO_PERMISSION)
        self.locked.append((handle, low, high))
        self.sm[handle] = high

    def nvmlDeviceResetGpuLockedClocks(self, handle: str) -> None:
        self.locked.append((handle, 0, 0))


def test_nvml_locks_the_sm_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    backend = frequency_backend("nvml")
    assert isinstance(backend, NvmlFrequency) and backend.name == "nvml"
    # The range comes from the graphics clocks at the highest memory clock.
    assert backend.range_mhz(0) == (345.0, 1980.0)
    assert backend.get_mhz(1) == 345.0
    backend.set_mhz(1, 1597.4)
    assert fake.locked == [("h1", 1597, 1597)]
    assert backend.get_mhz(1) == 1597.0
    with pytest.raises(ValueError, match=r"outside device 0's range \[345, 1980\]"):
        backend.set_mhz(0, 2000.0)
    with pytest.raises(ValueError, match="device index 2 is out of range"):
        backend.get_mhz(2)
    backend.reset(1)
    assert fake.locked[-1] == ("h1", 0, 0)


def test_nvml_without_root_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(root=False))
    with pytest.raises(PermissionError, match="SM clock at 1500 MHz needs root"):
        NvmlFrequency().set_mhz(0, 1500.0)


def test_nvml_without_a_gpu_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(count=0))
    with pytest.raises(ValueError, match="needs an NVIDIA GPU, and NVML sees none"):
        NvmlFrequency()
    broken = _FakeNvml()

    def no_driver() -> None:
        raise broken.NVMLError(9)

    broken.nvmlInit = no_driver  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    with pytest.raises(ValueError, match=r"NVML could not start \(NVML error 9\)"):
        NvmlFrequency()


# --------------------------------------------------------------------------- npu-smi, faked

# Documented output of `npu-smi info -t common -i 0` on an Atlas 800T A2 (910B).
COMMON_910B = """\
        NPU ID                         : 0
        Chip Count                     : 1

        Chip ID                        : 0
        Memory Usage Rate(%)           : 6
        HBM Usage Rate(%)              : 0
        Aicore Usage Rate(%)           : 0
        Aicore Freq(MHZ)               : 1650
        Aicore curFreq(MHZ)            : 1400
        Aicore Count                   : 24
        Temperature(C)                 : 46
        NPU Real-time Power(W)         : 69.0

        Chip Name                      : mcu
        Temperature(C)                 : 40
"""


def test_parse_common_info() -> None:
    fields = parse_common_info(COMMON_910B, chip_id=0)
    assert fields["Aicore Freq(MHZ)"] == "1650" and fields["Aicore curFreq(MHZ)"] == "1400"
    assert fields["Temperature(C)"] == "46"  # the chip's, not the MCU's
    assert parse_common_info(COMMON_910B, chip_id=1) == {}
    # Some products print a single chip without a Chip ID line.
    flat = "NPU ID : 0\nAicore Freq(MHZ) : 1650\nAicore curFreq(MHZ) : 100\n"
    assert parse_common_info(flat, chip_id=0)["Aicore curFreq(MHZ)"] == "100"


@pytest.fixture
def fake_npu_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An ``npu-smi`` on PATH that prints the documented output and logs its arguments."""
    calls = tmp_path / "calls.txt"
    (tmp_path / "common.txt").write_text(COMMON_910B)
    script = tmp_path / "npu-smi"
    script.write_text(
        textwrap.dedent(
            f"""\
            #!/bin/sh
            echo "$@" >> {calls}
            if [ "$1 $2 $3" = "info -t common" ] && [ "$5" = "0" ]; then
                cat {tmp_path / "common.txt"}
            elif [ "$1" = "set" ]; then
                :
            else
                echo "Error: device $5 not found" >&2; exit 3
            fi
            """
        )
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    return calls


def test_npu_smi_reads_and_sets_the_aicore_clock(fake_npu_smi: Path) -> None:
    # A firmware-specific setter: npu-smi documents none, so the backend takes it as given.
    command = ["npu-smi", "set", "-t", "aicore-freq", "-i", "{npu_id}", "-c", "{chip_id}"]
    backend = frequency_backend("npu-smi", min_mhz=800.0, set_command=[*command, "-d", "{mhz}"])
    assert isinstance(backend, NpuSmiFrequency)
    assert backend.get_mhz(0) == 1400.0
    assert backend.range_mhz(0) == (800.0, 1650.0)
    backend.set_mhz(0, 1512.4)
    with pytest.raises(ValueError, match=r"outside device 0's range \[800, 1650\]"):
        backend.set_mhz(0, 1700.0)
    with pytest.raises(RuntimeError, match="exit status 3: Error: device 5 not found"):
        backend.get_mhz(5)
    assert fake_npu_smi.read_text().splitlines() == [
        "info -t common -i 0",
        "info -t common -i 0",
        "info -t common -i 0",  # set_mhz checks the range first
        "set -t aicore-freq -i 0 -c 0 -d 1512",
        "info -t common -i 0",
        "info -t common -i 5",
    ]


def test_npu_smi_needs_a_set_command_to_set(fake_npu_smi: Path) -> None:
    backend = NpuSmiFrequency()
    assert backend.range_mhz(0) == (0.0, 1650.0)
    with pytest.raises(ValueError, match="npu-smi documents no command that sets the AI Core"):
        backend.set_mhz(0, 1500.0)
    with pytest.raises(ValueError, match="has a placeholder other than"):
        NpuSmiFrequency(set_command=["npu-smi", "set", "-d", "{freq}"])
