"""The package as a serving image installs it: `make wheel`'s wheel needs only the runtime's
libraries (the test, build and plotting ones are extras), and holds the runtime."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile

from .conftest import ROOT

RUNTIME_NEEDS = {"torch", "diffusers", "transformers", "safetensors", "huggingface_hub", "click", "pillow", "numpy"}


def test_the_wheel_needs_only_the_runtime_libraries(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(ROOT)], check=True, cwd=tmp_path, capture_output=True)
    (wheel,) = tmp_path.glob("aotbuild-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    needs = re.findall(r"^Requires-Dist: ([A-Za-z0-9_.-]+)[^;\n]*$", metadata, re.MULTILINE)
    assert set(needs) == RUNTIME_NEEDS
    extras = dict(re.findall(r"^Requires-Dist: ([A-Za-z0-9_.-]+).*; extra == \"(\w+)\"$", metadata, re.MULTILINE))
    assert {"torchao", "pytest", "ruff", "matplotlib", "peft"} <= set(extras)
    assert {"aotbuild/runtime/load.py", "aotbuild/cli.py", "aotbuild/runtime/hub.py"} <= names
    (torch,) = re.findall(r"^Requires-Dist: torch\b.*$", metadata, re.MULTILINE)
    assert torch == "Requires-Dist: torch>=2.13"  # no build pinned: users bring the torch that fits them
