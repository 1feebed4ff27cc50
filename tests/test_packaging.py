"""A wheel built from the tree carries every file the package reads at run time: each tracked
non-Python file under xlaserve/ (native kernel sources compiled on first use, the chat page,
the proto, the quality corpus).  An editable install reads them from the tree and would never
show one missing.  Built from a copy of the tracked files alone: a build folder or egg-info
left in the tree by an earlier install would list the files whatever pyproject.toml says."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_has_the_package_data(tmp_path: Path) -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.splitlines()
    src = tmp_path / "src"
    for f in tracked:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    data = {f for f in tracked if f.startswith("xlaserve/") and not f.endswith(".py")}
    assert any(f.endswith(".cc") for f in data), data
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("xlaserve-*.whl")
    missing = data - set(zipfile.ZipFile(wheel).namelist())
    assert not missing, f"not in the wheel: {sorted(missing)}"
