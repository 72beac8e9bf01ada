"""What the repository and the built wheel carry: our licence, the shipped data's notice, nothing stray."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"not a git checkout ({out.stderr.strip()})")
    return out.stdout.split()


@pytest.mark.processes
def test_the_repository_carries_the_licences_and_no_built_packages():
    tracked = _tracked()
    assert "LICENSE" in tracked and "NOTICE" in tracked
    assert [f for f in tracked if f.endswith((".whl", ".tar.gz", ".egg"))] == []
    assert "BSD 3-Clause" in (ROOT / "LICENSE").read_text()
    notice = (ROOT / "NOTICE").read_text()
    assert "scikit-learn developers" in notice and "digits.csv.gz" in notice
    # the notice travels beside the data too, for a copy of the package without its metadata
    assert (ROOT / "src/paratrain/training/_assets/digits-NOTICE.txt").read_text() == notice


@pytest.mark.processes
def test_the_wheel_holds_the_licence_and_the_notice_beside_the_data(tmp_path):
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
    )
    if build.returncode != 0 and "No module named" in build.stderr:
        pytest.skip(f"cannot build a wheel here: {build.stderr.strip().splitlines()[-1]}")
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("paratrain-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    licences = {Path(n).name for n in names if ".dist-info/licenses/" in n}
    assert licences == {"LICENSE", "NOTICE"}
    assert "paratrain/training/_assets/digits.csv.gz" in names
    assert "paratrain/training/_assets/digits-NOTICE.txt" in names
