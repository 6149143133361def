"""Every tensor factory in the code that runs beside the model names its device (issue 45).

A factory call without `device=` (torch.arange, zeros, tensor, empty, ...) makes its tensor on
torch's default device: the CPU, beside a model on a GPU. tests/test_meta_device.py runs the
engine's paths under a `meta` default to catch that at run time, on the thread that computes;
this check reads the source, so it also covers what runs on the engine's other threads (the
upload's feeder, the saver) and branches the runs do not reach. Host buffers name the CPU
(`device="cpu"`), which says on purpose what a missing argument only implies.

`torch.from_numpy` and `torch.frombuffer` are not factories here: they share host memory, on
the CPU whatever the default (torch's own list, `torch.utils._device`, leaves them out too).
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch.utils._device

ROOT = Path(__file__).resolve().parent.parent
#: Where tensors are made beside the model's, or as host buffers copied to its device.
CHECKED = ("engine_adapter/runner", "engine_adapter/dsl", "kvstore/load", "kvstore/tiers")
#: The functions that take their device from torch's default when none is named (torch's own list).
FACTORIES = frozenset(f.__name__ for f in torch.utils._device._device_constructors())


def unnamed_devices(path: Path, root: Path) -> list[str]:
    """`file:line: torch.NAME(...)` for each factory call in `path` without a `device=` keyword
    (`device=None` counts as none)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        func = node.func
        if not (isinstance(func.value, ast.Name) and func.value.id == "torch" and func.attr in FACTORIES):
            continue
        device = next((k.value for k in node.keywords if k.arg == "device"), None)
        if device is None or (isinstance(device, ast.Constant) and device.value is None):
            where = f"{path.relative_to(root)}:{node.lineno}"
            found.append((node.lineno, f"{where}: torch.{func.attr}(...) names no device"))
    return [line for _, line in sorted(found)]


def checked_files(root: Path) -> list[Path]:
    """The Python files under `CHECKED` folders of `root`."""
    return sorted(p for folder in CHECKED for p in (root / folder).rglob("*.py"))


def test_every_tensor_factory_beside_the_model_names_its_device() -> None:
    files = checked_files(ROOT)
    assert any(p.name == "attention.py" for p in files) and any(p.name == "device.py" for p in files)
    bad = [line for path in files for line in unnamed_devices(path, ROOT)]
    assert not bad, "name the device (the model's, or device='cpu' for host memory):\n" + "\n".join(bad)


def test_the_check_finds_a_factory_without_its_device(tmp_path: Path) -> None:
    source = tmp_path / "stats.py"
    source.write_text(
        "import torch\n"
        "def f(w):\n"
        "    a = torch.arange(3, 0, -1, dtype=torch.float32)\n"  # main's attention.py:52
        "    b = torch.zeros(3, device=w.device)\n"
        "    c = torch.full((3,), 1.0, device=None)\n"
        "    d = torch.from_numpy(w)\n"  # shares host memory: not a factory
        "    return torch.tensor([1], device='cpu'), a, b, c, d\n"
    )
    assert unnamed_devices(source, tmp_path) == [
        "stats.py:3: torch.arange(...) names no device",
        "stats.py:5: torch.full(...) names no device",
    ]
    assert {"arange", "zeros", "ones", "empty", "full", "tensor"} <= FACTORIES
